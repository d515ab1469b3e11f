"""The agent's usage sampler on the fake driver: it samples on its own thread, and makes no NVML call
when `usage.enabled` is false."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sharing.agent import Agent
from sharing.deviceplugin import Fleet, FleetSettings
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.mig.catalog import default_catalog
from sharing.settings import Settings
from tests.fakedriver.test_agent import GPU, NS, replicas
from tests.polling import poll
from tests.unit.conftest import plugin_dir  # noqa: F401  (the fixture)
from tests.unit.fakekube import FakeKube
from tests.unit.fakekubelet import FakeKubelet

CATALOG = default_catalog()
SAMPLER_ONLY = {
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetProcessUtilization", "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc", "nvmlGpmMigSampleGet", "nvmlGpmMetricsGet", "nvmlGpmSampleFree",
}  # fmt: skip


class Watched:
    """The real pynvml, each call recorded with the name of the thread that made it (then made)."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._nvml, name)
        if not name.startswith("nvml") or not callable(found):
            return found

        @functools.wraps(found)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((threading.current_thread().name, name))
            return found(*args, **kwargs)

        return call


@dataclass
class Running:
    agent: Agent
    nvml: Watched
    kubelet: FakeKubelet


async def start(
    tmp_path: Path, plugins: Path, state: Path, nvml: Any, *, usage: bool
) -> AsyncIterator[Running]:
    uuid = simstate.init_state(state, [simstate.resolve_product(CATALOG, "L4")])["gpus"][0]["uuid"]
    simstate.set_sensors(state, uuid, power_watts=72.0, temperature_c=51)
    kubelet = await FakeKubelet(plugins).start()
    kube = FakeKube(
        "n1", {(NS, "gpu-sharing-config"): {"mine": replicas(2)}, (NS, "gpu-sharing-presets"): {}}
    )
    watched = Watched(nvml)
    settings = Settings(
        node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugins, journal=tmp_path / "j",
        usage_enabled=usage, host_proc=tmp_path / "proc",
    )  # fmt: skip
    fleet = Fleet(FleetSettings(plugin_dir=plugins, poll_interval_s=0.02))
    agent = Agent(settings, kube=kube, backend=NvmlBackend(watched, CATALOG), fleet=fleet, catalog=CATALOG)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    kube.label(**{"nvidia.com/device-plugin.config": "mine"})
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2}, timeout=10)
    try:
        yield Running(agent, watched, kubelet)
    finally:
        stop.set()
        await task
        kube.close()
        await kubelet.stop()


@pytest.fixture
async def sampling(tmp_path: Path, plugin_dir: Path, state: Path, nvml: Any) -> AsyncIterator[Running]:  # noqa: F811
    async for running in start(tmp_path, plugin_dir, state, nvml, usage=True):
        yield running


@pytest.fixture
async def not_sampling(tmp_path: Path, plugin_dir: Path, state: Path, nvml: Any) -> AsyncIterator[Running]:  # noqa: F811
    async for running in start(tmp_path, plugin_dir, state, nvml, usage=False):
        yield running


async def test_the_sampler_reads_on_its_own_thread_and_the_status_shows_it(sampling: Running) -> None:
    assert sampling.agent.usage is not None
    usage = sampling.agent.usage
    await asyncio.to_thread(poll, "a usage sample", lambda: usage.report, lambda r: r is not None, 10)
    status = await sampling.agent.report.status()
    gpu = status["gpus"][0]["usage"]
    assert (72.0, 51.0, 0.0) == (gpu["powerWatts"], gpu["temperatureCelsius"], gpu["utilization"])
    assert status["usage"]["enabled"]
    sampler = {name for thread, name in sampling.nvml.calls if thread == "usage"}
    assert {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetComputeRunningProcesses"} <= sampler
    # Off the reconcile path: the backend's worker never makes the sampler's calls.
    assert not {name for thread, name in sampling.nvml.calls if thread != "usage"} & SAMPLER_ONLY


async def test_with_usage_off_there_is_no_sampler_and_no_nvml_call_of_it(not_sampling: Running) -> None:
    agent = not_sampling.agent
    assert agent.usage is None
    status = await agent.report.status()  # the agent has reconciled and serves
    assert {"enabled": False, "sampledAt": None} == status["usage"]
    assert [None] == [g["usage"] for g in status["gpus"]]
    assert [] == [t.name for t in threading.enumerate() if t.name == "usage"]
    assert [] == [
        (thread, name)
        for thread, name in not_sampling.nvml.calls
        if thread == "usage" or name in SAMPLER_ONLY
    ]
