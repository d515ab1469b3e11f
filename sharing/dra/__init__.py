"""The DRA front-end: the node's devices as ResourceSlices, claims prepared through the kubelet's DRA API.

A node is served by this front-end or by the device plugins (`sharing.deviceplugin`), never both.
`names` holds the names shared with NVIDIA's DRA driver; `claims` maps a claim's allocation to this
node's devices and checks its opaque config (pure); `prepare` prepares and unprepares claims, with
their CDI specs and the checkpoint (`sharing.store.claims`); `service` and `registration` are the
gRPC services the kubelet calls; `plugin` serves them on the kubelet's sockets; `ondemand` makes and
destroys the MIG instances of on-demand devices at prepare and unprepare.
"""

from sharing.dra.claims import ClaimError
from sharing.dra.ondemand import OnDemand
from sharing.dra.plugin import DraPaths, DraPlugin, Registration
from sharing.dra.prepare import ClaimKey, ClaimReader, Prepared, PreparedClaims, Preparer, Recorder

__all__ = [
    "ClaimError",
    "ClaimKey",
    "ClaimReader",
    "DraPaths",
    "DraPlugin",
    "OnDemand",
    "Prepared",
    "PreparedClaims",
    "Preparer",
    "Recorder",
    "Registration",
]
