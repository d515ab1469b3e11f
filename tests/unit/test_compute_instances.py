"""A compute instance smaller than its GPU instance (`1c.3g.20gb`) is a MIG device of its own profile, as
NVIDIA names it: advertised, labelled and published under that name, never as the GPU instance's, and
no static layout takes its GPU instance for a device of the GPU instance's profile."""

from __future__ import annotations

import pytest

from sharing.config.spec import MigStrategy, SharingConfig
from sharing.devices import build_inventory
from sharing.dra.slices import build_slices
from sharing.labels import node_labels
from sharing.mig import (
    Existing,
    Infeasible,
    Outcome,
    StepKind,
    Target,
    default_catalog,
    device_profile,
    plan_change,
    plan_gpu,
    verify,
)
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.ops.status import ConfigStatus, status_document

CATALOG = default_catalog()
A100 = next(p for p in CATALOG.products if p.name == "A100-SXM4-40GB")


def ci(n: int, slices: int | None, *, busy: bool = False, sm: int | None = None) -> ComputeInstance:
    return ComputeInstance(n, MigUuid(f"MIG-{n}"), busy=busy, mig_index=n, slices=slices, multiprocessors=sm)


def gi(profile: str, start: int, *cis: ComputeInstance, n: int = 1) -> GpuInstance:
    return GpuInstance(n, profile, start, A100.require_profile(profile).size, cis)


def a100(*instances: GpuInstance) -> Gpu:
    return Gpu(0, GpuUuid("GPU-0"), "NVIDIA A100-SXM4-40GB", 40960, True, True, True, instances)


# Three compute instances of one slice in a 3g.20gb GPU instance at slot 4, made outside the agent
# (nvidia-smi mig -cci 0,0,0 -gi <id>); their multiprocessors as NVML's compute-instance profile says.
SPLIT = gi("3g.20gb", 4, ci(0, 1, sm=14), ci(1, 1, sm=14), ci(2, 1, sm=14))
WHOLE = gi("3g.20gb", 0, ci(3, 3), n=2)


@pytest.mark.parametrize(
    ("instance", "compute", "expected"),
    [
        pytest.param("3g.20gb", 3, "3g.20gb", id="spanning"),
        pytest.param("3g.20gb", 1, "1c.3g.20gb", id="one-slice-of-three"),
        pytest.param("3g.20gb", 2, "2c.3g.20gb", id="two-slices-of-three"),
        pytest.param("7g.40gb", 7, "7g.40gb", id="7g-spanning-its-8-memory-slots"),
        pytest.param("7g.40gb", 4, "4c.7g.40gb", id="4c-of-7g"),
        pytest.param("2g.10gb+me", 1, "1c.2g.10gb+me", id="attribute-stays-last"),
        pytest.param("3g.20gb", None, "3g.20gb", id="size-not-read"),
    ],
)
def test_a_mig_device_goes_by_go_nvlibs_name(instance: str, compute: int | None, expected: str) -> None:
    """go-nvlib MigProfileInfo.String: `%dg.%dgb%s` when C == G, else `%dc.%dg.%dgb%s`."""
    assert expected == device_profile(GpuInstance(0, instance, 0, 1), ci(0, compute))


def test_each_compute_instance_is_advertised_under_its_own_profile_never_the_gpu_instances() -> None:
    inventory = build_inventory(NodeState((a100(WHOLE, SPLIT),)), None)
    assert {
        "nvidia.com/mig-1c.3g.20gb": ["MIG-0", "MIG-1", "MIG-2"],
        "nvidia.com/mig-3g.20gb": ["MIG-3"],  # a pod asking for 3g.20gb gets all three compute slices
    } == {name: [d.id for d in devices] for name, devices in inventory.resources}


def test_single_strategy_counts_a_compute_instance_of_another_size_as_another_profile() -> None:
    config = SharingConfig(name="s", mig_strategy=MigStrategy.SINGLE)
    inventory = build_inventory(NodeState((a100(WHOLE, SPLIT),)), config)
    assert () == inventory.resources
    (warning,) = inventory.warnings
    assert "found 1c.3g.20gb x3, 3g.20gb x1" in warning


def test_gfd_labels_of_a_compute_instance_are_its_own_profiles() -> None:
    node = NodeState((a100(WHOLE, SPLIT),))
    labels = node_labels(node, None, build_inventory(node, None), None)
    mine = {k: v for k, v in labels.items() if k.startswith("nvidia.com/mig-1c.3g.20gb.")}
    assert {
        "nvidia.com/mig-1c.3g.20gb.count": "3",
        "nvidia.com/mig-1c.3g.20gb.replicas": "1",
        "nvidia.com/mig-1c.3g.20gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1c.3g.20gb",
        "nvidia.com/mig-1c.3g.20gb.sharing-strategy": "none",
        "nvidia.com/mig-1c.3g.20gb.memory": "19968",  # the GPU instance's: its compute instances share it
        "nvidia.com/mig-1c.3g.20gb.multiprocessors": "14",
        "nvidia.com/mig-1c.3g.20gb.slices.gi": "3",
        "nvidia.com/mig-1c.3g.20gb.slices.ci": "1",
        "nvidia.com/mig-1c.3g.20gb.engines.copy": "3",
        "nvidia.com/mig-1c.3g.20gb.engines.decoder": "2",
        "nvidia.com/mig-1c.3g.20gb.engines.encoder": "0",
        "nvidia.com/mig-1c.3g.20gb.engines.jpeg": "0",
        "nvidia.com/mig-1c.3g.20gb.engines.ofa": "0",
    } == mine
    assert ("1", "42") == (
        labels["nvidia.com/mig-3g.20gb.count"],
        labels["nvidia.com/mig-3g.20gb.multiprocessors"],
    )


def test_dra_publishes_a_compute_instance_with_its_own_profile_and_multiprocessors() -> None:
    node = NodeState((a100(WHOLE, SPLIT),))
    published = {
        d.name: (dict(d.attributes)["profile"], dict(d.capacity)["multiprocessors"].value)
        for s in build_slices("node-a", node, build_inventory(node, None), CATALOG)
        for d in s.devices
    }
    assert sorted(published.values()) == [("1c.3g.20gb", "14")] * 3 + [("3g.20gb", "42")]


def test_sharing_status_names_each_slices_own_profile() -> None:
    node = NodeState((a100(WHOLE, SPLIT),))
    document = status_document("n", node, build_inventory(node, None), (), ConfigStatus())
    assert [
        ("MIG-0", "1c.3g.20gb"),
        ("MIG-1", "1c.3g.20gb"),
        ("MIG-2", "1c.3g.20gb"),
        ("MIG-3", "3g.20gb"),
    ] == (sorted((s["id"], s["profile"]) for s in document["gpus"][0]["slices"]))


def test_a_static_layout_never_keeps_a_split_gpu_instance_for_its_profile() -> None:
    """An idle split 3g.20gb where the config wants a 3g.20gb: destroyed and made again whole."""
    change = plan_change(a100(SPLIT), Target(True, (("3g.20gb", 1),)), CATALOG)
    assert [(StepKind.DESTROY, 4), (StepKind.CREATE, 4)] == [(s.kind, s.start) for s in change.steps]


def test_a_busy_split_gpu_instance_blocks_the_layout_and_is_never_touched() -> None:
    busy = gi("3g.20gb", 4, ci(0, 1, busy=True), ci(1, 1))
    change = plan_change(a100(busy), Target(True, (("3g.20gb", 1),)), CATALOG)
    assert (Outcome.BLOCKED, ()) == (change.failure, change.steps)
    assert "split into compute instances smaller than it, so it is no 3g.20gb device" in change.reason
    plan = plan_gpu(A100, [Existing("3g.20gb", 4, busy=True, whole=False)], {"3g.20gb": 1})
    assert isinstance(plan, Infeasible)


def test_verify_refuses_a_split_gpu_instance_where_the_layout_wants_its_profile() -> None:
    change = plan_change(a100(), Target(True, (("3g.20gb", 1),)), CATALOG)
    assert "GPU instances split into smaller compute instances: 3g.20gb@4" == verify(change, a100(SPLIT))
    assert verify(change, a100(gi("3g.20gb", 4, ci(0, 3)))) is None


def test_mig_on_without_instances_destroys_an_idle_split_one_as_any_other() -> None:
    change = plan_change(a100(SPLIT), Target(True, ()), CATALOG)
    assert [StepKind.DESTROY] == [s.kind for s in change.steps]
