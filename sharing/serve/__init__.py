"""The kubelet-facing adapters: device-plugin gRPC servers and the PodResources client.

The only package that imports `grpc` and the generated `sharing.kubeletapi` stubs. The agent wires
`Fleet` (inventory and health in, registered plugins out) and `PodResourcesClient` (busy devices).
"""

from sharing.serve.fleet import DEFAULT_PLUGIN_DIR, Fleet, FleetSettings, PluginStatus
from sharing.serve.plugin import PluginServer
from sharing.serve.podresources import PodResourcesClient

__all__ = [
    "DEFAULT_PLUGIN_DIR",
    "Fleet",
    "FleetSettings",
    "PluginServer",
    "PluginStatus",
    "PodResourcesClient",
]
