"""The agent's loop against an in-memory API and the Python fake kubelet: what must never stop it.

Fast checks of the loop itself; the e2e tests run the same agent against a real kube-apiserver and
the kubelet's own device manager.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lab.deadlines import scaled

from sharing import agent as agent_module
from sharing.agent import Agent
from sharing.cli import main
from sharing.deviceplugin import Fleet, FleetSettings
from sharing.errors import BackendError, KubeError
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.kube import sources as sources_module
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.labels import STATE_LABEL
from sharing.mig.catalog import default_catalog
from sharing.model import BoundPod, HealthEvent, Holding, Listing
from sharing.settings import Settings
from tests.fakedriver.test_rollout import Kubelet
from tests.hardware import mig_devices
from tests.polling import poll, until
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


class Unreachable(FakeKube):
    """An API server out of reach: every read fails."""

    def get_node(self, name: str) -> Any:
        raise KubeError("connection refused")

    def get_configmap(self, namespace: str, name: str) -> Any:
        raise KubeError("connection refused")


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
    backend_nvml: Any


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
    yield Running(agent, kube, kubelet, backend, state, plugin_dir, stop, task, nvml)
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
    # The Event is written after the plugins carry the news, so it may come a moment later.
    await asyncio.to_thread(
        poll,
        "the GpuUnhealthy Event",
        lambda: [(k, r) for k, r, _ in running.kube.events],
        lambda events: ("Warning", "GpuUnhealthy") in events,
        10,
    )
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
    reply = await asyncio.wait_for(running.kubelet.plugin(GPU).Allocate(request), scaled(5))
    assert reply.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    release.set()
    await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 3}, timeout=10)
    assert [True] == released_by_test


async def test_a_hostile_key_beside_the_selected_config_is_named_in_an_event_and_serving_goes_on(
    running: Running,
) -> None:
    """The demo node's crash loop: 480,000 list items (940 KB) in a key no node selects."""
    hostile = "version: v1\ngpus: [" + ",".join(["0"] * 480_000) + "]\n"
    running.kube.set_configmap(NS, "gpu-sharing-config", {"mine": replicas(3), "hostile": hostile})
    await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 3}, timeout=10)
    invalid = [m for k, r, m in running.kube.events if (k, r) == ("Warning", "ConfigInvalid")]
    assert len(invalid) == 1
    assert invalid[0].startswith("ConfigMap keys with errors, not selected by this node: hostile: ")
    assert "the limit for one config is 262144" in invalid[0]
    running.kube.set_configmap(NS, "gpu-sharing-config", {"mine": replicas(2), "hostile": hostile})
    await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 2}, timeout=10)
    assert 1 == sum(r == "ConfigInvalid" for _, r, _ in running.kube.events)  # not news: said once


def _fifo(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(
    ("broken", "make", "reason"),
    [
        pytest.param("j", Path.mkdir, "JournalCorrupt", id="journal-is-a-directory"),
        pytest.param("j", _fifo, "JournalCorrupt", id="journal-is-a-fifo"),
        pytest.param("j.lock", Path.mkdir, "JournalUnusable", id="lock-file-is-a-directory"),
        pytest.param("j.lock", _fifo, "JournalUnusable", id="lock-file-is-a-fifo"),
    ],
)
async def test_a_journal_path_that_is_not_a_file_is_said_and_the_devices_stay_served(  # noqa: PLR0917
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    state: Path,
    nvml: Any,
    broken: str,
    make: Callable[[Path], object],
    reason: str,
) -> None:
    make(tmp_path / broken)
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "T4")])
    kubelet = await FakeKubelet(plugin_dir).start()
    kube = FakeKube(
        "n1", {(NS, "gpu-sharing-config"): {"mine": replicas(2)}, (NS, "gpu-sharing-presets"): {}}
    )
    kube.label(**{"nvidia.com/device-plugin.config": "mine"})
    settings = Settings(
        node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir, journal=tmp_path / "j"
    )
    backend = NvmlBackend(nvml, CATALOG, event_poll_s=0.05)
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    agent = Agent(settings, kube=kube, backend=backend, fleet=fleet, catalog=CATALOG)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2}, timeout=10)
        await kubelet.wait(lambda: any(r == reason for _, r, _ in kube.events), timeout=10)
        ((kind, message),) = {(k, m) for k, r, m in kube.events if r == reason}
        assert "Warning" == kind
        assert str(tmp_path / broken) in message
        assert "was could not" not in message
        if broken == "j.lock":  # the change cannot run: the Node says so
            assert "failed" == kube.node.labels[STATE_LABEL]
        else:  # moved aside like any other corrupt journal; the next change runs
            assert (tmp_path / "j.corrupt").exists()
    finally:
        stop.set()
        await task
        kube.close()
        await kubelet.stop()


async def test_a_restarted_agent_registers_what_its_last_good_config_gives_before_the_api_answers(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While none of our plugins is registered the kubelet refuses every pod asking for a slice, so a
    restarted agent serves the config it last applied before it has read anything from the API
    server (here out of reach, and with no grace period that would serve it anyway)."""
    running.stop.set()
    await running.task
    await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 0}, timeout=10)
    monkeypatch.setattr(agent_module, "API_GRACE_S", 3600.0)
    kube = Unreachable("n1", {})
    backend = NvmlBackend(running.backend_nvml, CATALOG, event_poll_s=0.05)
    fleet = Fleet(FleetSettings(plugin_dir=running.plugin_dir, poll_interval_s=0.02))
    agent = Agent(running.agent.settings, kube=kube, backend=backend, fleet=fleet, catalog=CATALOG)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 2}, timeout=10)
        assert agent.node.current is None  # nothing was read from the API server
    finally:
        stop.set()
        await task
        kube.close()


async def test_sharing_apply_refuses_beside_a_running_agent_and_changes_nothing(
    running: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "all-mig.yaml"
    config.write_text("version: v1\ngpus:\n  - devices: all\n    mig: disabled\n    replicas: 4\n")
    before = simstate.counters(running.state)
    capsys.readouterr()
    args = [
        "apply",
        "--config",
        str(config),
        "--name",
        "all-mig",
        "--driver-root",
        str(running.state.parents[3]),
    ]
    args += ["--journal", str(tmp_path / "j"), "--no-kubelet"]
    assert 1 == await asyncio.to_thread(main, args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"the agent (pid {os.getpid()}) serves this node" in err
    assert "edit the node's config in the ConfigMap" in err
    assert before == simstate.counters(running.state)
    assert {GPU: 2} == running.kubelet.allocatable()
    running.stop.set()
    await running.task
    # The agent has gone: `sharing apply` is the node's tool again.
    assert 0 == await asyncio.to_thread(main, args)


async def test_drain_mode_evicts_at_the_next_recheck_once_a_budget_allows_it(
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    state: Path,
    nvml: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A PodDisruptionBudget refused evicting the pod that blocks a change; once the budget lets go,
    the re-check of the blocked change evicts it. A budget changing is nothing the agent watches: the
    eviction waited for the next resync (5 minutes) before, and a node test timed out on it."""
    monkeypatch.setattr(agent_module, "API_GRACE_S", 3600.0)  # its one reconcile would hide the wait
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "T4")])
    kubelet = await FakeKubelet(plugin_dir).start()
    configs = {"two": replicas(2), "one": replicas(1)}
    kube = FakeKube("n1", {(NS, "gpu-sharing-config"): configs, (NS, "gpu-sharing-presets"): {}})
    pod_resources = Kubelet({})
    settings = Settings(
        node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir, journal=tmp_path / "j",
        drain=True, blocked_recheck_seconds=0.05,
    )  # fmt: skip
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    backend = NvmlBackend(nvml, CATALOG)
    agent = Agent(
        settings, kube=kube, backend=backend, fleet=fleet, catalog=CATALOG, pod_resources=pod_resources
    )
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        kube.label(**{"nvidia.com/device-plugin.config": "two"})
        await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2}, timeout=10)
        replica = max(kubelet.devices(GPU))
        pod_resources.listing_ = Listing(
            frozenset({"team-a/trainer"}), (Holding("team-a", "trainer", "main", GPU, frozenset({replica})),)
        )
        kube.budget.add("team-a/trainer")
        kube.label(**{"nvidia.com/device-plugin.config": "one"})
        await until("the refusal said", lambda: any(r == "Draining" for _, r, _ in kube.events), scaled(10))
        assert [] == kube.evicted
        assert kube.node.unschedulable
        kube.budget.clear()  # the budget lets go; nothing else changes
        await until("the trainer evicted", lambda: bool(kube.evicted), scaled(10))
        assert ["team-a/trainer"] == kube.evicted
    finally:
        stop.set()
        await task
        kube.close()
        await kubelet.stop()


async def test_a_shipped_preset_that_does_not_fit_the_gpus_is_no_warning_until_the_node_selects_it(
    running: Running,
) -> None:
    """A mixed fleet: a preset that makes MIG devices on every GPU cannot apply to this T4 node. That is
    no error of the user's (the node does not select it), so only the user's own broken key is named;
    selecting the preset is refused with the reason."""
    mig_everywhere = "version: v1\ngpus:\n  - devices: all\n    mig: {1g.5gb: 7}\n"
    running.kube.set_configmap(NS, "gpu-sharing-presets", {"all-1g": mig_everywhere})
    running.kube.set_configmap(NS, "gpu-sharing-config", {"mine": replicas(3), "broken": "version: v9\n"})
    await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 3}, timeout=10)
    invalid = [m for k, r, m in running.kube.events if (k, r) == ("Warning", "ConfigInvalid")]
    assert len(invalid) == 1
    assert invalid[0].startswith("ConfigMap keys with errors, not selected by this node: broken: ")
    assert "all-1g" not in invalid[0]
    running.kube.label(**{"nvidia.com/device-plugin.config": "all-1g"})
    await until(
        "the preset refused",
        lambda: any(r == "ConfigRejected" and "all-1g" in m for _, r, m in running.kube.events),
    )
    assert {GPU: 3} == running.kubelet.allocatable()  # the last good config goes on serving


def reconciles(agent: Agent) -> float:
    return agent.metrics.registry.get_sample_value("gpu_sharing_reconcile_duration_seconds_count") or 0.0


async def test_a_second_agent_on_the_node_serves_and_changes_nothing_until_the_first_stops(
    running: Running, tmp_path: Path
) -> None:
    """A rolling update with maxSurge: the new agent starts beside the old one. It serves what the last
    applied config gives (so it can be Ready) and leaves every change to the old one; once that one
    stops, it takes the node over, applies the node's config and its lists are what the kubelet has."""
    settings = running.agent.settings
    backend = NvmlBackend(running.backend_nvml, CATALOG)
    fleet = Fleet(FleetSettings(plugin_dir=running.plugin_dir, poll_interval_s=0.02))
    new = Agent(settings, kube=running.kube, backend=backend, fleet=fleet, catalog=CATALOG)
    stop = asyncio.Event()
    task = asyncio.create_task(new.run(stop))
    try:
        await until(
            "the new agent serves the last applied config", lambda: new.report.advertised and fleet.ready
        )
        assert [GPU] == [p.resource for p in fleet.status()]
        running.kube.set_configmap(NS, "gpu-sharing-config", {"mine": replicas(3)})
        await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 3}, timeout=10)
        assert 0 == reconciles(new)  # the old agent applied it; the new one changed nothing
        running.stop.set()
        await running.task
        await until("the new agent reconciled", lambda: reconciles(new) > 0)
        await running.kubelet.wait(lambda: running.kubelet.allocatable() == {GPU: 3}, timeout=10)
        assert running.kube.node.labels.get(STATE_LABEL) == "success"
    finally:
        stop.set()
        await task


class SlowKube(FakeKube):
    """An API server that, while `held`, answers each list of the node's pods only when the test lets
    it (busy for a while); the agent asks it before a change, in a thread."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.held = False
        self.waiting = threading.Event()
        self._answers = threading.Semaphore(0)

    def list_node_pods(self, node: str) -> tuple[BoundPod, ...]:
        if self.held:
            self.waiting.set()
            self._answers.acquire(timeout=scaled(30))
        return super().list_node_pods(node)

    def answer(self, *, hold: bool) -> None:
        """Let the waiting list through (and hold the next one, or none)."""
        self.held = hold
        self.waiting.clear()
        self._answers.release()


async def test_a_newly_selected_config_is_pending_from_the_moment_the_agent_takes_it_up(
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    state: Path,
    nvml: Any,
) -> None:
    """Before its first hardware step a change asks who holds the devices (the kubelet, the API
    server) and withdraws what goes: seconds on a busy node. `sharing status` named the new config
    with the last one's `success` meanwhile, and the state label said `success` beside the new
    config's name: a user (or a script) waiting for `success` after a relabel went on at once."""
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")])
    kubelet = await FakeKubelet(plugin_dir).start()
    configs = {
        "small": "version: v1\nmigStrategy: single\ngpus:\n  - devices: all\n    mig: {1g.5gb: 7}\n",
        "big": "version: v1\nmigStrategy: single\ngpus:\n  - devices: all\n    mig: {3g.20gb: 2}\n",
    }
    kube = SlowKube("n1", {(NS, "gpu-sharing-config"): configs, (NS, "gpu-sharing-presets"): {}})
    settings = Settings(
        node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir, journal=tmp_path / "j",
        http_port=0, usage_enabled=False,
    )  # fmt: skip
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    agent = Agent(
        settings,
        kube=kube,
        backend=NvmlBackend(nvml, CATALOG),
        fleet=fleet,
        catalog=CATALOG,
        pod_resources=Kubelet({}),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))

    def profiles() -> list[str]:
        return sorted(d["profile"] for d in mig_devices(state)[0])

    def config() -> tuple[str | None, str | None, str | None]:
        """What `sharing status` says of the config (its document is this, a second old at most) and
        the state label."""
        said = agent.report.config()
        return said.selected, said.state, kube.node.labels.get(STATE_LABEL)

    try:
        kube.label(**{"nvidia.com/device-plugin.config": "small"})
        await kubelet.wait(lambda: kubelet.allocatable() == {"nvidia.com/gpu": 7}, timeout=10)
        assert ("small", "success", "success") == config()
        kube.held = True
        kube.label(**{"nvidia.com/device-plugin.config": "big"})
        while True:
            assert await asyncio.to_thread(kube.waiting.wait, scaled(10))
            said = config()
            if said[0] == "big":
                break
            assert ("small", "success", "success") == said  # a reconcile that began before the relabel
            kube.answer(hold=True)
        assert ("big", "pending", "pending") == said
        assert ["1g.5gb"] * 7 == profiles()  # nothing changed on the GPU yet
        kube.answer(hold=False)
        await until("the change applied", lambda: kube.node.labels.get(STATE_LABEL) == "success")
        assert (("big", "success", "success"), ["3g.20gb"] * 2) == (config(), profiles())
    finally:
        kube.answer(hold=False)
        stop.set()
        await task
        kube.close()
        await kubelet.stop()
