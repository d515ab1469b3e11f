"""Inventory: what the node advertises for observed GPUs, a sharing config and device health."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharing.config.spec import MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.devices.inventory import (
    Health,
    HealthState,
    build_inventory,
    device_id,
    inventory_from,
    mig_resource,
    parse_device_id,
    with_health,
    withdraw,
)
from sharing.errors import PluginError
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, HealthEvent, MigUuid, NodeState

A100 = "NVIDIA A100-SXM4-40GB"


def gpu(index: int, *migs: tuple[str, str], numa: int | None = None, product: str = A100) -> Gpu:
    """A GPU `GPU-<index>`; with (profile, MIG uuid) pairs it is in MIG mode with those devices."""
    instances = tuple(
        GpuInstance(
            id=n, profile=profile, start=n, size=1, compute_instances=(ComputeInstance(0, MigUuid(u)),)
        )
        for n, (profile, u) in enumerate(migs)
    )
    return Gpu(
        index=index,
        uuid=GpuUuid(f"GPU-{index}"),
        product=product,
        memory_mib=40960,
        mig_capable=True,
        mig_enabled=bool(migs),
        mig_pending=bool(migs),
        instances=instances,
        numa_node=numa,
    )


def config(*rules: Rule, strategy: MigStrategy = MigStrategy.MIXED, rename: bool = False) -> SharingConfig:
    return SharingConfig(name="test", mig_strategy=strategy, rename_by_default=rename, rules=rules)


def every(replicas: int = 1, **per_kind: int) -> Rule:
    """A rule for all GPUs with these replicas (per_kind keys: `gpu` or a profile with `_` for `.`)."""
    kinds = tuple(sorted((k.replace("_", "."), v) for k, v in per_kind.items()))
    return Rule(devices=Selector(all=True), replicas=Replicas(default=replicas, per_device_kind=kinds))


def ids(node: NodeState, cfg: SharingConfig | None) -> dict[str, list[str]]:
    return {name: [d.id for d in devices] for name, devices in build_inventory(node, cfg).resources}


MIG_NODE = NodeState((gpu(0, ("1g.5gb", "MIG-a"), ("1g.5gb", "MIG-b"), ("3g.20gb", "MIG-c")),))

CASES = [
    pytest.param(
        NodeState((gpu(0), gpu(1))), None, {"nvidia.com/gpu": ["GPU-0", "GPU-1"]}, id="no-config-full-gpus"
    ),
    pytest.param(
        MIG_NODE,
        None,
        {"nvidia.com/mig-1g.5gb": ["MIG-a", "MIG-b"], "nvidia.com/mig-3g.20gb": ["MIG-c"]},
        id="no-config-mig-per-profile",
    ),
    pytest.param(
        NodeState((gpu(0, ("1g.10gb+me", "MIG-m")), gpu(1))),
        config(),
        {"nvidia.com/gpu": ["GPU-1"], "nvidia.com/mig-1g.10gb.me": ["MIG-m"]},
        id="mixed-plus-me-becomes-dot-me",
    ),
    pytest.param(
        NodeState((gpu(0, ("1g.5gb", "MIG-a"), ("1g.5gb", "MIG-b")), gpu(1, ("1g.5gb", "MIG-c")))),
        config(strategy=MigStrategy.SINGLE),
        {"nvidia.com/gpu": ["MIG-a", "MIG-b", "MIG-c"]},
        id="single-uniform-as-gpu",
    ),
    pytest.param(
        MIG_NODE, config(strategy=MigStrategy.SINGLE), {}, id="single-not-uniform-advertises-no-mig"
    ),
    pytest.param(
        # A GPU in MIG mode can run nothing as a whole GPU: never hand it out as one.
        MIG_NODE,
        config(strategy=MigStrategy.NONE),
        {},
        id="none-never-advertises-a-mig-gpu-whole",
    ),
    pytest.param(
        NodeState((gpu(0),)),
        config(every(2)),
        {"nvidia.com/gpu": ["GPU-0::0", "GPU-0::1"]},
        id="replicas-keep-name",
    ),
    pytest.param(
        NodeState((gpu(0),)),
        config(every(3), rename=True),
        {"nvidia.com/gpu.shared": ["GPU-0::0", "GPU-0::1", "GPU-0::2"]},
        id="replicas-renamed-shared",
    ),
    pytest.param(
        MIG_NODE,
        config(every(1, **{"1g_5gb": 2}), rename=True),
        {
            "nvidia.com/mig-1g.5gb.shared": ["MIG-a::0", "MIG-a::1", "MIG-b::0", "MIG-b::1"],
            "nvidia.com/mig-3g.20gb": ["MIG-c"],
        },
        id="per-profile-replicas-mixed",
    ),
    pytest.param(
        NodeState((gpu(0, ("1g.5gb", "MIG-a")), gpu(1, ("1g.5gb", "MIG-b")))),
        config(every(2), strategy=MigStrategy.SINGLE),
        {"nvidia.com/gpu": ["MIG-a::0", "MIG-a::1", "MIG-b::0", "MIG-b::1"]},
        id="single-with-replicas",
    ),
    pytest.param(
        NodeState((gpu(0), gpu(1))),
        config(Rule(devices=Selector(indices=(0,)), replicas=Replicas(default=2)), rename=True),
        {"nvidia.com/gpu": ["GPU-1"], "nvidia.com/gpu.shared": ["GPU-0::0", "GPU-0::1"]},
        id="per-gpu-rule-unmatched-gpu-as-is",
    ),
    pytest.param(
        NodeState((gpu(0), gpu(1, product="Tesla T4"))),
        config(Rule(devices=Selector(product="A100-SXM4-40GB"), replicas=Replicas(default=2))),
        {"nvidia.com/gpu": ["GPU-0::0", "GPU-0::1", "GPU-1"]},
        id="product-selector-uses-catalog-name",
    ),
    pytest.param(
        NodeState((gpu(0, ("1g.5gb", "MIG-a")), gpu(1))),
        config(every(gpu=4, **{"1g_5gb": 1})),
        {
            "nvidia.com/gpu": ["GPU-1::0", "GPU-1::1", "GPU-1::2", "GPU-1::3"],
            "nvidia.com/mig-1g.5gb": ["MIG-a"],
        },
        id="gpu-kind-replicas-only-full-gpus",
    ),
    pytest.param(
        NodeState((gpu(0, ("1g.5gb", "MIG-a")),)), None, {"nvidia.com/mig-1g.5gb": ["MIG-a"]}, id="one-mig"
    ),
    pytest.param(NodeState(()), config(every(2)), {}, id="no-gpus"),
]


@pytest.mark.parametrize(("node", "cfg", "expected"), CASES)
def test_resources_and_ids(
    node: NodeState, cfg: SharingConfig | None, expected: dict[str, list[str]]
) -> None:
    assert expected == ids(node, cfg)


@pytest.mark.parametrize(
    ("node", "cfg", "needle"),
    [
        pytest.param(
            MIG_NODE, config(strategy=MigStrategy.SINGLE), "one MIG profile", id="single-not-uniform"
        ),
        pytest.param(MIG_NODE, config(strategy=MigStrategy.NONE), "migStrategy is none", id="none-with-mig"),
        pytest.param(
            NodeState((Gpu(0, GpuUuid("GPU-0"), A100, 40960, True, True, True),)),
            None,
            "no MIG devices",
            id="mig-on-no-devices",
        ),
    ],
)
def test_warnings_say_why(node: NodeState, cfg: SharingConfig | None, needle: str) -> None:
    (warning,) = build_inventory(node, cfg).warnings
    assert needle in warning


def test_device_fields_carry_gpu_mig_numa_and_replica() -> None:
    node = NodeState((gpu(0, ("1g.5gb", "MIG-a"), numa=1),))
    inventory = build_inventory(node, config(every(2)))
    first = inventory.devices("nvidia.com/mig-1g.5gb")[0]
    assert (first.id, first.gpu_uuid, first.mig_uuid, first.numa_node, first.replica, first.uuid) == (
        "MIG-a::0",
        "GPU-0",
        "MIG-a",
        1,
        0,
        "MIG-a",
    )
    assert inventory.devices("nvidia.com/absent") == ()


def test_fail_requests_greater_than_one_comes_from_config() -> None:
    cfg = SharingConfig(name="x", fail_requests_greater_than_one=True)
    assert build_inventory(NodeState((gpu(0),)), cfg).fail_requests_greater_than_one
    assert not build_inventory(NodeState((gpu(0),)), None).fail_requests_greater_than_one


@given(
    uuid=st.text(alphabet="ABCDEFabcdef0123456789-", min_size=1, max_size=50),
    replica=st.none() | st.integers(min_value=0, max_value=10_000),
)
def test_device_ids_round_trip(uuid: str, replica: int | None) -> None:
    assert (uuid, replica) == parse_device_id(device_id(uuid, replica))


@pytest.mark.parametrize(
    "bad", ["", "::1", "GPU-0::", "GPU-0::x", "GPU-0::-1", "GPU-0::1::2", "GPU-0::\u0661"]
)
def test_malformed_ids_are_errors(bad: str) -> None:
    with pytest.raises(PluginError, match="malformed device ID"):
        parse_device_id(bad)


def test_mig_resource_name() -> None:
    assert mig_resource("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"


# --- health overlay ------------------------------------------------------------------------

SHARED_NODE = NodeState(
    (
        gpu(0, ("1g.5gb", "MIG-a"), ("1g.5gb", "MIG-b")),
        gpu(1),
    )
)
SHARED_CFG = config(every(2))


def unhealthy(health: HealthState) -> set[str]:
    inventory = build_inventory(SHARED_NODE, SHARED_CFG, health)
    return {d.id for _, devices in inventory.resources for d in devices if d.health is Health.UNHEALTHY}


def event(gpu_uuid: str, healthy: bool, xid: int | None = 79, mig: str | None = None) -> HealthEvent:
    return HealthEvent(GpuUuid(gpu_uuid), healthy, xid, MigUuid(mig) if mig else None)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param([], set(), id="all-healthy"),
        pytest.param(
            [event("GPU-0", False)],
            {"MIG-a::0", "MIG-a::1", "MIG-b::0", "MIG-b::1"},
            id="gpu-xid-marks-all-its-mig-devices-and-replicas",
        ),
        pytest.param([event("GPU-1", False)], {"GPU-1::0", "GPU-1::1"}, id="gpu-xid-marks-all-replicas"),
        pytest.param(
            [event("GPU-0", False, mig="MIG-b")], {"MIG-b::0", "MIG-b::1"}, id="mig-xid-marks-only-it"
        ),
        pytest.param([event("GPU-0", False, xid=13)], set(), id="application-xid-ignored"),
        pytest.param(
            [event("GPU-0", False, xid=None)], {"MIG-a::0", "MIG-a::1", "MIG-b::0", "MIG-b::1"}, id="no-xid"
        ),
        pytest.param([event("GPU-1", False), event("GPU-1", True)], set(), id="gpu-recovers"),
        pytest.param(
            [event("GPU-0", False, mig="MIG-a"), event("GPU-0", False, mig="MIG-b"), event("GPU-0", True)],
            set(),
            id="gpu-recovery-clears-its-mig-devices",
        ),
        pytest.param(
            [
                event("GPU-0", False, mig="MIG-a"),
                event("GPU-0", False, mig="MIG-b"),
                event("GPU-0", True, mig="MIG-a"),
            ],
            {"MIG-b::0", "MIG-b::1"},
            id="mig-recovery-clears-only-it",
        ),
        pytest.param(
            [event("GPU-0", False), event("GPU-0", True, mig="MIG-a")],
            {"MIG-a::0", "MIG-a::1", "MIG-b::0", "MIG-b::1"},
            id="mig-recovery-does-not-clear-sick-gpu",
        ),
    ],
)
def test_health_overlay(events: list[HealthEvent], expected: set[str]) -> None:
    health = HealthState()
    for e in events:
        health = health.apply(e)
    assert expected == unhealthy(health)


def test_ignored_xids_are_configurable() -> None:
    assert HealthState().apply(event("GPU-1", False, xid=13), ignored_xids=()) != HealthState()
    assert HealthState().apply(event("GPU-1", False, xid=79), ignored_xids={79}) == HealthState()


def test_a_rules_own_rename_wins_over_rename_by_default() -> None:
    """NVIDIA's plugin parses `rename` and drops it; here each rule's rename is what the kubelet sees."""
    small = Rule(
        Selector(indices=(0,)), replicas=Replicas(2), rename=(("nvidia.com/gpu", "nvidia.com/gpu-small"),)
    )
    rest = Rule(Selector(all=True), replicas=Replicas(3))
    assert {
        "nvidia.com/gpu-small": ["GPU-0::0", "GPU-0::1"],
        "nvidia.com/gpu.shared": ["GPU-1::0", "GPU-1::1", "GPU-1::2"],
    } == ids(NodeState((gpu(0), gpu(1))), config(small, rest, rename=True))


def test_a_gpu_keeps_the_names_of_the_config_last_applied_to_it() -> None:
    """A change that failed on GPU 0 (still in MIG mode) must not advertise it under the new config."""
    node = NodeState((gpu(0, ("1g.5gb", "MIG-a"), ("1g.10gb", "MIG-b")), gpu(1)))
    old = config(strategy=MigStrategy.MIXED)
    new = config(every(4), strategy=MigStrategy.NONE)
    inventory = build_inventory(node, new, per_gpu={GpuUuid("GPU-0"): old})
    assert {
        "nvidia.com/gpu": ["GPU-1::0", "GPU-1::1", "GPU-1::2", "GPU-1::3"],
        "nvidia.com/mig-1g.10gb": ["MIG-b"],
        "nvidia.com/mig-1g.5gb": ["MIG-a"],
    } == {name: [d.id for d in devices] for name, devices in inventory.resources}


def test_withdraw_removes_a_device_with_all_its_replicas_and_empty_resources() -> None:
    node = NodeState((gpu(0, ("1g.5gb", "MIG-a"), ("3g.20gb", "MIG-c")), gpu(1)))
    inventory = build_inventory(node, config(every(2)))
    left = withdraw(inventory, {"MIG-a", "GPU-1"})
    assert {"nvidia.com/mig-3g.20gb": ["MIG-c::0", "MIG-c::1"]} == {
        name: [d.id for d in devices] for name, devices in left.resources
    }


def test_a_device_unhealthy_in_the_inventory_stays_unhealthy_under_the_health_overlay() -> None:
    node = NodeState((gpu(0),))
    inventory = build_inventory(node, None)
    ((name, (device,)),) = inventory.resources
    sick = inventory_from({name: [replace(device, health=Health.UNHEALTHY)]})
    assert [Health.UNHEALTHY] == [
        d.health for _, ds in with_health(sick, HealthState()).resources for d in ds
    ]
