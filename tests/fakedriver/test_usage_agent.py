"""The agent's usage sampler on the fake driver: it samples on its own thread, makes no NVML call
when `usage.enabled` is false, and says an idle slice once in a SliceIdle Event."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lab.deadlines import scaled

from sharing.agent import Agent
from sharing.deviceplugin import Fleet, FleetSettings
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.mig.catalog import default_catalog
from sharing.model import Holding, Listing
from sharing.settings import Settings
from tests.fakedriver.test_agent import GPU, NS, replicas
from tests.fakedriver.test_frontend import until
from tests.fakedriver.test_rollout import Kubelet
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


async def test_an_idle_held_slice_gets_one_slice_idle_event_also_across_a_restart(
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    state: Path,
    nvml: Any,
) -> None:
    """A pod holds a replica and runs nothing on it: after usage.idleAfter the Node gets one SliceIdle
    Event naming the pod and the slice; a restarted agent, reading its windows back, does not say it
    again."""
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "L4")])
    kubelet = await FakeKubelet(plugin_dir).start()
    kube = FakeKube(
        "n1", {(NS, "gpu-sharing-config"): {"mine": replicas(2)}, (NS, "gpu-sharing-presets"): {}}
    )
    pod_resources = Kubelet({})
    settings = Settings(
        node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir, journal=tmp_path / "j",
        host_proc=tmp_path / "proc", usage_interval_seconds=1.0, usage_idle_after=1.0, usage_idle_events=True,
    )  # fmt: skip

    async def run_agent(until_done: Callable[[Agent], Awaitable[None]]) -> None:
        fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
        agent = Agent(
            settings, kube=kube, backend=NvmlBackend(nvml, CATALOG), fleet=fleet, catalog=CATALOG,
            pod_resources=pod_resources,
        )  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            await until_done(agent)
        finally:
            stop.set()
            await task

    def idle_events() -> list[str]:
        return [m for _, reason, m in kube.events if reason == "SliceIdle"]

    async def first(agent: Agent) -> None:
        kube.label(**{"nvidia.com/device-plugin.config": "mine"})
        await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2}, timeout=scaled(10))
        replica = min(kubelet.devices(GPU))
        pod_resources.listing_ = Listing(
            frozenset({"ml/sleeper"}), (Holding("ml", "sleeper", "main", GPU, frozenset({replica})),)
        )
        await until("the SliceIdle Event", lambda: bool(idle_events()), scaled(20))

    async def again(agent: Agent) -> None:
        usage = agent.usage
        assert usage is not None

        def idle_seen_twice() -> bool:  # two samples that found the slice idle: each one would have said it
            report = usage.report
            return report is not None and any(s.idle for s in report.slices) and usage.samples >= 2

        await until("the restarted agent's samples of the idle slice", idle_seen_twice, scaled(20))

    try:
        await run_agent(first)
        replica = min(kubelet.devices(GPU))
        assert [f"pod ml/sleeper (container main) has run no GPU process on its slice {replica} ({GPU})"] == [
            m.partition(" for ")[0] for m in idle_events()
        ]
        await run_agent(again)
        assert 1 == len(idle_events())
    finally:
        kube.close()
        await kubelet.stop()
