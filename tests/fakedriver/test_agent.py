"""The agent's loop against an in-memory API and the Python fake kubelet: what must never stop it.

Fast checks of the loop itself; the e2e tests run the same agent against a real kube-apiserver and
the kubelet's own device manager.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sharing.agent import Agent
from sharing.cluster import sources as sources_module
from sharing.deviceplugin import Fleet, FleetSettings
from sharing.errors import BackendError
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.mig.catalog import default_catalog
from sharing.model import HealthEvent
from sharing.settings import Settings
from tests.unit.conftest import plugin_dir  # noqa: F401  (the fixture)
from tests.unit.fakekube import FakeKube
from tests.unit.fakekubelet import FakeKubelet

CATALOG = default_catalog()
NS = "gpu-sharing"
GPU = "nvidia.com/gpu"


def replicas(n: int) -> str:
    return f"version: v1\ngpus:\n  - devices: all\n    replicas: {n}\n"


class FlakyHealthBackend(NvmlBackend):
    """The fake driver's GPUs, whose first health watch dies of a raw driver error (not a BackendError)."""

    failures = 0
    watching: asyncio.Event

    async def health_events(self) -> AsyncIterator[HealthEvent]:
        if not self.failures:
            self.failures += 1
            raise RuntimeError("NVML_ERROR_UNKNOWN from nvmlEventSetWait")
        # No task switch between this and the registration reaching the (one, in-order) NVML worker.
        self.watching.set()
        async for event in super().health_events():
            yield event


@dataclass
class Running:
    agent: Agent
    kube: FakeKube
    kubelet: FakeKubelet
    backend: FlakyHealthBackend
    state: Path
    plugin_dir: Path
    stop: asyncio.Event
    task: asyncio.Task[None]


@pytest.fixture
async def running(tmp_path: Path, plugin_dir: Path, state: Path, nvml: Any) -> AsyncIterator[Running]:  # noqa: F811
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "T4")])
    kubelet = await FakeKubelet(plugin_dir).start()
    kube = FakeKube(
        "n1", {(NS, "gpu-sharing-config"): {"mine": replicas(2)}, (NS, "gpu-sharing-presets"): {}}
    )
    backend = FlakyHealthBackend(nvml, CATALOG, event_poll_s=0.05)
    backend.watching = asyncio.Event()
    settings = Settings(
        node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir, journal=tmp_path / "j"
    )
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    agent = Agent(settings, kube=kube, backend=backend, fleet=fleet, catalog=CATALOG)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    kube.label(**{"nvidia.com/device-plugin.config": "mine"})
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2}, timeout=10)
    yield Running(agent, kube, kubelet, backend, state, plugin_dir, stop, task)
    stop.set()
    await task
    kube.close()
    await kubelet.stop()


async def test_a_dead_health_watch_is_said_and_restarted_and_shutdown_still_cleans_up(
    running: Running,
) -> None:
    gpu = simstate.read(running.state)["gpus"][0]["uuid"]
    await running.backend.watching.wait()  # NVML records events only after their registration:
    await running.backend.observe()  # this call runs after the watch's registration
    simstate.inject_xid(running.state, gpu, 79)  # fell off the bus: critical
    await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 0}, timeout=10)
    assert ("Warning", "GpuUnhealthy") in [(k, r) for k, r, _ in running.kube.events]
    running.stop.set()
    await running.task
    # The plugin servers stopped (their sockets are gone) and NVML was released.
    assert [p.name for p in running.plugin_dir.iterdir() if p.name != "kubelet.sock"] == []
    with pytest.raises(BackendError, match="closed"):
        await running.backend.observe()


async def test_parsing_a_configmap_never_blocks_the_grpc_servers(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    real: Callable[..., Any] = sources_module.parse_configmap
    started, release = threading.Event(), threading.Event()
    released_by_test: list[bool] = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        if started.is_set():
            return real(*args, **kwargs)
        started.set()
        released_by_test.append(release.wait(20))  # a 672 KiB ConfigMap took 2.8 s to parse
        return real(*args, **kwargs)

    monkeypatch.setattr(sources_module, "parse_configmap", slow)
    running.kube.set_configmap(NS, "gpu-sharing-config", {"mine": replicas(3)})
    await asyncio.to_thread(started.wait, 10)
    request = api.AllocateRequest(
        container_requests=[
            api.ContainerAllocateRequest(devices_ids=[sorted(running.kubelet.devices(GPU))[0]])
        ]
    )
    reply = await asyncio.wait_for(running.kubelet.plugin(GPU).Allocate(request), 5)
    assert reply.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    release.set()
    await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 3}, timeout=10)
    assert [True] == released_by_test
