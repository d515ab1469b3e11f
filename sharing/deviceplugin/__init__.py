"""The device-plugin front-end: one gRPC server per resource, registered with the kubelet (adapter).

`fleet` keeps one `plugin` server per advertised resource registered and streaming; `service` answers
the device-plugin API (ListAndWatch, GetPreferredAllocation, Allocate) by the pure `allocation` policy.
With `sharing.kubelet` the only package that imports `grpc`. A DRA front-end is its sibling.
"""

from sharing.deviceplugin.allocation import AllocationPolicy
from sharing.deviceplugin.fleet import DEFAULT_PLUGIN_DIR, Fleet, FleetSettings, PluginStatus
from sharing.deviceplugin.plugin import PluginServer
from sharing.deviceplugin.service import HANDED_OUT_KEPT_S

__all__ = [
    "DEFAULT_PLUGIN_DIR",
    "HANDED_OUT_KEPT_S",
    "AllocationPolicy",
    "Fleet",
    "FleetSettings",
    "PluginServer",
    "PluginStatus",
]
