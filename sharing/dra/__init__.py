"""The DRA front-end: the node's devices as ResourceSlices, claims prepared through the kubelet's DRA API.

A node is served by this front-end or by the device plugins (`sharing.deviceplugin`), never both.
`names` holds the names shared with NVIDIA's DRA driver; `claims` selects a claim's allocation results
that are ours, maps them to this node's devices and checks its opaque config (pure); `prepare` prepares
and unprepares claims, and `records` writes their CDI specs and the checkpoint (`sharing.store.claims`);
`service` and `registration` are the gRPC services the kubelet calls; `plugin` serves them on the
kubelet's sockets; `ondemand` makes and destroys the MIG instances of on-demand devices at prepare and
unprepare.
"""

from sharing.dra.claims import ClaimError, ClaimKey
from sharing.dra.ondemand import OnDemand
from sharing.dra.plugin import DraPaths, DraPlugin, Registration
from sharing.dra.prepare import ClaimReader, Prepared, Preparer, Recorder
from sharing.dra.records import PreparedClaims

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
