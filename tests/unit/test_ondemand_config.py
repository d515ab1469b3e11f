"""`mig: dynamic` in the config: MIG on, nothing made ahead, nothing to share; the applier leaves the
instances (the claims') alone, and a GPU held by a claim is not re-laid out under it."""

from __future__ import annotations

import pytest

from sharing.config import parse_configmap
from sharing.config.spec import MigMode, MigStrategy, Rule, Selector, SharingConfig, target_for
from sharing.devices import build_inventory
from sharing.mig import Outcome, Step, StepKind, Target, default_catalog, plan_change, verify
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState

CATALOG = default_catalog()
V1 = "version: v1\nmigStrategy: mixed\ngpus:\n"


def problems(text: str, products: list[str] | None = None) -> tuple[list[str], list[str]]:
    found = parse_configmap({"c": text}, products=products)
    return [str(p) for p in found.errors], [str(p) for p in found.warnings]


def a100(index: int, *, mig: bool, instances: tuple[GpuInstance, ...] = (), busy: bool = False) -> Gpu:
    return Gpu(index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", 40960, True, mig, mig, instances,
               busy=busy)  # fmt: skip


def instance(gi: int, profile: str, start: int, size: int) -> GpuInstance:
    return GpuInstance(gi, profile, start, size, (ComputeInstance(0, MigUuid(f"MIG-{gi}"), mig_index=gi),))


def test_dynamic_is_a_mig_word_and_mixes_with_static_rules() -> None:
    text = V1 + "- {devices: [0], mig: dynamic}\n- {devices: [1], mig: {3g.20gb: 2}}\n"
    found = parse_configmap({"c": text}, products=["A100-SXM4-40GB", "A100-SXM4-40GB"])
    assert [str(p) for p in found.errors] == []
    assert found.configs == (
        SharingConfig(
            "c",
            mig_strategy=MigStrategy.MIXED,
            rules=(
                Rule(Selector(indices=(0,)), MigMode.DYNAMIC),
                Rule(Selector(indices=(1,)), MigMode.ENABLED, instances=(("3g.20gb", 2),)),
            ),
        ),
    )
    assert [str(p) for p in found.warnings] == [
        "c: gpus[0].mig: mig: dynamic makes MIG devices per claim and works only on the DRA front-end: "
        "on a node served by the device plugins these GPUs get MIG mode on and offer nothing"
    ]


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        pytest.param(
            "{devices: all, mig: dynamic, replicas: 4}",
            "c: gpus[0].replicas: replicas are not available with mig: dynamic: MIG devices made on demand "
            "are given whole to one claim each",
            id="replicas",
        ),
        pytest.param(
            "{devices: all, mig: dynamic, replicas: {1g.5gb: 2}}",
            "c: gpus[0].replicas.1g.5gb: replicas are not available with mig: dynamic: MIG devices made on "
            "demand are given whole to one claim each",
            id="replicas-per-profile",
        ),
        pytest.param(
            "{devices: all, mig: dynamic, mps: {replicas: 2}}",
            "c: gpus[0].mps: MPS is not available with mig: dynamic: MIG devices made on demand are given "
            "whole to one claim each",
            id="mps",
        ),
    ],
)
def test_nothing_is_shared_on_a_dynamic_gpu(rule: str, error: str) -> None:
    errors, _ = problems(V1 + f"- {rule}\n")
    assert error in errors


def test_a_dynamic_rule_that_names_a_product_without_mig_is_refused() -> None:
    errors, _ = problems(V1 + "- {devices: {product: Tesla T4}, mig: dynamic}\n", products=["Tesla T4"])
    assert errors == ["c: gpus[0].mig: T4 has no MIG (not a MIG product)"]
    offline, _ = problems(V1 + "- {devices: {product: L4}, mig: dynamic}\n")
    assert offline == ["c: gpus[0].mig: L4 has no MIG (not a MIG product)"]


@pytest.mark.parametrize(
    ("devices", "products", "warning"),
    [
        pytest.param(
            "all", ["A100-SXM4-40GB", "L4"], "GPU 1 (L4) has no MIG: it is offered as a whole GPU", id="all"
        ),
        pytest.param(
            "[0, 1, 2]",
            ["A10", "H100-80GB-HBM3", "L4"],
            "GPU 0 (A10), GPU 2 (L4) have no MIG: they are offered as whole GPUs",
            id="indices",
        ),
        pytest.param(
            "all", ["Tesla T4"], "GPU 0 (T4) has no MIG: it is offered as a whole GPU", id="no-mig-gpu"
        ),
    ],
)
def test_a_gpu_without_mig_under_a_dynamic_rule_is_offered_whole_with_a_warning(
    devices: str, products: list[str], warning: str
) -> None:
    errors, warnings = problems(V1 + f"- {{devices: {devices}, mig: dynamic}}\n", products=products)
    assert errors == []
    assert f"c: gpus[0].mig: {warning} (mig: dynamic applies to the GPUs with MIG)" in warnings


def test_a_dynamic_rule_for_the_mig_product_of_a_mixed_node_leaves_the_others_alone() -> None:
    errors, warnings = problems(
        V1 + "- {devices: {product: A100-SXM4-40GB}, mig: dynamic}\n", products=["A100-SXM4-40GB", "L4"]
    )
    assert errors == []
    assert not [w for w in warnings if "no MIG" in w]


def l4(index: int) -> Gpu:
    return Gpu(
        index, GpuUuid(f"GPU-{index}"), "NVIDIA L4", 23034, False, False, False, compute_capability=(8, 9)
    )


def test_a_gpu_without_mig_under_a_dynamic_rule_is_a_whole_gpu_and_nothing_changes_on_it() -> None:
    config = SharingConfig("c", rules=(Rule(Selector(all=True), MigMode.DYNAMIC),))
    target = target_for(config, l4(1), CATALOG)
    assert target == Target(mig_enabled=False)
    change = plan_change(l4(1), target, CATALOG)
    assert (change.steps, change.failure) == ((), None)
    assert verify(change, l4(1)) is None
    inventory = build_inventory(NodeState((a100(0, mig=True), l4(1))), config, catalog=CATALOG)
    assert [(name, [d.uuid for d in devices]) for name, devices in inventory.resources] == [
        ("nvidia.com/gpu", ["GPU-1"])
    ]
    assert (inventory.dynamic, inventory.whole) == ({"GPU-0"}, {"GPU-1"})


def test_the_target_of_a_dynamic_gpu_is_mig_on_and_its_instances_left_alone() -> None:
    config = SharingConfig("c", rules=(Rule(Selector(all=True), MigMode.DYNAMIC),))
    assert target_for(config, a100(0, mig=False), CATALOG) == Target(mig_enabled=True, dynamic=True)


def test_a_dynamic_gpu_gets_mig_on_while_idle_and_no_instance() -> None:
    change = plan_change(a100(0, mig=False), Target(True, dynamic=True), CATALOG)
    assert change.steps == (Step(StepKind.ENABLE_MIG),)
    busy = plan_change(a100(0, mig=False, busy=True), Target(True, dynamic=True), CATALOG)
    assert busy.failure is Outcome.BLOCKED


def test_the_claims_instances_on_a_dynamic_gpu_are_never_destroyed() -> None:
    gpu = a100(0, mig=True, instances=(instance(1, "1g.5gb", 6, 1), instance(2, "3g.20gb", 0, 4)))
    change = plan_change(gpu, Target(True, dynamic=True), CATALOG)
    assert (change.steps, change.failure) == ((), None)
    assert verify(change, gpu) is None


def test_turning_a_dynamic_gpu_static_waits_for_the_claims_that_hold_it() -> None:
    gpu = a100(0, mig=True, instances=(instance(1, "1g.5gb", 6, 1),))
    static = Target(True, instances=(("7g.40gb", 1),))
    held = plan_change(gpu, static, CATALOG, busy_uuids={"MIG-1"})
    assert held.failure is Outcome.BLOCKED
    # A claim allocated a device that is not made yet holds the GPU itself: nothing is made around it.
    waiting = plan_change(a100(0, mig=True), static, CATALOG, busy_uuids={"GPU-0"})
    assert (waiting.failure, waiting.steps, waiting.blockers) == (Outcome.BLOCKED, (), ("GPU-0",))
    free = plan_change(gpu, static, CATALOG)
    assert [str(s) for s in free.steps] == ["destroy 1g.5gb@6 (GPU instance 1)", "create 7g.40gb@0"]


def test_the_device_plugins_offer_nothing_on_a_dynamic_gpu() -> None:
    gpus = (a100(0, mig=True, instances=(instance(1, "1g.5gb", 6, 1),)), a100(1, mig=True,
            instances=(instance(2, "3g.20gb", 0, 4),)))  # fmt: skip
    config = SharingConfig(
        "c",
        mig_strategy=MigStrategy.MIXED,
        rules=(
            Rule(Selector(indices=(0,)), MigMode.DYNAMIC),
            Rule(Selector(indices=(1,)), MigMode.UNCHANGED),
        ),
    )
    inventory = build_inventory(NodeState(gpus), config, catalog=CATALOG)
    assert [(name, [d.uuid for d in devices]) for name, devices in inventory.resources] == [
        ("nvidia.com/mig-3g.20gb", ["MIG-2"])
    ]


def test_turning_mig_off_on_a_dynamic_gpu_waits_for_a_claim_not_made_yet() -> None:
    change = plan_change(a100(0, mig=True), Target(False), CATALOG, busy_uuids={"GPU-0"})
    assert (change.failure, change.steps, change.blockers) == (Outcome.BLOCKED, (), ("GPU-0",))


def test_reclaim_foreign_is_a_word_of_a_dynamic_rule_and_off_by_default() -> None:
    text = V1 + "- {devices: [0], mig: dynamic, reclaimForeign: idle}\n- {devices: [1], mig: dynamic}\n"
    found = parse_configmap({"c": text})
    assert [str(p) for p in found.errors] == []
    (config,) = found.configs
    assert [(r.mig, r.reclaim_foreign) for r in config.rules] == [
        (MigMode.DYNAMIC, True),
        (MigMode.DYNAMIC, False),
    ]
    inventory = build_inventory(NodeState((a100(0, mig=True), a100(1, mig=True))), config, catalog=CATALOG)
    assert (inventory.dynamic, inventory.reclaim) == (frozenset({"GPU-0", "GPU-1"}), frozenset({"GPU-0"}))
    never = parse_configmap({"c": V1 + "- {devices: all, mig: dynamic, reclaimForeign: never}\n"})
    assert [r.reclaim_foreign for c in never.configs for r in c.rules] == [False]


@pytest.mark.parametrize(
    ("rule", "error"),
    [
        pytest.param(
            "{devices: all, mig: dynamic, reclaimForeign: always}",
            "c: gpus[0].reclaimForeign: expected one of never, idle, got a string ('always')",
            id="unknown-word",
        ),
        pytest.param(
            "{devices: all, mig: dynamic, reclaimForeign: true}",
            "c: gpus[0].reclaimForeign: expected one of never, idle, got a boolean (true)",
            id="boolean",
        ),
        pytest.param(
            "{devices: all, mig: {3g.20gb: 2}, reclaimForeign: idle}",
            "c: gpus[0].reclaimForeign: reclaimForeign applies to the MIG instances of a mig: dynamic rule "
            "only; remove it or set mig: dynamic",
            id="static-rule",
        ),
    ],
)
def test_a_bad_reclaim_foreign_is_an_error_that_names_it(rule: str, error: str) -> None:
    errors, _ = problems(V1 + f"- {rule}\n")
    assert errors == [error]
