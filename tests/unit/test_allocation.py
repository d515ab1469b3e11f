"""Allocation policy: preferred devices and what Allocate hands a container."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sharing.deviceplugin.allocation import (
    AllocationError,
    AllocationPolicy,
    ContainerAllocation,
    Mount,
    allocate,
    preferred_allocation,
)
from sharing.devices.injection import DeviceIdStrategy, DeviceListStrategy, Injection
from sharing.devices.inventory import Device, DeviceId, Health
from sharing.model import GpuUuid, MigUuid

DISTRIBUTED, PACKED = AllocationPolicy.DISTRIBUTED, AllocationPolicy.PACKED


def full(index: int, numa: int | None = None) -> Device:
    return Device(DeviceId(f"GPU-{index}"), Health.HEALTHY, numa, GpuUuid(f"GPU-{index}"), index=str(index))


def rep(index: int, n: int) -> Device:
    return Device(DeviceId(f"GPU-{index}::{n}"), Health.HEALTHY, None, GpuUuid(f"GPU-{index}"), replica=n)


def mig(index: int, name: str, n: int | None = None) -> Device:
    uuid = f"MIG-{index}{name}"
    return Device(
        DeviceId(uuid if n is None else f"{uuid}::{n}"),
        Health.HEALTHY,
        None,
        GpuUuid(f"GPU-{index}"),
        MigUuid(uuid),
        n,
        index=f"{index}:{ord(name) - ord('a')}",
    )


REPLICAS_2x2 = [rep(0, 0), rep(0, 1), rep(1, 0), rep(1, 1)]
REPLICAS_2x3 = [rep(g, n) for g in (0, 1) for n in range(3)]
NUMA_GPUS = [full(0, 0), full(1, 0), full(2, 1), full(3, 1)]
MIGS = [mig(0, "a"), mig(0, "b"), mig(1, "a")]
MIG_REPLICAS_ONE_GPU = [mig(0, "a", 0), mig(0, "a", 1), mig(0, "b", 0), mig(0, "b", 1)]


def every_id(devices: list[Device]) -> list[str]:
    return [d.id for d in devices]


PREFERRED = [
    pytest.param(
        REPLICAS_2x2, every_id(REPLICAS_2x2), [], 2, DISTRIBUTED, ["GPU-0::0", "GPU-1::0"], id="spread"
    ),
    pytest.param(
        REPLICAS_2x3,
        every_id(REPLICAS_2x3),
        [],
        3,
        DISTRIBUTED,
        ["GPU-0::0", "GPU-1::0", "GPU-0::1"],
        id="spread-3",
    ),
    pytest.param(
        REPLICAS_2x2,
        ["GPU-0::1", "GPU-1::0", "GPU-1::1"],
        [],
        1,
        DISTRIBUTED,
        ["GPU-1::0"],
        id="least-allocated-gpu",
    ),
    pytest.param(
        REPLICAS_2x3,
        ["GPU-0::1", "GPU-0::2", "GPU-1::1", "GPU-1::2"],
        [],
        2,
        DISTRIBUTED,
        ["GPU-0::1", "GPU-1::1"],
        id="tie-goes-to-gpu-not-yet-picked",
    ),
    pytest.param(REPLICAS_2x2, every_id(REPLICAS_2x2), [], 2, PACKED, ["GPU-0::0", "GPU-0::1"], id="packed"),
    pytest.param(
        REPLICAS_2x3,
        ["GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-1::1", "GPU-1::2"],
        [],
        2,
        PACKED,
        ["GPU-1::1", "GPU-1::2"],
        id="packed-busiest-gpu-first",
    ),
    pytest.param(
        REPLICAS_2x2,
        every_id(REPLICAS_2x2),
        ["GPU-1::1"],
        2,
        DISTRIBUTED,
        ["GPU-1::1", "GPU-0::0"],
        id="must-include-first-then-spread",
    ),
    pytest.param(
        MIGS, every_id(MIGS), [], 2, DISTRIBUTED, ["MIG-0a", "MIG-1a"], id="mig-spread-by-parent-gpu"
    ),
    pytest.param(MIGS, ["MIG-0b", "MIG-1a"], [], 1, PACKED, ["MIG-0b"], id="mig-packed-by-parent-gpu"),
    pytest.param(
        [mig(0, "a", 0), mig(0, "a", 1), mig(1, "a", 0)],
        ["MIG-0a::0", "MIG-0a::1", "MIG-1a::0"],
        [],
        2,
        DISTRIBUTED,
        ["MIG-0a::0", "MIG-1a::0"],
        id="mig-replicas-spread",
    ),
    pytest.param(
        MIG_REPLICAS_ONE_GPU,
        list(reversed(every_id(MIG_REPLICAS_ONE_GPU))),
        [],
        2,
        DISTRIBUTED,
        ["MIG-0a::0", "MIG-0b::0"],
        id="same-gpu-spread-over-mig-devices",
    ),
    pytest.param(
        MIG_REPLICAS_ONE_GPU,
        ["MIG-0a::0", "MIG-0a::1", "MIG-0b::0"],
        [],
        1,
        PACKED,
        ["MIG-0b::0"],
        id="same-gpu-packed-onto-busiest-mig-device",
    ),
    pytest.param(
        MIG_REPLICAS_ONE_GPU,
        ["MIG-0a::0", "MIG-0a::1", "MIG-0b::0"],
        [],
        1,
        DISTRIBUTED,
        ["MIG-0a::0"],
        id="same-gpu-spread-onto-idle-mig-device",
    ),
    pytest.param(
        NUMA_GPUS, ["GPU-0", "GPU-2", "GPU-3"], [], 2, DISTRIBUTED, ["GPU-2", "GPU-3"], id="numa-fits-node"
    ),
    pytest.param(
        NUMA_GPUS, every_id(NUMA_GPUS), ["GPU-2"], 2, DISTRIBUTED, ["GPU-2", "GPU-3"], id="numa-of-must"
    ),
    pytest.param(
        [full(0, 0), full(1, 1), full(2, 1), full(3, 1)],
        ["GPU-0", "GPU-1", "GPU-2", "GPU-3"],
        [],
        1,
        DISTRIBUTED,
        ["GPU-0"],
        id="numa-best-fit-keeps-big-node-free",
    ),
    pytest.param(
        NUMA_GPUS,
        ["GPU-0", "GPU-2", "GPU-3"],
        [],
        3,
        DISTRIBUTED,
        ["GPU-2", "GPU-3", "GPU-0"],
        id="numa-spill",
    ),
    pytest.param(
        [full(0), full(1), full(2)],
        ["GPU-2", "GPU-1"],
        [],
        1,
        DISTRIBUTED,
        ["GPU-1"],
        id="inventory-order-not-kubelets",
    ),
    pytest.param(
        REPLICAS_2x2,
        ["GPU-9::0", "GPU-1::1"],
        [],
        1,
        DISTRIBUTED,
        ["GPU-1::1"],
        id="unknown-available-never-picked",
    ),
]


@pytest.mark.parametrize(("devices", "available", "must", "size", "policy", "expected"), PREFERRED)
def test_preferred_allocation(  # noqa: PLR0917 - one argument per table column
    devices: list[Device],
    available: list[str],
    must: list[str],
    size: int,
    policy: AllocationPolicy,
    expected: list[str],
) -> None:
    got = preferred_allocation(
        "nvidia.com/gpu", devices, available=available, must_include=must, size=size, policy=policy
    )
    assert tuple(expected) == got


@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        pytest.param(["GPU-0::0"], ["GPU-7::0"], 1, "GPU-7::0 are not advertised", id="unknown-must-include"),
        pytest.param(["GPU-0::0"], [], 0, "allocation size 0 is invalid", id="size-zero"),
        pytest.param(
            ["GPU-0::0", "GPU-0::1"], ["GPU-0::0", "GPU-0::1"], 1, "is invalid", id="more-must-than-size"
        ),
        pytest.param(["GPU-0::0", "GPU-5::0"], [], 2, "only 1 of the available", id="not-enough-known"),
    ],
)
def test_preferred_allocation_errors(available: list[str], must: list[str], size: int, message: str) -> None:
    with pytest.raises(AllocationError, match=message):
        preferred_allocation(
            "nvidia.com/gpu", REPLICAS_2x2, available=available, must_include=must, size=size
        )


VISIBLE = "NVIDIA_VISIBLE_DEVICES"

ENV = Injection()
KIND = "k8s.gpu-sharing.io/gpu"


def using(*strategies: str, ids: str = "uuid") -> Injection:
    return Injection(frozenset(DeviceListStrategy(s) for s in strategies), DeviceIdStrategy(ids))


ALLOCATE = [
    pytest.param(
        NUMA_GPUS, ["GPU-2", "GPU-0"], ENV, ContainerAllocation(((VISIBLE, "GPU-2,GPU-0"),)), id="full"
    ),
    pytest.param(
        REPLICAS_2x2,
        ["GPU-0::0", "GPU-0::1"],
        ENV,
        ContainerAllocation(((VISIBLE, "GPU-0"),)),
        id="replicas-dedup",
    ),
    pytest.param(
        REPLICAS_2x2,
        ["GPU-1::0", "GPU-0::1"],
        ENV,
        ContainerAllocation(((VISIBLE, "GPU-1,GPU-0"),)),
        id="replicas-two-gpus",
    ),
    pytest.param(
        [mig(0, "a", 0), mig(0, "a", 1)],
        ["MIG-0a::1"],
        ENV,
        ContainerAllocation(((VISIBLE, "MIG-0a"),)),
        id="mig",
    ),
    pytest.param(
        MIGS,
        ["MIG-0b", "MIG-1a"],
        using("envvar", ids="index"),
        ContainerAllocation(((VISIBLE, "0:1,1:0"),)),
        id="index-ids",
    ),
    pytest.param(
        NUMA_GPUS,
        ["GPU-1"],
        using("volume-mounts"),
        ContainerAllocation(
            ((VISIBLE, "/var/run/nvidia-container-devices"),),
            mounts=(Mount("/var/run/nvidia-container-devices/GPU-1", "/dev/null"),),
        ),
        id="volume-mounts",
    ),
    pytest.param(
        MIGS,
        ["MIG-0a", "MIG-1a"],
        using("cdi-cri"),
        ContainerAllocation((), (f"{KIND}=MIG-0a", f"{KIND}=MIG-1a")),
        id="cdi-cri-only-no-variable",
    ),
    pytest.param(
        MIGS,
        ["MIG-0a"],
        using("cdi-annotations", ids="index"),
        ContainerAllocation((), annotations=(("cdi.k8s.io/gpu-sharing_gpu", f"{KIND}=0:0"),)),
        id="cdi-annotations",
    ),
    pytest.param(
        MIGS,
        ["MIG-1a"],
        using("envvar", "cdi-cri"),
        ContainerAllocation(((VISIBLE, "MIG-1a"),), (f"{KIND}=MIG-1a",)),
        id="envvar-and-cdi",
    ),
]


@pytest.mark.parametrize(("devices", "requested", "injection", "expected"), ALLOCATE)
def test_allocate(
    devices: list[Device], requested: list[str], injection: Injection, expected: ContainerAllocation
) -> None:
    assert expected == allocate("nvidia.com/gpu", devices, requested, injection=injection)


@pytest.mark.parametrize(
    ("devices", "requested", "fail_gt_one", "message"),
    [
        pytest.param(REPLICAS_2x2, ["GPU-0::0", "GPU-8"], False, "unknown device IDs GPU-8: ", id="unknown"),
        pytest.param(REPLICAS_2x2, [], False, "names no devices", id="empty"),
        pytest.param(
            [replace(rep(0, 0), health=Health.UNHEALTHY), rep(0, 1)],
            ["GPU-0::1", "GPU-0::0"],
            False,
            "devices GPU-0::0 are not healthy",
            id="unhealthy",
        ),
        pytest.param(
            REPLICAS_2x2, ["GPU-0::0", "GPU-0::0"], False, "more than once: GPU-0::0", id="duplicate"
        ),
        pytest.param(
            REPLICAS_2x2,
            ["GPU-0::0", "GPU-1::0"],
            True,
            "2 shared devices requested, but failRequestsGreaterThanOne allows at most 1",
            id="fail-requests-greater-than-one",
        ),
    ],
)
def test_allocate_refuses_with_reason(
    devices: list[Device], requested: list[str], fail_gt_one: bool, message: str
) -> None:
    with pytest.raises(AllocationError, match=message):
        allocate("nvidia.com/gpu.shared", devices, requested, fail_requests_greater_than_one=fail_gt_one)


@pytest.mark.parametrize(
    ("devices", "requested"),
    [
        pytest.param(REPLICAS_2x2, ["GPU-1::1"], id="one-replica"),
        pytest.param(NUMA_GPUS, ["GPU-0", "GPU-1"], id="full-gpus-are-not-replicas"),
    ],
)
def test_fail_requests_greater_than_one_allows(devices: list[Device], requested: list[str]) -> None:
    got = allocate("nvidia.com/gpu", devices, requested, fail_requests_greater_than_one=True)
    assert got.envs[0][0] == VISIBLE
