"""The front-end choice and claims as holders, on the fake driver under the real pynvml.

A claim the scheduler allocated a device of our pool to holds it: a change that would destroy or
re-shape that device waits, and says which claim it waits for. The node label picks the front-end;
a value that is not one is refused with an Event and the node goes on serving as it did.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from sharing.agent import Agent
from sharing.deviceplugin import Fleet, FleetSettings
from sharing.devices import Inventory
from sharing.dra.foreign import Foreign
from sharing.dra.fragmentation import GpuRoom
from sharing.errors import KubeError
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.kube.features import ClusterFeatures
from sharing.labels import STATE_LABEL, ConfigState
from sharing.mig.catalog import default_catalog
from sharing.model import ClaimAllocation, ClaimHold, HealthEvent, NodeState
from sharing.rollout import Rollout
from sharing.settings import Settings
from sharing.store import PreparedClaim
from sharing.store.journal import Journal
from tests.fakedriver.test_rollout import Kubelet, layout, mig, mig_uuids, nothing, small_slices
from tests.polling import until
from tests.unit.conftest import plugin_dir  # noqa: F401  (the fixture)
from tests.unit.fakekube import FakeKube
from tests.unit.fakekubelet import FakeKubelet

CATALOG = default_catalog()
NS = "gpu-sharing"
GPU = "nvidia.com/gpu"
FRONTEND = "nvidia.com/gpu-sharing.frontend"


@pytest.fixture
async def backend(state: Path, nvml: Any) -> AsyncIterator[NvmlBackend]:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")])
    b = NvmlBackend(nvml, CATALOG)
    yield b
    await b.close()


async def test_a_claim_allocated_a_mig_device_holds_it_until_the_claim_is_gone(
    backend: NvmlBackend, tmp_path: Path, fleet: Fleet
) -> None:
    """Allocated, not yet prepared, no pod yet: the scheduler has promised the device all the same."""
    observed = await small_slices(backend, tmp_path)
    before = mig_uuids(observed)
    claims = [ClaimAllocation("default", "train", "uid-1", ("gpu-0-mig-2",))]

    async def allocated() -> tuple[ClaimAllocation, ...]:
        return tuple(claims)

    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"),
        pod_resources=Kubelet({}), claims=allocated,
    )  # fmt: skip
    verdict, _ = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert ("ConfigApplyBlocked", ConfigState.FAILED) == (verdict.reason, verdict.state)
    assert "claim default/train (no pod yet)" in verdict.message
    assert before == mig_uuids(await backend.observe())  # nothing destroyed
    claims.clear()
    verdict, after = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert ConfigState.SUCCESS is verdict.state
    assert Counter({"7g.40gb": 1}) == layout(after)


async def test_claims_that_cannot_be_read_hold_every_device(
    backend: NvmlBackend, tmp_path: Path, fleet: Fleet
) -> None:
    observed = await small_slices(backend, tmp_path)
    before = mig_uuids(observed)

    async def unreachable() -> tuple[ClaimAllocation, ...]:
        raise KubeError("list ResourceClaims for pool n1: connection refused")

    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"),
        pod_resources=Kubelet({}), claims=unreachable,
    )  # fmt: skip
    verdict, _ = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert "ConfigApplyBlocked" == verdict.reason
    assert "which ResourceClaims hold devices of this node cannot be read" in verdict.message
    assert before == mig_uuids(await backend.observe())


async def test_a_claim_still_prepared_here_holds_its_device_after_the_claim_is_gone(
    backend: NvmlBackend, tmp_path: Path, fleet: Fleet
) -> None:
    """Its pod may still run: the plugin's checkpoint counts until the kubelet unprepares it; an
    unreadable checkpoint holds every device."""
    observed = await small_slices(backend, tmp_path)
    before = mig_uuids(observed)
    held = sorted(before)[0]
    slices = Slices(prepared_claims=(ClaimHold("ml", "gone", ("ml/p",), frozenset({held})),))
    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"),
        pod_resources=Kubelet({}), dra=slices,
    )  # fmt: skip
    verdict, _ = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert "ConfigApplyBlocked" == verdict.reason
    assert "claim ml/gone (pod ml/p)" in verdict.message
    assert before == mig_uuids(await backend.observe())
    slices.prepared_claims, slices.unknown = (), "the checkpoint /x/claims.json is not JSON"
    verdict, _ = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert "ConfigApplyBlocked" == verdict.reason
    assert "the checkpoint /x/claims.json is not JSON" in verdict.message
    assert before == mig_uuids(await backend.observe())


# --- the agent: the label and the switch ------------------------------------------------------------


@dataclass
class Slices:
    """The DRA front-end as the agent drives it, recording what it is told (the plugin and the
    ResourceSlice publisher are tested on their own)."""

    running: bool = False
    started: list[bool] = field(default_factory=list)
    """At each start, whether the Node then still showed devices of the plugins (`showing`)."""
    showing: Callable[[], bool] = lambda: False
    published: list[Inventory] = field(default_factory=list)
    withdrawn: int = 0
    prepared_claims: tuple[ClaimHold, ...] = ()
    unknown: str = ""
    node_claims: Callable[[], Awaitable[tuple[ClaimAllocation, ...]]] | None = None
    cluster: ClusterFeatures = field(default_factory=lambda: ClusterFeatures(known=True))
    """What the API server keeps (`sharing.kube.features`): everything unless a test says otherwise."""

    async def features(self) -> ClusterFeatures:
        return self.cluster

    async def settled(self) -> None:
        pass

    def room(self) -> tuple[GpuRoom, ...]:
        return ()

    async def start(self) -> None:
        self.running = True
        self.started.append(self.showing())

    async def stop(self) -> None:
        self.running = False

    async def leave(self) -> None:
        await self.withdraw()
        await self.stop()

    async def publish(self, inventory: Inventory, node: NodeState) -> str:
        self.published.append(inventory)
        return ""

    async def withdraw(self) -> str:
        self.withdrawn += 1
        self.published.append(Inventory())
        return ""

    def health(self) -> tuple[bool, str]:
        return self.running, ""

    def foreign(self) -> tuple[Foreign, ...]:
        return ()

    def recorded(self) -> tuple[PreparedClaim, ...]:
        return ()

    async def prepared(self) -> tuple[tuple[ClaimHold, ...], str]:
        return self.prepared_claims, self.unknown

    def devices(self) -> int:
        last = self.published[-1] if self.published else Inventory()
        return sum(len(devices) for _, devices in last.resources)


class WatchedBackend(NvmlBackend):
    """The fake driver's GPUs, saying when the agent's health watch is registered."""

    def __init__(self, nvml: Any, catalog: Any) -> None:
        super().__init__(nvml, catalog, event_poll_s=0.05)
        self.watching = asyncio.Event()

    async def health_events(self) -> AsyncIterator[HealthEvent]:
        # No task switch between this and the registration reaching the (one, in-order) NVML worker.
        self.watching.set()
        async for event in super().health_events():
            yield event


@dataclass
class Running:
    agent: Agent
    kube: FakeKube
    kubelet: FakeKubelet
    slices: Slices | None
    backend: WatchedBackend
    state: Path


REPLICAS = "version: v1\ngpus:\n  - devices: all\n    replicas: 2\n"


async def start_agent(
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    state: Path,
    nvml: Any,
    *,
    dra: bool,
) -> AsyncIterator[Running]:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "T4")])
    kubelet = await FakeKubelet(plugin_dir).start()
    kube = FakeKube("n1", {(NS, "gpu-sharing-config"): {"mine": REPLICAS}, (NS, "gpu-sharing-presets"): {}})
    settings = Settings(
        node_name="n1", driver_root=state.parents[3], device_plugin_dir=plugin_dir, journal=tmp_path / "j",
        blocked_recheck_seconds=0.05,
    )  # fmt: skip
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    slices = Slices() if dra else None
    backend = WatchedBackend(nvml, CATALOG)
    agent = Agent(settings, kube=kube, backend=backend, fleet=fleet, catalog=CATALOG, dra=slices)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    kube.label(**{"nvidia.com/device-plugin.config": "mine"})
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2}, timeout=10)
    yield Running(agent, kube, kubelet, slices, backend, state)
    stop.set()
    await task
    kube.close()
    await kubelet.stop()


@pytest.fixture
async def plain(tmp_path: Path, plugin_dir: Path, state: Path, nvml: Any) -> AsyncIterator[Running]:  # noqa: F811
    async for running in start_agent(tmp_path, plugin_dir, state, nvml, dra=False):
        yield running


@pytest.fixture
async def dual(tmp_path: Path, plugin_dir: Path, state: Path, nvml: Any) -> AsyncIterator[Running]:  # noqa: F811
    async for running in start_agent(tmp_path, plugin_dir, state, nvml, dra=True):
        yield running


async def events(running: Running, reason: str, count: int = 1) -> list[str]:
    def said() -> list[str]:
        return [m for _, r, m in running.kube.events if r == reason]

    await until(f"{count} {reason} Events", lambda: len(said()) >= count)
    return said()


async def test_a_label_that_names_no_front_end_is_refused_and_the_node_keeps_serving(plain: Running) -> None:
    plain.kube.label(**{FRONTEND: "nvlink"})
    said = await events(plain, "FrontendRejected")
    expected = (
        f"node label {FRONTEND}=nvlink: 'nvlink' is not a front-end: deviceplugin or dra; the node stays on"
        " the deviceplugin front-end"
    )
    assert [expected] == said
    assert "failed" == plain.kube.node.labels[STATE_LABEL]
    assert {GPU: 2} == plain.kubelet.allocatable()
    plain.kube.label(**{FRONTEND: "deviceplugin"})
    await until("state success", lambda: plain.kube.node.labels.get(STATE_LABEL) == "success")
    assert {GPU: 2} == plain.kubelet.allocatable()


async def test_dra_asked_of_an_agent_without_it_is_refused(plain: Running) -> None:
    plain.kube.label(**{FRONTEND: "dra"})
    said = await events(plain, "FrontendRejected")
    assert [
        f"label {FRONTEND} asks for the dra front-end, which this agent does not have; the node stays on"
        " the deviceplugin front-end"
    ] == said
    assert {GPU: 2} == plain.kubelet.allocatable()


async def test_switching_withdraws_the_old_front_end_first_and_waits_for_its_claims(dual: Running) -> None:
    assert dual.slices is not None
    dual.kube.label(**{FRONTEND: "dra"})
    await events(dual, "FrontendSwitched")
    await until("2 devices in the slices", lambda: dual.slices is not None and dual.slices.devices() == 2)
    assert dual.slices.running
    assert {GPU: 0} == dual.kubelet.allocatable()  # never both: the plugins are gone
    assert (dual.agent.settings.journal.with_name("frontend")).read_text() == "dra\n"
    # Back: a claim still allocated a device holds the switch (and nothing is offered meanwhile).
    dual.kube.pool_claims = (ClaimAllocation("ml", "trainer", "u1", ("gpu-0-replica-0",), ("ml/trainer-0",)),)
    dual.kube.label(**{FRONTEND: "deviceplugin"})
    waits = await events(dual, "FrontendSwitchBlocked")
    assert "claim ml/trainer (pod ml/trainer-0)" in waits[0]
    assert dual.slices.withdrawn  # the slices are deleted first
    assert 0 == dual.slices.devices()
    assert {GPU: 0} == dual.kubelet.allocatable()
    dual.kube.pool_claims = ()
    await events(dual, "FrontendSwitched", 2)
    await dual.kubelet.wait(lambda: dual.kubelet.allocatable() == {GPU: 2}, timeout=10)
    assert not dual.slices.running


async def test_the_pool_starts_once_the_node_on_the_api_server_shows_the_plugins_resources_gone(
    dual: Running,
) -> None:
    """The scheduler sends a pod asking by limits to the device plugins while the Node's allocatable has
    the resource; the kubelet copies it in on its status loop, after PodResources says it is gone."""
    assert dual.slices is not None
    dual.slices.showing = lambda: dual.kube.node.allocatable.get(GPU, "0") != "0"
    dual.kube.set_allocatable({GPU: "2"})
    with structlog.testing.capture_logs() as logs:
        dual.kube.label(**{FRONTEND: "dra"})
        await until(
            "the switch waits", lambda: any(e["event"] == "frontend_switch_waits_for_node" for e in logs)
        )
    assert {GPU: 0} == dual.kubelet.allocatable()  # PodResources says they are gone: the Node does not yet
    assert not dual.slices.running
    dual.kube.set_allocatable({GPU: "0"})  # the kubelet's next status update
    await events(dual, "FrontendSwitched")
    assert [False] == dual.slices.started


async def test_an_xid_on_the_dra_front_end_reaches_the_slices_as_unhealthy_devices(dual: Running) -> None:
    """The device plugins hear of health through the fleet; the slices (their taints) must hear too."""
    assert dual.slices is not None
    dual.kube.label(**{FRONTEND: "dra"})
    await events(dual, "FrontendSwitched")
    await until("2 devices in the slices", lambda: dual.slices is not None and dual.slices.devices() == 2)
    await dual.backend.watching.wait()  # NVML records events only after their registration:
    await dual.backend.observe()  # this call runs after the watch's registration
    gpu = simstate.read(dual.state)["gpus"][0]["uuid"]
    simstate.inject_xid(dual.state, gpu, 79)  # fell off the bus: critical

    def health() -> set[str]:
        last = dual.slices.published[-1] if dual.slices and dual.slices.published else Inventory()
        return {d.health.value for _, devices in last.resources for d in devices}

    await until("the slices' devices unhealthy", lambda: health() == {"Unhealthy"})
