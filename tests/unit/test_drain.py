"""Drain mode's cordon is the agent's to undo, whatever the drain's outcome, and only the agent's.

The Drainer against the in-memory API (tests/node/test_drain.py drains the real node).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from sharing.kube import NodeObject
from sharing.kube.watch import watch_node
from sharing.kubelet.holders import Holders
from sharing.labels import ConfigState
from sharing.model import Holding
from sharing.rollout.drain import CORDONED, Drainer
from sharing.rollout.verdict import Retry, Verdict
from tests.unit.fakekube import FakeKube

SLICE = "MIG-5f1c3a52-0c1d-4d3e-9f00-2b8a1e6c7d90"
BLOCKED = Verdict(ConfigState.FAILED, "ConfigApplyBlocked", "waits", "x", retry=Retry.BLOCKED,
                  blockers=frozenset({SLICE}))  # fmt: skip
HELD = Holders((Holding("team-a", "trainer", "main", "nvidia.com/mig-3g.20gb", frozenset({SLICE})),))


class Draining:
    def __init__(self, kube: FakeKube, *, enabled: bool = True) -> None:
        self.kube = kube
        self.node = watch_node(kube, "n1", 60)
        self.node.current = kube.get_node("n1")
        self.said: list[tuple[str, str, str]] = []
        self.drainer = Drainer(kube, self.node, self._event, enabled=enabled)

    async def _event(self, kind: str, reason: str, message: str) -> None:
        self.said.append((kind, reason, message))

    async def after(self, verdict: Verdict) -> NodeObject:
        async def holders() -> Holders:
            return HELD

        await self.drainer.after(verdict, holders)
        return self.kube.node


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube("n1", {})


OUTCOMES = [
    pytest.param(Verdict(ConfigState.SUCCESS, "ConfigApplied", "applied", "x"), id="applied"),
    pytest.param(
        Verdict(ConfigState.FAILED, "ConfigApplyFailed", "failed", "x", retry=Retry.BACKOFF), id="failed"
    ),
    pytest.param(Verdict(ConfigState.FAILED, "ConfigRejected", "no such config", "x"), id="rejected"),
    pytest.param(Verdict(None), id="label-removed"),
]


@pytest.mark.parametrize("outcome", OUTCOMES)
async def test_the_agents_cordon_is_undone_on_every_outcome(kube: FakeKube, outcome: Verdict) -> None:
    draining = Draining(kube)
    node = await draining.after(BLOCKED)
    assert (True, "true") == (node.unschedulable, node.annotations.get(CORDONED))
    assert ["team-a/trainer"] == kube.evicted
    node = await draining.after(outcome)
    assert (False, None) == (node.unschedulable, node.annotations.get(CORDONED))
    assert "uncordoned" in draining.said[-1][2]


@pytest.mark.parametrize("enabled", [True, False], ids=["drain-on", "drain-turned-off"])
@pytest.mark.parametrize("outcome", OUTCOMES)
async def test_an_agent_restarted_mid_drain_undoes_its_cordon(
    kube: FakeKube, outcome: Verdict, enabled: bool
) -> None:
    await Draining(kube).after(BLOCKED)
    restarted = Draining(kube, enabled=enabled)  # a new agent: nothing in memory, the Node remembers
    node = await restarted.after(outcome)
    assert (False, None) == (node.unschedulable, node.annotations.get(CORDONED))


async def test_an_agent_restarted_with_drain_mode_off_undoes_its_cordon_while_the_change_waits(
    kube: FakeKube,
) -> None:
    await Draining(kube).after(BLOCKED)
    restarted = Draining(kube, enabled=False)
    node = await restarted.after(BLOCKED)
    assert (False, None) == (node.unschedulable, node.annotations.get(CORDONED))
    assert "drain mode is off" in restarted.said[-1][2]


@pytest.mark.parametrize("outcome", OUTCOMES)
async def test_a_cordon_a_person_made_is_never_undone(kube: FakeKube, outcome: Verdict) -> None:
    kube.node = replace(kube.node, unschedulable=True)
    draining = Draining(kube)
    node = await draining.after(BLOCKED)
    assert ["team-a/trainer"] == kube.evicted
    assert CORDONED not in node.annotations
    node = await draining.after(outcome)
    assert node.unschedulable
