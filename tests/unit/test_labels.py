"""Node labels as a scheduler or `kubectl get node --show-labels` sees them."""

from __future__ import annotations

from sharing.inventory import build_inventory
from sharing.labels import ConfigState, label_patch, node_labels, owned, sanitise
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.spec import MigMode, MigStrategy, Replicas, Rule, Selector, SharingConfig


def a100(index: int, *instances: tuple[str, int, int]) -> Gpu:
    gis = tuple(
        GpuInstance(
            id=i,
            profile=p,
            start=s,
            size=z,
            compute_instances=(ComputeInstance(0, MigUuid(f"MIG-{index}-{i}")),),
        )
        for i, (p, s, z) in enumerate(instances)
    )
    return Gpu(
        index, GpuUuid(f"GPU-a{index}"), "NVIDIA A100-SXM4-40GB", 40960, True, bool(gis), bool(gis), gis
    )


def h100(index: int) -> Gpu:
    return Gpu(index, GpuUuid(f"GPU-h{index}"), "NVIDIA H100 80GB HBM3", 81559, True, False, False)


MIXED_NODE = NodeState(
    (
        a100(0, ("3g.20gb", 4, 4), ("2g.10gb", 2, 2), ("1g.5gb", 0, 1), ("1g.5gb", 1, 1)),
        a100(1, ("3g.20gb", 4, 4), ("2g.10gb", 2, 2), ("1g.5gb", 0, 1), ("1g.5gb", 1, 1)),
        h100(2),
        h100(3),
    )
)
DEMO = SharingConfig(
    name="demo",
    mig_strategy=MigStrategy.MIXED,
    rules=(
        Rule(
            Selector(product="A100-SXM4-40GB"),
            MigMode.ENABLED,
            (("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)),
        ),
        Rule(Selector(product="H100-80GB-HBM3"), replicas=Replicas(4)),
    ),
)


def labels_for(
    node: NodeState, config: SharingConfig | None, state: ConfigState | None = None
) -> dict[str, str]:
    return node_labels(node, config, build_inventory(node, config), state)


def test_mig_slices_and_time_sliced_gpus_on_one_node() -> None:
    assert {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig.config.state": "success",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
        "nvidia.com/mig-1g.5gb.count": "4",
        "nvidia.com/mig-1g.5gb.replicas": "1",
        "nvidia.com/mig-1g.5gb.memory": "4864",
        "nvidia.com/mig-1g.5gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
        "nvidia.com/mig-1g.5gb.sharing-strategy": "none",
        "nvidia.com/mig-1g.5gb.slices.gi": "1",
        "nvidia.com/mig-1g.5gb.slices.ci": "1",
        "nvidia.com/mig-2g.10gb.count": "2",
        "nvidia.com/mig-2g.10gb.replicas": "1",
        "nvidia.com/mig-2g.10gb.memory": "9856",
        "nvidia.com/mig-2g.10gb.product": "NVIDIA-A100-SXM4-40GB-MIG-2g.10gb",
        "nvidia.com/mig-2g.10gb.sharing-strategy": "none",
        "nvidia.com/mig-2g.10gb.slices.gi": "2",
        "nvidia.com/mig-2g.10gb.slices.ci": "2",
        "nvidia.com/mig-3g.20gb.count": "2",
        "nvidia.com/mig-3g.20gb.replicas": "1",
        "nvidia.com/mig-3g.20gb.memory": "19968",
        "nvidia.com/mig-3g.20gb.product": "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
        "nvidia.com/mig-3g.20gb.sharing-strategy": "none",
        "nvidia.com/mig-3g.20gb.slices.gi": "3",
        "nvidia.com/mig-3g.20gb.slices.ci": "3",
    } == labels_for(MIXED_NODE, DEMO, ConfigState.SUCCESS)


def test_renamed_shared_resources_keep_gpu_labels_without_suffix() -> None:
    config = SharingConfig(
        "shared", rename_by_default=True, rules=(Rule(Selector(all=True), replicas=Replicas(8)),)
    )
    labels = labels_for(NodeState((h100(0),)), config)
    assert "NVIDIA-H100-80GB-HBM3" == labels["nvidia.com/gpu.product"]
    assert "8" == labels["nvidia.com/gpu.replicas"]
    assert "1" == labels["nvidia.com/gpu.count"]
    assert "nvidia.com/mig.strategy" not in labels


def test_single_strategy_labels_the_mig_device_as_the_gpu() -> None:
    node = NodeState((a100(0, *[("1g.5gb", i, 1) for i in range(7)]),))
    config = SharingConfig(
        "single",
        mig_strategy=MigStrategy.SINGLE,
        rules=(Rule(Selector(all=True), MigMode.ENABLED, (("1g.5gb", 7),)),),
    )
    labels = labels_for(node, config)
    assert "7" == labels["nvidia.com/gpu.count"]
    assert "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb" == labels["nvidia.com/gpu.product"]
    assert "4864" == labels["nvidia.com/gpu.memory"]
    assert "1" == labels["nvidia.com/gpu.slices.gi"]
    assert "single" == labels["nvidia.com/mig.strategy"]


def test_a_node_without_gpus_only_carries_the_state() -> None:
    assert {"nvidia.com/mig.config.state": "failed"} == labels_for(NodeState(()), None, ConfigState.FAILED)


def test_patch_sets_changes_removes_stale_owned_and_leaves_the_rest() -> None:
    current = {
        "kubernetes.io/hostname": "n1",
        "nvidia.com/device-plugin.config": "demo",
        "nvidia.com/mig.config": "all-1g",
        "nvidia.com/gpu.deploy.device-plugin": "true",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/mig-1g.5gb.me.count": "1",
    }
    desired = {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED"}
    assert {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
        "nvidia.com/mig-1g.5gb.me.count": None,
    } == label_patch(current, desired)
    assert {} == label_patch(desired, desired)


def test_ownership_is_exact() -> None:
    assert owned("nvidia.com/mig-1c.2g.10gb.count")
    assert owned("nvidia.com/mig-1g.10gb.me.product")
    assert owned("nvidia.com/mig.config.state")
    assert not owned("nvidia.com/mig.config")
    assert not owned("nvidia.com/device-plugin.config")
    assert not owned("nvidia.com/gpu.deploy.dcgm")
    assert not owned("nvidia.com/mig-manager.enabled")


def test_sanitise_like_gfd() -> None:
    assert "NVIDIA-A100-SXM4-40GB-MIG-1g.5gbme" == sanitise("NVIDIA A100-SXM4-40GB", "MIG", "1g.5gb+me")
    assert "Tesla-T4" == sanitise("Tesla  T4")
