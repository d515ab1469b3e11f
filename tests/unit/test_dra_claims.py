"""Which devices a claim gets on this node, and which opaque configs the driver accepts (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from sharing.devices import MpsSettings
from sharing.devices.inventory import Device, DeviceId, Health
from sharing.dra.claims import Chosen, ClaimError, MpsRequest, check_config, ondemand_results, select
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
        f"{WHERE}.sharing: MPS is not chosen per claim for whole GPUs on this driver: the node's sharing "
        "config decides how its GPUs are shared; remove sharing (or use strategy TimeSlicing)",
        id="mps-on-a-whole-gpu",
    ),
    pytest.param(
        config(mig_config(sharing={"strategy": "MPS"}), ("mig",)),
        f"{WHERE}.sharing: MPS is served on MIG devices made on demand for the claim (`mig: dynamic`); "
        "gpu-1-mig-0 is a MIG device the node's config makes, shared as that config says: remove sharing "
        "(or use strategy TimeSlicing)",
        id="mps-on-a-static-mig-device",
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


# ---- MPS on an on-demand MIG device: the claim's own ------------------------------------------

MADE = "gpu-1-mig-3g-20gb-at-4"
"""An on-demand device, as prepare checks it before the instance is made."""
TO_MAKE = Device(
    DeviceId("(made at prepare)"), Health.HEALTHY, None, GpuUuid("GPU-1"), MigUuid("(made at prepare)")
)
MPS_WHERE = f"{WHERE}.sharing.mpsConfig"


def mps_asked(mps_config: Any, *devices: str) -> dict[str, MpsRequest]:
    sharing = {"strategy": "MPS"} if mps_config is None else {"strategy": "MPS", "mpsConfig": mps_config}
    results = [ours(d, "mig") for d in devices or (MADE,)]
    value = claim(ours("gpu-0"), *results, config=(config(mig_config(sharing=sharing), ("mig",)),))
    static = select(value, "node-a", DEVICES)
    return check_config(value, [*static, *(Chosen(r, TO_MAKE) for r in results if r.device != "gpu-1-mig-0")])


@pytest.mark.parametrize(
    ("mps_config", "asked"),
    [
        pytest.param(None, MpsRequest(), id="no-mpsConfig-no-limits"),
        pytest.param({}, MpsRequest(), id="empty"),
        pytest.param(
            {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "4Gi"},
            MpsRequest(50, 4096, f"{MPS_WHERE}.defaultPinnedDeviceMemoryLimit"),
            id="threads-and-memory",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "4Gi", "defaultPerDevicePinnedMemoryLimit": {"0": "2Gi"}},
            MpsRequest(None, 2048, f"{MPS_WHERE}.defaultPerDevicePinnedMemoryLimit.0"),
            id="per-device-overrides",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "1G"},
            MpsRequest(None, 953, f"{MPS_WHERE}.defaultPinnedDeviceMemoryLimit"),
            id="decimal-rounded-down-to-mib",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": 1073741824},
            MpsRequest(None, 1024, f"{MPS_WHERE}.defaultPinnedDeviceMemoryLimit"),
            id="bytes",
        ),
        pytest.param(
            {"multiUser": False, "defaultActiveThreadPercentage": 100}, MpsRequest(100), id="single-user"
        ),
    ],
)  # fmt: skip
def test_mps_on_an_on_demand_mig_device_is_the_claims_to_choose(mps_config: Any, asked: MpsRequest) -> None:
    assert {MADE: asked} == mps_asked(mps_config)


def test_time_slicing_an_on_demand_mig_device_asks_nothing_of_mps() -> None:
    sharing = {"strategy": "TimeSlicing"}
    value = claim(ours(MADE, "mig"), config=(config(mig_config(sharing=sharing), ("mig",)),))
    assert {} == check_config(value, to_make(value))


def to_make(value: ResourceClaimObject) -> list[Chosen]:
    """The claim's one on-demand device as prepare checks it."""
    return [Chosen(value.results[0], TO_MAKE)]


@pytest.mark.parametrize(
    ("mps_config", "message"),
    [
        pytest.param(
            {"defaultActiveThreadPercentage": 0},
            f"{MPS_WHERE}.defaultActiveThreadPercentage: 0 is not a whole percentage from 1 to 100",
            id="no-threads",
        ),
        pytest.param(
            {"defaultActiveThreadPercentage": 101},
            f"{MPS_WHERE}.defaultActiveThreadPercentage: 101 is not a whole percentage from 1 to 100",
            id="over-100",
        ),
        pytest.param(
            {"defaultActiveThreadPercentage": "50"},
            f"{MPS_WHERE}.defaultActiveThreadPercentage: '50' is not a whole percentage from 1 to 100",
            id="threads-a-string",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "1Ki"},
            f"{MPS_WHERE}.defaultPinnedDeviceMemoryLimit: '1Ki' is less than 1Mi (value set too low)",
            id="memory-too-low",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "lots"},
            f"{MPS_WHERE}.defaultPinnedDeviceMemoryLimit: 'lots' is not a memory size such as 4Gi, 512Mi "
            "or 1G",
            id="memory-not-a-quantity",
        ),
        pytest.param(
            {"defaultPerDevicePinnedMemoryLimit": {"1": "2Gi"}},
            f"{MPS_WHERE}.defaultPerDevicePinnedMemoryLimit.1: the daemon serves one device: key the limit "
            "by device index 0",
            id="per-device-index-1",
        ),
        pytest.param(
            {"defaultPerDevicePinnedMemoryLimit": {"MIG-5a0c1e2d-9b3f-4e6a-8d7c-0123456789ab": "2Gi"}},
            f"{MPS_WHERE}.defaultPerDevicePinnedMemoryLimit.MIG-5a0c1e2d-9b3f-4e6a-8d7c-0123456789ab: the "
            "MIG device is made at prepare, so its UUID is not known when the claim is written: key the "
            "limit by device index 0",
            id="per-device-uuid",
        ),
        pytest.param(
            {"multiUser": True},
            f"{MPS_WHERE}.multiUser: True: this driver starts MPS control daemons in single-user mode, as it "
            "does for the node's MPS GPUs: run the claim's containers as one user and remove it",
            id="multi-user",
        ),
        pytest.param(
            {"defaultActiveThreadPercentag": 50},
            f"{MPS_WHERE}: unknown field 'defaultActiveThreadPercentag' (known: "
            "defaultActiveThreadPercentage, defaultPerDevicePinnedMemoryLimit, "
            "defaultPinnedDeviceMemoryLimit, multiUser)",
            id="unknown-field",
        ),
        pytest.param("50%", f"{MPS_WHERE}: expected an object, got '50%'", id="not-an-object"),
    ],
)  # fmt: skip
def test_mps_limits_nvidias_driver_would_refuse_are_refused(mps_config: Any, message: str) -> None:
    with pytest.raises(ClaimError) as err:
        mps_asked(mps_config)
    assert message == str(err.value)


def test_mps_config_with_the_time_slicing_strategy_is_refused_in_nvidias_words() -> None:
    sharing = {"strategy": "TimeSlicing", "mpsConfig": {}}
    value = claim(ours(MADE, "mig"), config=(config(mig_config(sharing=sharing), ("mig",)),))
    with pytest.raises(ClaimError) as err:
        check_config(value, to_make(value))
    said = f"{WHERE}.sharing.mpsConfig: cannot use MpsConfig with the 'TimeSlicing' strategy"
    assert said == str(err.value)


def test_mps_for_two_mig_devices_of_one_claim_is_refused() -> None:
    other = "gpu-0-mig-1g-5gb-at-0"
    with pytest.raises(ClaimError) as err:
        mps_asked({}, MADE, other)
    assert (
        f"claim ns/c: MPS is asked for 2 MIG devices ({other}, {MADE}), but a container is the client of "
        "one MPS control daemon and each MIG device has its own: ask for one MIG device in a claim shared "
        "with MPS"
    ) == str(err.value)


def test_the_daemons_defaults_are_the_claims_limits_or_the_whole_device() -> None:
    assert MpsSettings(1, 100, 19968) == MpsRequest().settings("ns/c", MADE, "3g.20gb", 19968)
    assert MpsSettings(1, 30, 4096) == MpsRequest(30, 4096, "x").settings("ns/c", MADE, "3g.20gb", 19968)
    with pytest.raises(ClaimError) as err:
        MpsRequest(None, 20480, "p.defaultPinnedDeviceMemoryLimit").settings("ns/c", MADE, "3g.20gb", 19968)
    assert (
        f"claim ns/c: p.defaultPinnedDeviceMemoryLimit: 20480 MiB is more than the 19968 MiB of its 3g.20gb "
        f"device {MADE}"
    ) == str(err.value)
