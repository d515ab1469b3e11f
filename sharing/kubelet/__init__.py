"""The kubelet's gRPC APIs on the node side that every front-end shares (adapter).

`api/` holds the generated stubs of the kubelet's APIs (`hack/gen-proto.sh` from `proto/`): the
device-plugin API that `sharing.deviceplugin` serves and the PodResources API; `podresources` is the
PodResources client (who holds which device), which a DRA front-end needs as much as the device
plugins do.
"""

from sharing.kubelet.podresources import PodResourcesClient, recorded_allocations

__all__ = ["PodResourcesClient", "recorded_allocations"]
