"""The kubelet's gRPC APIs on the node side that every front-end shares (adapter).

`api/` holds the generated stubs of the kubelet's APIs (`hack/gen-proto.sh` from `proto/`): the
device-plugin API that `sharing.deviceplugin` serves and the PodResources API; `podresources` is the
PodResources client, which a DRA front-end needs as much as the device plugins do, and `holders`
reads who holds which device from it (failing closed when its answer cannot be believed), for the
rollout, `sharing status` and `sharing apply` alike.
"""

from sharing.kubelet.holders import BoundPods, Holders, HoldingsSource, device_of, read_holders
from sharing.kubelet.podresources import PodResourcesClient, recorded_allocations

__all__ = [
    "BoundPods",
    "Holders",
    "HoldingsSource",
    "PodResourcesClient",
    "device_of",
    "read_holders",
    "recorded_allocations",
]
