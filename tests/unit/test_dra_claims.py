"""Which devices a claim gets on this node, and which opaque configs the driver accepts (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from sharing.devices.inventory import Device, DeviceId, Health
from sharing.dra.claims import ClaimError, check_config, ondemand_results, select
from sharing.dra.names import DRIVER
from sharing.kube.api import AllocatedConfig, AllocatedDevice, ResourceClaimObject
from sharing.model import GpuUuid, MigUuid

GPU = Device(DeviceId("GPU-0"), Health.HEALTHY, None, GpuUuid("GPU-0"), index="0")
MIG = Device(DeviceId("MIG-a"), Health.HEALTHY, None, GpuUuid("GPU-1"), MigUuid("MIG-a"), index="1:0")
DEVICES = {"gpu-0": GPU, "gpu-1-mig-0": MIG}
V1BETA1 = "resource.nvidia.com/v1beta1"


def claim(*results: AllocatedDevice, config: tuple[AllocatedConfig, ...] = ()) -> ResourceClaimObject:
    return ResourceClaimObject("ns", "c", "uid-1", True, results, config)


def ours(device: str, request: str = "gpu", pool: str = "node-a") -> AllocatedDevice:
    return AllocatedDevice(request, DRIVER, pool, device)


def test_select_takes_our_results_and_maps_them_to_devices() -> None:
    other = AllocatedDevice("nic", "net.example.com", "node-a", "eth0")
    chosen = select(claim(ours("gpu-0"), other, ours("gpu-1-mig-0", "mig")), "node-a", DEVICES)
    assert [("gpu", GPU), ("mig", MIG)] == [(c.result.request, c.device) for c in chosen]


def test_on_demand_devices_are_left_to_be_made() -> None:
    made = ours("gpu-1-mig-3g-20gb-at-4", "mig")
    other = AllocatedDevice("mig", "net.example.com", "node-a", "gpu-1-mig-1g-5gb-at-0")
    value = claim(ours("gpu-0"), made, other)
    assert ([GPU], (made,)) == ([c.device for c in select(value, "node-a", DEVICES)], ondemand_results(value))


def test_an_on_demand_device_of_another_pool_is_refused() -> None:
    with pytest.raises(ClaimError) as err:
        select(claim(ours("gpu-0-mig-1g-5gb-at-0", pool="node-b")), "node-a", DEVICES)
    assert "device gpu-0-mig-1g-5gb-at-0 of pool node-b is not on this node (pool node-a)" in str(err.value)


@pytest.mark.parametrize(
    ("allocated", "result", "message"),
    [
        pytest.param(False, None, "claim ns/c is not allocated yet (no status.allocation)", id="unallocated"),
        pytest.param(
            True, ours("gpu-0", pool="node-b"),
            "claim ns/c: status.allocation.devices.results[0]: device gpu-0 of pool node-b is not on this "
            "node (pool node-a)",
            id="other-pool",
        ),
        pytest.param(
            True, ours("gpu-5"),
            "claim ns/c: status.allocation.devices.results[0]: device gpu-5 is not one this node has now (it "
            "has gpu-0, gpu-1-mig-0); the claim was allocated from an out-of-date ResourceSlice: delete the "
            "claim (or its pod) so that it is allocated again",
            id="unknown-device",
        ),
    ],
)  # fmt: skip
def test_select_refuses(allocated: bool, result: AllocatedDevice | None, message: str) -> None:
    value = ResourceClaimObject("ns", "c", "uid-1", allocated, (result,) if result else ())
    with pytest.raises(ClaimError) as err:
        select(value, "node-a", DEVICES)
    assert message == str(err.value)


def config(
    parameters: dict[str, Any], requests: tuple[str, ...] = (), driver: str = DRIVER
) -> AllocatedConfig:
    return AllocatedConfig("FromClaim", requests, driver, parameters)


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": V1BETA1, "kind": "GpuConfig", **fields}


def mig_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": V1BETA1, "kind": "MigDeviceConfig", **fields}


ACCEPTED = [
    pytest.param(config(gpu_config()), id="gpu-exclusive"),
    pytest.param(config(gpu_config(sharing={"strategy": "TimeSlicing"})), id="gpu-time-slicing"),
    pytest.param(
        config(gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}})),
        id="gpu-default-interval",
    ),
    pytest.param(config(mig_config(sharing={"strategy": "TimeSlicing"}), ("mig",)), id="mig-time-slicing"),
    pytest.param(config(gpu_config(), ("gpu",)), id="gpu-config-for-a-gpu-request"),
    pytest.param(config(mig_config(), ("mig",)), id="mig-config-for-a-subrequest's-main-request"),
    pytest.param(config({"anything": 1}, driver="other.example.com"), id="another-driver's-config"),
]


@pytest.mark.parametrize("entry", ACCEPTED)
def test_accepted_configs(entry: AllocatedConfig) -> None:
    value = claim(ours("gpu-0"), ours("gpu-1-mig-0", "mig/small"), config=(entry,))
    check_config(value, select(value, "node-a", DEVICES))


WHERE = "claim ns/c: status.allocation.devices.config[0].opaque.parameters"
REFUSED = [
    pytest.param(
        config({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}),
        f"{WHERE}: apiVersion 'resource.nvidia.com/v1', kind 'GpuConfig' is not a config of driver "
        "gpu.nvidia.com: use apiVersion resource.nvidia.com/v1beta1 with kind GpuConfig (whole GPUs) or "
        "MigDeviceConfig (MIG devices)",
        id="wrong-api-version",
    ),
    pytest.param(
        config({"apiVersion": V1BETA1, "kind": "VfioDeviceConfig"}),
        f"{WHERE}: apiVersion 'resource.nvidia.com/v1beta1', kind 'VfioDeviceConfig' is not a config of "
        "driver gpu.nvidia.com: use apiVersion resource.nvidia.com/v1beta1 with kind GpuConfig (whole GPUs) "
        "or MigDeviceConfig (MIG devices)",
        id="unsupported-kind",
    ),
    pytest.param(
        config(gpu_config(sharng={})),
        f"{WHERE}: unknown field 'sharng' (known: apiVersion, kind, sharing)",
        id="unknown-field",
    ),
    pytest.param(
        config(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})),
        f"{WHERE}.sharing: MPS is not chosen per claim on this driver: the node's sharing config decides "
        "how its GPUs are shared; remove sharing (or use strategy TimeSlicing)",
        id="mps",
    ),
    pytest.param(
        config(gpu_config(sharing={"strategy": "Spatial"})),
        f"{WHERE}.sharing.strategy: 'Spatial' is not TimeSlicing or MPS",
        id="unknown-strategy",
    ),
    pytest.param(
        config(gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})),
        f"{WHERE}.sharing.timeSlicingConfig.interval: 'Long': this driver leaves the time-slice interval at "
        "the GPU driver's default; remove it or set it to Default",
        id="interval",
    ),
    pytest.param(
        config(mig_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}), ("mig",)),
        f"{WHERE}.sharing.timeSlicingConfig: a MIG device has no time-slice interval; remove it",
        id="mig-interval",
    ),
    pytest.param(
        config(gpu_config(sharing="TimeSlicing")),
        f"{WHERE}.sharing: expected an object, got 'TimeSlicing'",
        id="sharing-not-an-object",
    ),
    pytest.param(
        config(gpu_config(), ("mig",)),
        f"{WHERE}: a GpuConfig for request 'mig/small', whose device gpu-1-mig-0 is a MIG device: use kind "
        "MigDeviceConfig",
        id="gpu-config-on-a-mig-device",
    ),
    pytest.param(
        config(mig_config(), ("gpu",)),
        f"{WHERE}: a MigDeviceConfig for request 'gpu', whose device gpu-0 is a whole GPU: use kind "
        "GpuConfig",
        id="mig-config-on-a-gpu",
    ),
]


@pytest.mark.parametrize(("entry", "message"), REFUSED)
def test_refused_configs(entry: AllocatedConfig, message: str) -> None:
    value = claim(ours("gpu-0"), ours("gpu-1-mig-0", "mig/small"), config=(entry,))
    with pytest.raises(ClaimError) as err:
        check_config(value, select(value, "node-a", DEVICES))
    assert message == str(err.value)
