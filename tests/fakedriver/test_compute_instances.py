"""Compute instances smaller than their GPU instance, made at NVIDIA's ABI (nvmlGpuInstanceCreateCompute
Instance with a one-slice compute-instance profile, as `nvidia-smi mig -cci` does) by someone other than
the agent, over the real pynvml and the fake driver: each is a MIG device of its own profile
(`1c.3g.20gb`) to the kubelet, the labels and the DRA pool, and a pod that asks for a `3g.20gb` gets a
whole one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sharing.config.spec import MigMode, MigStrategy, Rule, Selector, SharingConfig
from sharing.deviceplugin import Fleet
from sharing.devices import build_inventory
from sharing.dra.slices import build_slices
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.gpu.nvmlapi import Nvml
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.labels import ConfigState, node_labels
from sharing.mig.catalog import default_catalog
from sharing.model import NodeState
from sharing.rollout import Retry, Rollout
from sharing.store.journal import Journal
from tests.fakedriver.conftest import make_gpu_instance, sim
from tests.fakedriver.test_backend import make_compute_instances
from tests.unit.fakekubelet import FakeKubelet

CATALOG = default_catalog()
P3G = 9
"""The 3g.20gb GPU-instance profile id on an A100-SXM4-40GB (NVIDIA MIG user guide, supported profiles)."""


@pytest.fixture
async def backend(state: Path, nvml: Nvml) -> AsyncIterator[NvmlBackend]:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")])
    b = NvmlBackend(nvml, CATALOG, event_poll_s=0.01)
    assert await b.set_mig_mode((await b.observe()).gpus[0].uuid, True) is False
    yield b
    await b.close()


@pytest.fixture
async def fake_kubelet(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    k = await FakeKubelet(plugin_dir).start()
    yield k
    await k.stop()


async def split_and_whole(backend: NvmlBackend, nvml: Nvml) -> NodeState:
    """A 3g.20gb at slot 4 split into three one-slice compute instances by another NVML user, and a
    whole 3g.20gb at slot 0 the agent's backend made."""
    gpu = (await backend.observe()).gpus[0].uuid
    make_gpu_instance(nvml, 0, P3G, 4, 4)
    (split,) = (await backend.observe()).gpus[0].instances
    make_compute_instances(nvml, 0, split.id, 3)
    await backend.create_instance(gpu, "3g.20gb", 0)
    return await backend.observe()


async def test_each_compute_instance_is_a_device_of_its_own_profile(backend: NvmlBackend, nvml: Nvml) -> None:
    node = await split_and_whole(backend, nvml)
    whole, split = node.gpus[0].instances
    assert [(1, 14)] * 3 == [(ci.slices, ci.multiprocessors) for ci in split.compute_instances]
    inventory = build_inventory(node, None)
    assert {
        "nvidia.com/mig-1c.3g.20gb": {ci.uuid for ci in split.compute_instances},
        "nvidia.com/mig-3g.20gb": {whole.compute_instances[0].uuid},
    } == {name: {d.id for d in devices} for name, devices in inventory.resources}

    labels = node_labels(node, None, inventory, None)
    assert ("3", "14", "3", "1") == tuple(
        labels[f"nvidia.com/mig-1c.3g.20gb.{k}"]
        for k in ("count", "multiprocessors", "slices.gi", "slices.ci")
    )
    assert ("1", "42") == (
        labels["nvidia.com/mig-3g.20gb.count"],
        labels["nvidia.com/mig-3g.20gb.multiprocessors"],
    )

    published = sorted(
        dict(d.attributes)["profile"]
        for s in build_slices("node-a", node, inventory, CATALOG)
        for d in s.devices
    )
    assert ["1c.3g.20gb"] * 3 + ["3g.20gb"] == published


UNCHANGED = SharingConfig(
    name="as-is", mig_strategy=MigStrategy.MIXED, rules=(Rule(Selector(all=True), MigMode.UNCHANGED),)
)
TWO_3G = SharingConfig(
    name="two-3g",
    mig_strategy=MigStrategy.MIXED,
    rules=(Rule(Selector(all=True), MigMode.ENABLED, (("3g.20gb", 2),)),),
)


async def nothing() -> None:
    pass


async def test_a_pod_asking_for_a_3g_20gb_gets_the_whole_one_and_the_kubelet_sees_the_parts_apart(
    backend: NvmlBackend, nvml: Nvml, fleet: Fleet, fake_kubelet: FakeKubelet, tmp_path: Path
) -> None:
    node = await split_and_whole(backend, nvml)
    whole, split = node.gpus[0].instances
    rollout = Rollout(backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j"),
                      pod_resources=None)  # fmt: skip
    verdict, after = await rollout.roll_out(UNCHANGED, node, nothing)
    assert ConfigState.SUCCESS is verdict.state
    await rollout.advertise(after, UNCHANGED)
    parts = {ci.uuid: "Healthy" for ci in split.compute_instances}
    mig = whole.compute_instances[0].uuid
    wanted = {"nvidia.com/mig-1c.3g.20gb": parts, "nvidia.com/mig-3g.20gb": {mig: "Healthy"}}
    await fake_kubelet.wait(lambda: {r: fake_kubelet.devices(r) for r in wanted} == wanted)
    got = await fake_kubelet.plugin("nvidia.com/mig-3g.20gb").Allocate(
        api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=[mig])])
    )
    assert mig == dict(got.container_responses[0].envs)["NVIDIA_VISIBLE_DEVICES"]


async def test_a_layout_of_two_3g_20gb_makes_the_idle_split_one_whole_again(
    backend: NvmlBackend, nvml: Nvml, fleet: Fleet, tmp_path: Path
) -> None:
    node = await split_and_whole(backend, nvml)
    rollout = Rollout(backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j"),
                      pod_resources=None)  # fmt: skip
    verdict, after = await rollout.roll_out(TWO_3G, node, nothing)
    assert ConfigState.SUCCESS is verdict.state
    assert [("3g.20gb", 0, [3]), ("3g.20gb", 4, [3])] == [
        (gi.profile, gi.start, [ci.slices for ci in gi.compute_instances]) for gi in after.gpus[0].instances
    ]


async def test_a_busy_split_instance_blocks_the_layout_and_stays(
    backend: NvmlBackend, nvml: Nvml, fleet: Fleet, tmp_path: Path, state: Path
) -> None:
    node = await split_and_whole(backend, nvml)
    _, split = node.gpus[0].instances
    sim(state, "busy", "--uuid", split.compute_instances[1].uuid)
    rollout = Rollout(backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j"),
                      pod_resources=None)  # fmt: skip
    verdict, after = await rollout.roll_out(TWO_3G, await backend.observe(), nothing)
    assert (ConfigState.FAILED, Retry.BLOCKED) == (verdict.state, verdict.retry)  # applied once it is free
    assert "split into compute instances smaller than it, so it is no 3g.20gb device" in verdict.message
    assert [3] == [len(gi.compute_instances) for gi in after.gpus[0].instances if gi.start == 4]
