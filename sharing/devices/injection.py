"""How a device reaches a container: NVIDIA's device-list and device-ID strategies, and the CDI kind.

Whatever front-end hands devices out (the device plugins' Allocate, or a DRA driver's prepare) names
them the same way, and the CDI spec the agent writes (`sharing.gpu.cdi`) uses the same names. Pure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sharing.devices.inventory import Device

CDI_KIND = "k8s.gpu-sharing.io/gpu"
"""The CDI kind (vendor/class) of the spec the agent writes; its own, so it never collides with the
specs NVIDIA's tools generate (`nvidia.com/gpu`, `k8s.device-plugin.nvidia.com/gpu`)."""


class DeviceListStrategy(enum.Enum):
    """How Allocate hands devices to a container (NVIDIA's names and meanings)."""

    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI_CRI = "cdi-cri"


class DeviceIdStrategy(enum.Enum):
    """How devices are named to the container runtime."""

    UUID = "uuid"
    INDEX = "index"


@dataclass(frozen=True, slots=True)
class Injection:
    """The device-list strategies (at least one) and the device ID strategy."""

    strategies: frozenset[DeviceListStrategy] = frozenset({DeviceListStrategy.ENVVAR})
    ids: DeviceIdStrategy = DeviceIdStrategy.UUID
    mps_root: str = "/run/nvidia/mps"
    """mpsRoot: the host directory of the MPS daemons' pipes and shared memory (NVIDIA's name and
    default), which MPS clients get mounted (`sharing.devices.mps`)."""

    @property
    def cdi(self) -> bool:
        """True when a CDI strategy is chosen: the agent writes its CDI spec."""
        return bool(self.strategies & {DeviceListStrategy.CDI_ANNOTATIONS, DeviceListStrategy.CDI_CRI})


ENVVAR_BY_UUID = Injection()
"""The default: NVIDIA_VISIBLE_DEVICES with UUIDs."""


def device_name(device: Device, ids: DeviceIdStrategy) -> str:
    """What the container runtime is told: the UUID, or the index (`0`, `0:1`)."""
    return device.index if ids is DeviceIdStrategy.INDEX and device.index else device.uuid
