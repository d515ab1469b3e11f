"""Node labels as a scheduler or `kubectl get node --show-labels` sees them."""

from __future__ import annotations

import dataclasses

import pytest
import structlog

from sharing.config import parse_config
from sharing.config.spec import MigMode, MigStrategy, Replicas, Rule, Selector, Sharing, SharingConfig
from sharing.devices.inventory import build_inventory
from sharing.kube import Watched
from sharing.kube.publish import NodePublisher
from sharing.labels import ConfigState, label_patch, node_labels, owned, sanitise
from sharing.labels.gfd import family, product_value
from sharing.mig.catalog import Engines, Product, Profile, default_catalog
from sharing.model import ComputeInstance, DriverInfo, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.rollout.verdict import Verdict
from tests.unit.fakekube import FakeKube, metadata_problems

CATALOG = default_catalog()


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
        "nvidia.com/mps.capable": "false",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig.config.state": "success",
        "nvidia.com/gpu.mode": "unknown",
        "nvidia.com/gpu.machine": "unknown",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
        "nvidia.com/mig-1g.5gb.count": "4",
        "nvidia.com/mig-1g.5gb.replicas": "1",
        "nvidia.com/mig-1g.5gb.memory": "4864",
        "nvidia.com/mig-1g.5gb.multiprocessors": "14",
        "nvidia.com/mig-1g.5gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
        "nvidia.com/mig-1g.5gb.sharing-strategy": "none",
        "nvidia.com/mig-1g.5gb.slices.gi": "1",
        "nvidia.com/mig-1g.5gb.slices.ci": "1",
        "nvidia.com/mig-1g.5gb.engines.copy": "1",
        "nvidia.com/mig-1g.5gb.engines.decoder": "0",
        "nvidia.com/mig-1g.5gb.engines.encoder": "0",
        "nvidia.com/mig-1g.5gb.engines.jpeg": "0",
        "nvidia.com/mig-1g.5gb.engines.ofa": "0",
        "nvidia.com/mig-2g.10gb.count": "2",
        "nvidia.com/mig-2g.10gb.replicas": "1",
        "nvidia.com/mig-2g.10gb.memory": "9856",
        "nvidia.com/mig-2g.10gb.multiprocessors": "28",
        "nvidia.com/mig-2g.10gb.product": "NVIDIA-A100-SXM4-40GB-MIG-2g.10gb",
        "nvidia.com/mig-2g.10gb.sharing-strategy": "none",
        "nvidia.com/mig-2g.10gb.slices.gi": "2",
        "nvidia.com/mig-2g.10gb.slices.ci": "2",
        "nvidia.com/mig-2g.10gb.engines.copy": "2",
        "nvidia.com/mig-2g.10gb.engines.decoder": "1",
        "nvidia.com/mig-2g.10gb.engines.encoder": "0",
        "nvidia.com/mig-2g.10gb.engines.jpeg": "0",
        "nvidia.com/mig-2g.10gb.engines.ofa": "0",
        "nvidia.com/mig-3g.20gb.count": "2",
        "nvidia.com/mig-3g.20gb.replicas": "1",
        "nvidia.com/mig-3g.20gb.memory": "19968",
        "nvidia.com/mig-3g.20gb.multiprocessors": "42",
        "nvidia.com/mig-3g.20gb.product": "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
        "nvidia.com/mig-3g.20gb.sharing-strategy": "none",
        "nvidia.com/mig-3g.20gb.slices.gi": "3",
        "nvidia.com/mig-3g.20gb.slices.ci": "3",
        "nvidia.com/mig-3g.20gb.engines.copy": "3",
        "nvidia.com/mig-3g.20gb.engines.decoder": "2",
        "nvidia.com/mig-3g.20gb.engines.encoder": "0",
        "nvidia.com/mig-3g.20gb.engines.jpeg": "0",
        "nvidia.com/mig-3g.20gb.engines.ofa": "0",
    } == labels_for(MIXED_NODE, DEMO, ConfigState.SUCCESS)


def test_a_node_with_mig_on_every_gpu_still_names_and_counts_its_gpus() -> None:
    """GFD labels the physical GPUs (unshared: replicas 0) even when only MIG devices are advertised."""
    node = NodeState(tuple(a100(i, ("7g.40gb", 0, 8)) for i in range(2)))
    config = SharingConfig("x", MigStrategy.MIXED, rules=(Rule(Selector(all=True), MigMode.ENABLED),))
    labels = labels_for(node, config)
    assert {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.memory": "40960",
    } == {k: v for k, v in labels.items() if k.startswith("nvidia.com/gpu.") and k != "nvidia.com/gpu.present"
          and k not in ("nvidia.com/gpu.mode", "nvidia.com/gpu.machine")}  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [(MigStrategy.MIXED, "mixed"), (MigStrategy.SINGLE, "single"), (MigStrategy.NONE, None)],
    ids=["mixed", "single", "none"],
)
def test_the_strategy_is_labelled_even_without_mig_gpus(strategy: MigStrategy, expected: str | None) -> None:
    labels = labels_for(NodeState((h100(0),)), SharingConfig("x", strategy))
    assert expected == labels.get("nvidia.com/mig.strategy")


def test_media_extension_profiles_are_written_with_a_dot_like_gfd() -> None:
    node = NodeState((a100(0, ("1g.5gb+me", 0, 1)),))
    labels = labels_for(node, None)
    assert "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb.me" == labels["nvidia.com/mig-1g.5gb.me.product"]
    assert "1" == labels["nvidia.com/mig-1g.5gb.me.engines.ofa"]
    assert owned("nvidia.com/mig-1g.5gb.me.engines.ofa")


def test_versions_architecture_machine_and_mode_come_from_the_driver() -> None:
    gpu = dataclasses.replace(h100(0), compute_capability=(9, 0), pci_class=0x030200)
    node = NodeState((gpu,), driver=DriverInfo("550.107.02", 12050), machine="DGX H100 (rev 2)", virtual=True)
    labels = labels_for(node, None)
    assert {
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "107",
        "nvidia.com/cuda.driver.rev": "02",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "107",
        "nvidia.com/cuda.driver-version.revision": "02",
        "nvidia.com/cuda.driver-version.full": "550.107.02",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "5",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "5",
        "nvidia.com/cuda.runtime-version.full": "12.5",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.machine": "DGX-H100-rev-2",
        "nvidia.com/gpu.mode": "compute",
        "nvidia.com/vgpu.present": "true",
    }.items() <= labels.items()
    assert all(owned(k) for k in labels)


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((7, 0), "volta"), ((7, 5), "turing"), ((8, 0), "ampere"), ((8, 6), "ampere"), ((8, 9), "ada-lovelace"),
     ((9, 0), "hopper"), ((10, 0), "blackwell"), ((12, 0), "blackwell"), ((13, 0), "rubin"),
     ((4, 0), "undefined")],
    ids=str,
)  # fmt: skip
def test_architecture_family_as_gfd_names_it(capability: tuple[int, int], expected: str) -> None:
    assert expected == family(*capability)


def test_single_strategy_that_cannot_be_advertised_says_invalid_like_gfd() -> None:
    node = NodeState((a100(0, ("1g.5gb", 0, 1), ("2g.10gb", 2, 2)),))
    config = SharingConfig("s", MigStrategy.SINGLE, rules=(Rule(Selector(all=True), MigMode.UNCHANGED),))
    labels = labels_for(node, config)
    assert ("NVIDIA-A100-SXM4-40GB-MIG-INVALID", "0", "0", "0") == tuple(
        labels[f"nvidia.com/gpu.{k}"] for k in ("product", "count", "replicas", "memory")
    )


def test_a_gpu_the_catalog_does_not_know_is_labelled_from_its_driver() -> None:
    table = Product("NVIDIA Z100", ("NVIDIA Z100",), (), 65536, 4, 4, (
        Profile("1g.16gb", 0, 1, 1, 1, 4, 16000, (0, 1, 2, 3), 30, Engines(1, 2, 3, 4, 0)),
    ), origin="driver")  # fmt: skip
    gi = GpuInstance(1, "1g.16gb", 2, 1, (ComputeInstance(0, MigUuid("MIG-z")),))
    gpu = Gpu(0, GpuUuid("GPU-z"), "NVIDIA Z100", 65536, True, True, True, (gi,), profiles=table)
    labels = labels_for(NodeState((gpu,)), None)
    assert {
        "nvidia.com/mig-1g.16gb.product": "NVIDIA-Z100-MIG-1g.16gb",
        "nvidia.com/mig-1g.16gb.memory": "16000",
        "nvidia.com/mig-1g.16gb.multiprocessors": "30",
        "nvidia.com/mig-1g.16gb.engines.jpeg": "4",
    }.items() <= labels.items()


def test_renamed_shared_resources_keep_gpu_labels_without_suffix() -> None:
    config = SharingConfig(
        "shared", rename_by_default=True, rules=(Rule(Selector(all=True), replicas=Replicas(8)),)
    )
    labels = labels_for(NodeState((h100(0),)), config)
    assert "NVIDIA-H100-80GB-HBM3" == labels["nvidia.com/gpu.product"]
    assert "8" == labels["nvidia.com/gpu.replicas"]
    assert "1" == labels["nvidia.com/gpu.count"]
    assert "time-slicing" == labels["nvidia.com/gpu.sharing-strategy"]


MPS_LABELS = ("mps.capable", "gpu.product", "gpu.replicas", "gpu.sharing-strategy", "gpu.count")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param(
            "version: v1\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 10}]}}",
            ("true", "NVIDIA-H100-80GB-HBM3-SHARED", "10", "mps", "2"),
            id="nvidia-readme-mps",
        ),
        pytest.param(
            "version: v1\nsharing: {mps: {renameByDefault: true, resources: [{name: gpu, replicas: 10}]}}",
            ("true", "NVIDIA-H100-80GB-HBM3", "10", "mps", "2"),
            id="renamed-no-suffix",
        ),
        pytest.param(
            "version: v1\ngpus: [{devices: all, mps: {replicas: 4}}]",
            ("true", "NVIDIA-H100-80GB-HBM3-SHARED", "4", "mps", "2"),
            id="native-mps",
        ),
        pytest.param(
            "version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 10}]}}",
            ("false", "NVIDIA-H100-80GB-HBM3-SHARED", "10", "time-slicing", "2"),
            id="time-slicing",
        ),
        pytest.param(
            "version: v1\ngpus: [{devices: all, mig: unchanged}]",
            ("false", "NVIDIA-H100-80GB-HBM3", "1", "none", "2"),
            id="unshared",
        ),
    ],
)
def test_mps_labels_as_gfd_writes_them(config: str, expected: tuple[str, ...]) -> None:
    """GFD under MPS (k8s-device-plugin internal/lm/nvml.go, resource.go): mps.capable, strategy mps."""
    (parsed,) = parse_config("c", config)
    labels = labels_for(NodeState((h100(0), h100(1))), parsed)
    assert expected == tuple(labels[f"nvidia.com/{k}"] for k in MPS_LABELS)


def test_a_gpu_left_with_mig_on_is_not_labelled_as_shared_with_mps() -> None:
    """`mig: unchanged` MPS on a GPU with MIG on is refused at parse time; labels do not claim MPS."""
    config = SharingConfig(
        "c", rules=(Rule(Selector(all=True), MigMode.UNCHANGED, replicas=Replicas(1, (("gpu", 4),)),
                         sharing=Sharing.MPS),),
    )  # fmt: skip
    labels = labels_for(NodeState((a100(0, ("7g.40gb", 0, 8)),)), config)
    assert ("false", "none") == (labels["nvidia.com/mps.capable"], labels["nvidia.com/gpu.sharing-strategy"])


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
    assert "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb.me" == sanitise("NVIDIA A100-SXM4-40GB", "MIG", "1g.5gb.me")
    assert "Tesla-T4" == sanitise("Tesla  T4")


def _catalog_names() -> list[tuple[str, Product | None]]:
    """Every NVML name the catalog knows (its key where none was found), with its MIG product."""
    mig = [(n, p) for p in CATALOG.products for n in p.nvml_names or ("NVIDIA " + p.name,)]
    return mig + [(n, None) for p in CATALOG.plain for n in p.nvml_names or ("NVIDIA " + p.name,)]


def _mig_gpu(name: str, product: Product, profile: Profile) -> Gpu:
    ci = ComputeInstance(0, MigUuid("MIG-x"))
    gi = GpuInstance(1, profile.name, profile.placements[0], profile.size, (ci,))
    return Gpu(0, GpuUuid("GPU-x"), name, product.memory_mib, True, True, True, (gi,))


@pytest.mark.parametrize(
    ("name", "product", "profile"),
    [pytest.param(n, p, f, id=f"{n}:{f.name}") for n, p in _catalog_names() if p for f in p.profiles],
)
def test_every_catalog_mig_profile_gives_valid_labels_under_every_suffix(
    name: str, product: Product, profile: Profile
) -> None:
    """GFD's rule (k8s-device-plugin#1880): the model is cut, `-MIG-<profile>` and `-SHARED` stay whole."""
    node = NodeState((_mig_gpu(name, product, profile),))
    suffix = "-MIG-" + profile.name.replace("+", ".")
    for strategy in (MigStrategy.MIXED, MigStrategy.SINGLE):
        for replicas, shared in ((1, ""), (2, "-SHARED")):
            rule = Rule(Selector(all=True), MigMode.ENABLED, ((profile.name, 1),), Replicas(replicas))
            labels = labels_for(node, SharingConfig("x", strategy, rules=(rule,)), ConfigState.SUCCESS)
            assert [] == metadata_problems(labels, {})
            key = "gpu" if strategy is MigStrategy.SINGLE else "mig-" + profile.name.replace("+", ".")
            value = labels[f"nvidia.com/{key}.product"]
            assert value.endswith(suffix + shared)
            assert sanitise(name).startswith(value.removesuffix(suffix + shared))


@pytest.mark.parametrize(("name", "product"), [pytest.param(n, p, id=n) for n, p in _catalog_names()])
def test_every_catalog_gpu_gives_valid_labels_shared_and_invalid(name: str, product: Product | None) -> None:
    gpu = Gpu(0, GpuUuid("GPU-x"), name, 16384, product is not None, False, False)
    shared = SharingConfig("x", rules=(Rule(Selector(all=True), replicas=Replicas(4)),))
    labels = labels_for(NodeState((gpu,)), shared)
    assert [] == metadata_problems(labels, {})
    assert labels["nvidia.com/gpu.product"].endswith("-SHARED")
    if product is not None:  # MIG on without instances under `single`: GFD's -MIG-INVALID
        node = NodeState((dataclasses.replace(gpu, mig_enabled=True, mig_pending=True),))
        labels = labels_for(node, SharingConfig("s", MigStrategy.SINGLE), ConfigState.SUCCESS)
        assert [] == metadata_problems(labels, {})
        assert labels["nvidia.com/gpu.product"].endswith("-MIG-INVALID")


async def test_a_label_the_api_server_would_refuse_is_left_out_and_the_rest_written() -> None:
    """One bad value must not fail the whole patch (and with it the state label)."""
    kube = FakeKube("n1", {})
    kube.label(**{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
    node = Watched("node", lambda: kube.get_node("n1"), lambda rv: kube.watch_node("n1", rv, 1), lambda n: n)
    node.current = kube.node
    publisher = NodePublisher(kube, node, CATALOG)
    observed = NodeState((dataclasses.replace(h100(0), product="NVIDIA H100 -"),))  # sanitised: ends in '-'
    inventory = build_inventory(observed, None)
    with structlog.testing.capture_logs() as logs:
        await publisher.publish(
            observed, None, inventory, Verdict(ConfigState.SUCCESS), good=None, in_effect={}
        )
    assert "success" == kube.node.labels["nvidia.com/mig.config.state"]
    assert "1" == kube.node.labels["nvidia.com/gpu.count"]
    assert "nvidia.com/gpu.product" not in kube.node.labels  # the old value is not left standing either
    left_out = [e["labels"] for e in logs if e["event"] == "labels_left_out"]
    assert [{"nvidia.com/gpu.product": "NVIDIA-H100--"}] == left_out


def test_gfd_shortening_keeps_short_values_and_cuts_only_the_model() -> None:
    model = "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition"
    assert "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb" == product_value("NVIDIA A100-SXM4-40GB", "MIG", "1g.5gb")
    # The figures of GFD's own test (internal/lm/resource_test.go in k8s-device-plugin#1880).
    cut = "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstation"
    assert cut + "-Edi-MIG-1g.24gb" == product_value(model, "MIG", "1g.24gb")
    assert cut + "-MIG-1g.24gb.me" == product_value(model, "MIG", "1g.24gb.me")
    assert "NVIDIA-RTX-PRO-6000-Blackwell-Max-Q-Workstat-MIG-1g.24gb-SHARED" == product_value(
        model, "MIG", "1g.24gb", shared=True
    )
    assert "A" * 51 + "-MIG-1g.5gb" == product_value("A" * 51 + "." + "B" * 10, "MIG", "1g.5gb")
    assert "A" * 63 == product_value("A" * 80)
