"""The rollout against what the kubelet reports, not against the agent's own memory.

A stand-in for the kubelet's PodResources answers here (the real one runs in tests/e2e): one that
keeps offering devices, and one whose List is short, as a starting kubelet's is.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sharing.config.spec import MigMode, MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.deviceplugin import Fleet
from sharing.errors import KubeError
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.labels import ConfigState
from sharing.mig.catalog import default_catalog
from sharing.model import BoundPod, Holding, Listing, NodeState
from sharing.rollout import Rollout
from sharing.rollout import withdraw as withdraw_module
from sharing.rollout.apply import apply_config
from sharing.store.journal import Journal
from tests.unit.fakekubelet import FakeKubelet

CATALOG = default_catalog()
SMALL = "nvidia.com/mig-1g.5gb"


def mig(**profiles: int) -> SharingConfig:
    rule = Rule(Selector(all=True), MigMode.ENABLED, tuple(sorted(profiles.items())))
    return SharingConfig(name=f"mig-{'-'.join(profiles)}", mig_strategy=MigStrategy.MIXED, rules=(rule,))


class Kubelet:
    """PodResources as the kubelet answers it: `offered` per GetAllocatableResources, `listing` per List."""

    def __init__(self, offered: dict[str, frozenset[str]], listing: Listing | None = None) -> None:
        self.offered = offered
        self.listing_ = listing or Listing()
        self.asked = 0

    async def allocatable(self) -> dict[str, frozenset[str]]:
        self.asked += 1
        return self.offered

    async def listing(self) -> Listing:
        return self.listing_

    async def holdings(self) -> tuple[Holding, ...]:
        return self.listing_.holdings


@pytest.fixture
async def backend(state: Path, nvml: Any) -> AsyncIterator[NvmlBackend]:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")])
    b = NvmlBackend(nvml, CATALOG)
    yield b
    await b.close()


async def small_slices(backend: NvmlBackend, tmp_path: Path) -> NodeState:
    """The A100 cut into 1g.5gb slices (by an agent that has gone since)."""
    await apply_config(backend, mig(**{"1g.5gb": 7}), catalog=CATALOG, journal=Journal(tmp_path / "j"))
    return await backend.observe()


def mig_uuids(node: NodeState) -> set[str]:
    return {ci.uuid for g in node.gpus for _, ci in g.mig_devices}


async def nothing() -> None:
    pass


def layout(node: NodeState) -> Counter[str]:
    return Counter(gi.profile for g in node.gpus for gi in g.instances)


async def test_the_first_change_after_an_agent_restart_waits_until_the_kubelet_stops_offering(
    backend: NvmlBackend, tmp_path: Path, kubelet: FakeKubelet, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted agent has advertised nothing yet: the withdrawal used to confirm the IDs in its own
    memory (none) and destroy at once, while the kubelet still offered the slices to new pods."""
    observed = await small_slices(backend, tmp_path)
    before = mig_uuids(observed)
    still = Kubelet({SMALL: frozenset(before)})  # the kubelet keeps offering them
    monkeypatch.setattr(withdraw_module, "CONFIRM_TIMEOUT_S", 0.2)
    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"), pod_resources=still
    )
    verdict, _ = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert ConfigState.FAILED is verdict.state
    assert "ConfigApplyBlocked" == verdict.reason
    assert "the kubelet still offers" in verdict.message
    assert before == mig_uuids(await backend.observe())  # nothing destroyed


async def test_a_change_runs_once_the_kubelet_confirms_what_it_no_longer_offers(
    backend: NvmlBackend, tmp_path: Path, kubelet: FakeKubelet, fleet: Fleet
) -> None:
    observed = await small_slices(backend, tmp_path)
    gone = Kubelet({SMALL: frozenset()})
    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"), pod_resources=gone
    )
    verdict, after = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert ConfigState.SUCCESS is verdict.state
    assert Counter({"7g.40gb": 1}) == layout(after)
    assert gone.asked  # confirmed by the kubelet, not by memory


async def test_devices_advertised_again_during_a_change_are_not_the_ones_it_withdrew(
    backend: NvmlBackend, tmp_path: Path, kubelet: FakeKubelet, fleet: Fleet
) -> None:
    """An MPS daemon's state (or, on DRA, a GPU's health) changing in the middle of a change makes
    the agent advertise its devices again. That used to send what was advertised before the change,
    withdrawn devices included: the kubelet offered the seven 1g.5gb slices again while they were
    destroyed, and kept offering them, gone, until the next advertisement."""
    observed = await small_slices(backend, tmp_path)
    small = mig(**{"1g.5gb": 7})

    class Republishing(Kubelet):
        async def allocatable(self) -> dict[str, frozenset[str]]:
            await rollout.republish()  # what the agent's MPS watch does when a daemon changes
            await fleet.sync()
            return await super().allocatable()

    kubelet_says = Republishing({SMALL: frozenset()})
    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"),
        pod_resources=kubelet_says,
    )  # fmt: skip
    await rollout.advertise(observed, small)
    await kubelet.wait(lambda: kubelet.allocatable().get(SMALL) == 7)
    verdict, after = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert ConfigState.SUCCESS is verdict.state
    assert kubelet_says.asked
    await fleet.sync()
    destroyed = mig_uuids(observed) - mig_uuids(after)
    offered = {i for i, health in kubelet.devices(SMALL).items() if health == "Healthy"}
    assert set() == offered & destroyed


async def test_a_pod_the_api_server_bound_here_but_podresources_does_not_list_blocks_every_change(
    backend: NvmlBackend, tmp_path: Path, kubelet: FakeKubelet, fleet: Fleet
) -> None:
    """A starting kubelet serves PodResources before it has learned its pods: List came back empty and
    a pod's slice was destroyed. The API server's pods bound to this node must all be listed first."""
    observed = await small_slices(backend, tmp_path)
    before = mig_uuids(observed)
    short = Kubelet({SMALL: frozenset()}, Listing())  # the holder is missing from List

    async def bound() -> tuple[BoundPod, ...]:
        return (BoundPod("default", "holder", frozenset({SMALL, "cpu"})),)

    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"),
        pod_resources=short, bound_pods=bound,
    )  # fmt: skip
    verdict, _ = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert "ConfigApplyBlocked" == verdict.reason
    assert "default/holder" in verdict.message
    assert before == mig_uuids(await backend.observe())
    # Once the kubelet lists it (with no devices: it holds none), the change runs.
    short.listing_ = Listing(frozenset({"default/holder"}), ())
    verdict, after = await rollout.roll_out(mig(**{"7g.40gb": 1}), await backend.observe(), nothing)
    assert ConfigState.SUCCESS is verdict.state, verdict.message
    assert Counter({"7g.40gb": 1}) == layout(after)


async def test_an_api_server_that_cannot_say_which_pods_are_bound_here_blocks_every_change(
    backend: NvmlBackend, tmp_path: Path, kubelet: FakeKubelet, fleet: Fleet
) -> None:
    observed = await small_slices(backend, tmp_path)
    listed = Kubelet({SMALL: frozenset()}, Listing(frozenset({"default/holder"}), ()))

    async def unreachable() -> tuple[BoundPod, ...]:
        raise KubeError("list pods: connection refused")

    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"),
        pod_resources=listed, bound_pods=unreachable,
    )  # fmt: skip
    verdict, _ = await rollout.roll_out(mig(**{"7g.40gb": 1}), observed, nothing)
    assert "ConfigApplyBlocked" == verdict.reason
    assert "connection refused" in verdict.message
    assert mig_uuids(observed) == mig_uuids(await backend.observe())


def checkpoint(plugin_dir: Path, resource: str, *ids: str) -> None:
    """The kubelet device manager's checkpoint, as writeCheckpoint leaves it (one pod's container)."""
    entry = {
        "PodUID": "uid-1",
        "ContainerName": "main",
        "ResourceName": resource,
        "DeviceIDs": {"0": list(ids)},
        "AllocResp": "",
    }
    data = {"Data": {"PodDeviceEntries": [entry], "RegisteredDevices": {resource: list(ids)}}, "Checksum": 0}
    (plugin_dir / "kubelet_internal_checkpoint").write_text(json.dumps(data))


async def test_a_restarted_agent_offers_nothing_a_pod_may_hold_in_another_form_while_list_is_short(
    backend: NvmlBackend, tmp_path: Path, kubelet: FakeKubelet, fleet: Fleet, plugin_dir: Path
) -> None:
    """Found by the soak: a pod held a 3g.20gb whole; the config in effect time-slices it, so the
    agent withheld it; the agent was killed while the kubelet started, and its successor, unable to
    tell who holds what (List short) and with nothing withheld in its memory, offered the slice as
    replicas: the kubelet gave one to a second pod. The device manager's checkpoint records it."""
    observed = await small_slices(backend, tmp_path)
    held = sorted(mig_uuids(observed))[0]
    checkpoint(plugin_dir, SMALL, held)
    short = Kubelet({}, Listing())

    async def bound() -> tuple[BoundPod, ...]:
        return (BoundPod("default", "holder", frozenset({SMALL})),)

    rollout = Rollout(
        backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j2"),
        pod_resources=short, bound_pods=bound,
    )  # fmt: skip
    sliced = replace(
        mig(**{"1g.5gb": 7}), rules=(replace(mig(**{"1g.5gb": 7}).rules[0], replicas=Replicas(2)),)
    )
    inventory = await rollout.advertise(observed, sliced)
    offered = {d.id for _, devices in inventory.resources for d in devices}
    assert not {i for i in offered if i.startswith(held)}
    assert len(offered) == 12  # the other six slices, two replicas each
