"""What a device is and what the node advertises: the inventory, its health, and how a device reaches
a container (pure).

Both front-ends hand out these devices: the device plugins (`sharing.deviceplugin`) and, later, a DRA
driver. `inventory` builds {resource name: devices} from the observed node and its config, with
health from XIDs (`xids`); `injection` names the strategies that give a container its devices.
"""

from sharing.devices.injection import (
    CDI_KIND,
    ENVVAR_BY_UUID,
    DeviceIdStrategy,
    DeviceListStrategy,
    Injection,
    device_name,
)
from sharing.devices.inventory import (
    GPU_RESOURCE,
    REPLICA_SEPARATOR,
    Device,
    DeviceId,
    Health,
    HealthState,
    Inventory,
    build_inventory,
    forms,
    reformed,
    with_health,
    withdraw,
)
from sharing.devices.mps import (
    DEFAULT_MPS_ROOT,
    PIPE_ENV,
    ClientEdits,
    MpsSettings,
    client_edits,
    mps_layout,
    mps_settings,
    pipe_dir,
)
from sharing.devices.xids import APPLICATION_XIDS, describe

__all__ = [
    "APPLICATION_XIDS",
    "CDI_KIND",
    "DEFAULT_MPS_ROOT",
    "ENVVAR_BY_UUID",
    "GPU_RESOURCE",
    "PIPE_ENV",
    "REPLICA_SEPARATOR",
    "ClientEdits",
    "Device",
    "DeviceId",
    "DeviceIdStrategy",
    "DeviceListStrategy",
    "Health",
    "HealthState",
    "Injection",
    "Inventory",
    "MpsSettings",
    "build_inventory",
    "client_edits",
    "describe",
    "device_name",
    "forms",
    "mps_layout",
    "mps_settings",
    "pipe_dir",
    "reformed",
    "with_health",
    "withdraw",
]
