"""A node with MIG GPUs and GPUs without MIG under `mig: dynamic`, on the fake driver under the real pynvml.

The whole agent (in-memory API, the DRA front-end recording what it is told): the rule applies to the
A100, whose MIG devices are made per claim, and the L4 beside it is offered whole; nothing fails. NVIDIA's
DRA driver publishes nothing on such a node (https://github.com/kubernetes-sigs/dra-driver-nvidia-gpu/issues/1092).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from lab.deadlines import scaled

from sharing.agent import Agent
from sharing.deviceplugin import Fleet, FleetSettings
from sharing.dra.partitions import partitionable_slices
from sharing.dra.slices import build_slices
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.kube.api import Version
from sharing.kube.features import PARTITIONABLE, ClusterFeatures
from sharing.labels import STATE_LABEL
from sharing.mig.catalog import default_catalog
from sharing.settings import Settings
from tests.fakedriver.test_frontend import FRONTEND, Slices
from tests.polling import until
from tests.unit.conftest import plugin_dir  # noqa: F401  (the fixture)
from tests.unit.fakekube import FakeKube
from tests.unit.fakekubelet import FakeKubelet

CATALOG = default_catalog()
NS = "gpu-sharing"
V1 = "version: v1\nmigStrategy: mixed\ngpus:\n"
CONFIGS = {
    "all": V1 + "  - devices: all\n    mig: dynamic\n",
    "product": V1 + "  - devices: {product: A100-SXM4-40GB}\n    mig: dynamic\n",
}


@pytest.mark.parametrize("config", CONFIGS)
async def test_dynamic_mig_applies_to_the_mig_gpu_and_the_l4_beside_it_is_published_whole(
    config: str,
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    state: Path,
    nvml: Any,
) -> None:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, p) for p in ("A100-SXM4-40GB", "L4")])
    a100, l4 = (g["uuid"] for g in simstate.read(state)["gpus"])
    kubelet = await FakeKubelet(plugin_dir).start()
    kube = FakeKube(
        "n1", {(NS, "gpu-sharing-config"): {config: CONFIGS[config]}, (NS, "gpu-sharing-presets"): {}}
    )
    kube.label(**{"nvidia.com/device-plugin.config": config, FRONTEND: "dra"})
    settings = Settings(node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir,
                        journal=tmp_path / "j")  # fmt: skip
    slices = Slices()
    backend = NvmlBackend(nvml, CATALOG)
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    agent = Agent(settings, kube=kube, backend=backend, fleet=fleet, catalog=CATALOG, dra=slices)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await until("state success", lambda: kube.node.labels.get(STATE_LABEL) == "success")
        await until("the A100 dynamic in the slices", lambda: any(i.dynamic for i in slices.published))
        inventory = slices.published[-1]
        assert ({a100}, [("nvidia.com/gpu", [l4])]) == (
            inventory.dynamic,
            [(name, [d.uuid for d in devices]) for name, devices in inventory.resources],
        )
        assert [] == [(r, m) for _, r, m in kube.events if r in ("ConfigInvalid", "ConfigApplyFailed")]
        gpus = simstate.read(state)["gpus"]
        assert [(1, []), (0, [])] == [(g["migCurrent"], g["gpuInstances"]) for g in gpus]

        # What the pool holds, from the GPUs as the real pynvml reads them: the L4 whole, the A100 on demand.
        node = await backend.observe()
        (whole,) = [d for s in build_slices("n1", node, inventory, CATALOG) for d in s.devices]
        assert "gpu-1" == whole.name
        assert {
            "type": "gpu",
            "uuid": l4,
            "productName": "NVIDIA L4",
            "architecture": "Ada Lovelace",
            "cudaComputeCapability": Version("8.9.0"),
        }.items() <= dict(whole.attributes).items()
        ondemand = [
            d.name for s in partitionable_slices("n1", node, inventory.dynamic, CATALOG) for d in s.devices
        ]
        assert "gpu-0-mig-1g-5gb-at-6" in ondemand
        assert not [n for n in ondemand if n.startswith("gpu-1-")]
    finally:
        stop.set()
        await task
        await backend.close()
        kube.close()
        await kubelet.stop()


async def test_dynamic_mig_on_a_cluster_without_partitionable_devices_is_refused_by_name(
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    state: Path,
    nvml: Any,
) -> None:
    """An API server with DRAPartitionableDevices off (Kubernetes 1.34's default) would drop the
    counters that keep overlapping placements apart: the config is refused, the GPUs stay as they
    are, and a config that needs no such feature is applied as ever."""
    simstate.init_state(state, [simstate.resolve_product(CATALOG, p) for p in ("A100-SXM4-40GB", "L4")])
    configs = {"all": CONFIGS["all"], "whole": V1 + "  - devices: all\n    mig: disabled\n"}
    kubelet = await FakeKubelet(plugin_dir).start()
    kube = FakeKube("n1", {(NS, "gpu-sharing-config"): configs, (NS, "gpu-sharing-presets"): {}})
    kube.label(**{"nvidia.com/device-plugin.config": "all", FRONTEND: "dra"})
    settings = Settings(node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir,
                        journal=tmp_path / "j")  # fmt: skip
    slices = Slices(cluster=ClusterFeatures(frozenset({PARTITIONABLE}), known=True))
    backend = NvmlBackend(nvml, CATALOG)
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    agent = Agent(settings, kube=kube, backend=backend, fleet=fleet, catalog=CATALOG, dra=slices)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        # The switch to DRA comes first (retried with a growing delay while the fake kubelet starts).
        await until("state failed", lambda: kube.node.labels.get(STATE_LABEL) == "failed", scaled(30))

        def refusals() -> list[str]:
            return [m for _, r, m in kube.events if r == "ConfigInvalid"]

        # The Event is sent by the agent's Event writer after the Node's labels: it may come a moment later.
        await until("the ConfigInvalid Event", lambda: bool(refusals()), scaled(30))
        (refusal,) = refusals()
        assert "config 'all' asks for mig: dynamic (GPU 0)" in refusal
        assert "feature gate DRAPartitionableDevices off" in refusal
        assert [0, 0] == [g["migCurrent"] for g in simstate.read(state)["gpus"]]  # nothing changed
        assert not any(i.dynamic for i in slices.published)

        kube.label(**{"nvidia.com/device-plugin.config": "whole"})
        await until("state success", lambda: kube.node.labels.get(STATE_LABEL) == "success", scaled(30))
        await until("both GPUs offered whole", lambda: slices.devices() == 2)
        assert len(refusals()) == 1  # said once
    finally:
        stop.set()
        await task
        await backend.close()
        kube.close()
        await kubelet.stop()
