"""The DRA health stream's device list (pure): the pool's devices, and the on-demand MIG devices
made for claims, unhealthy when their GPU or they themselves had an XID."""

from __future__ import annotations

from sharing.devices import HealthState
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.dra.service import DeviceHealthState, health_of
from sharing.model import GpuUuid, MigUuid
from sharing.store import OwnedInstance, PreparedDevice

GPU0, GPU1 = GpuUuid("GPU-0"), GpuUuid("GPU-1")


def made(device: str, gpu: GpuUuid, mig: str) -> PreparedDevice:
    return PreparedDevice(
        ("mig",), "node-a", device, mig, gpu, (), instance=OwnedInstance(gpu, "1g.5gb", 0, 1, 1, 0)
    )


def test_on_demand_devices_follow_their_gpu_and_their_own_xids() -> None:
    static = Inventory(
        (
            (
                ResourceName("nvidia.com/gpu"),
                (Device(DeviceId("GPU-2"), Health.HEALTHY, None, GpuUuid("GPU-2"), index="2"),),
            ),
        )
    )
    devices = (made("gpu-0-mig-1g-5gb-at-0", GPU0, "MIG-a"), made("gpu-0-mig-1g-5gb-at-1", GPU0, "MIG-b"),
               made("gpu-1-mig-1g-5gb-at-0", GPU1, "MIG-c"))  # fmt: skip
    health = HealthState(
        unhealthy_gpus=frozenset({GPU1}), unhealthy_migs=frozenset({(GPU0, MigUuid("MIG-b"))})
    )

    assert (
        DeviceHealthState("gpu-0-mig-1g-5gb-at-0", True),
        DeviceHealthState("gpu-0-mig-1g-5gb-at-1", False),
        DeviceHealthState("gpu-1-mig-1g-5gb-at-0", False),
        DeviceHealthState("gpu-2", True),
    ) == health_of(static, devices, health)
    assert all(d.healthy for d in health_of(static, devices))
