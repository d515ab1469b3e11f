"""Drain mode on the real node: a change that pods block cordons the node, evicts exactly those pods
through the Eviction API (a PodDisruptionBudget holds it back), applies, and uncordons.

Puts the values and the node's label back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from lab.helm import NAMESPACE, lab_values

from tests.node.conftest import ALL_KINDS, CONFIG, CONFIG_LABEL, NODE, NodeUnderTest
from tests.polling import poll

pytestmark = pytest.mark.node

# The A100s all in 1g: nothing of the 3g.20gb slices that the pods below hold survives.
NO_3G = """version: v1
migStrategy: mixed
gpus:
  - devices: {product: A100-SXM4-40GB}
    mig: {1g.5gb: 7}
  - devices: all
    mig: disabled
"""


@pytest.fixture
def draining(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    (old,) = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, drain={"enabled": True}))
    node.running_agent(not_uid=old["metadata"]["uid"])
    node.wait_allocatable()
    # The user's ConfigMap is theirs (the chart made it once): add a config as a user does.
    node.patch_configs({"no-3g": NO_3G})
    yield node
    node.delete("poddisruptionbudget", "keep-trainer")
    node.delete_pods()
    node.label(CONFIG_LABEL, CONFIG)
    node.patch_configs({"no-3g": None})
    (old,) = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
    node.running_agent(not_uid=old["metadata"]["uid"])
    node.wait_allocatable()


def _node(node: NodeUnderTest) -> dict[str, Any]:
    return node.get("node", NODE)


def _trainer_kept_by_a_budget(node: NodeUnderTest) -> str:
    """A pod holding a 3g.20gb that a PodDisruptionBudget keeps, then a config without 3g: a drain."""
    trainer = node.start_pod("nvidia.com/mig-3g.20gb", name="trainer")
    node.wait_running(trainer)
    node.kubectl("label", "pod", trainer, "app=trainer")
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "keep-trainer", "namespace": "default"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "trainer"}}},
    }
    node.create(budget)
    node.label(CONFIG_LABEL, "no-3g")
    return trainer


def test_drain_evicts_the_blockers_applies_and_uncordons_and_a_budget_holds_it_back(
    draining: NodeUnderTest,
) -> None:
    node = draining
    trainer = _trainer_kept_by_a_budget(node)
    # Blocked by the trainer; cordoned; the budget refuses its eviction, so it keeps running.
    poll("the node cordoned", lambda: _node(node)["spec"].get("unschedulable"), bool)
    refused = poll(
        "the refusal said",
        lambda: node.events("Draining"),
        lambda m: any("PodDisruptionBudget" in x for x in m),
    )
    assert any(f"default/{trainer}" in m for m in refused)
    assert "true" == _node(node)["metadata"]["annotations"]["nvidia.com/gpu-sharing.cordoned"]
    assert "Running" == node.pod(trainer)["status"]["phase"]
    # The budget goes: the next re-check evicts the trainer, the change goes through, the node opens.
    node.delete("poddisruptionbudget", "keep-trainer")
    poll("the trainer evicted", lambda: node.exists("pod", trainer), lambda found: not found, 60)
    poll(
        "the change applied",
        node.offered,
        lambda a: a == {"nvidia.com/mig-1g.5gb": "14", "nvidia.com/gpu": "2"},
        90,
    )
    poll("uncordoned", lambda: not _node(node)["spec"].get("unschedulable"), bool)
    after = _node(node)
    assert "nvidia.com/gpu-sharing.cordoned" not in after["metadata"].get("annotations", {})
    assert "success" == after["metadata"]["labels"]["nvidia.com/mig.config.state"]
    assert node.events("Drained")


@pytest.mark.parametrize("restart", [False, True], ids=["rejected", "agent-restarted-then-rejected"])
def test_a_drain_that_ends_without_the_change_uncordons_and_a_persons_cordon_stays(
    draining: NodeUnderTest, restart: bool
) -> None:
    node = draining
    trainer = _trainer_kept_by_a_budget(node)
    poll("the node cordoned", lambda: _node(node)["spec"].get("unschedulable"), bool)
    if restart:  # mid-drain: the new agent knows only what the Node's annotation says
        (old,) = node.agent_pods()
        node.delete("pod", old["metadata"]["name"], namespace=NAMESPACE)
        node.running_agent(not_uid=old["metadata"]["uid"])
    drained = len(node.events("Drained"))
    node.label(CONFIG_LABEL, "no-such-config")
    # Uncordoned, then the annotation removed, then the Event: the last one is what is waited for.
    (said,) = poll("the Drained Event", lambda: node.events("Drained")[drained:], bool, 60)
    assert "the change did not go through (ConfigRejected)" in said
    after = _node(node)
    assert not after["spec"].get("unschedulable")
    assert "nvidia.com/gpu-sharing.cordoned" not in after["metadata"].get("annotations", {})
    assert "Running" == node.pod(trainer)["status"]["phase"]
    # A cordon a person makes is theirs: the agent leaves it, whatever happens next.
    node.kubectl("cordon", NODE)
    try:
        node.label(CONFIG_LABEL, CONFIG)
        poll(
            "the config applied",
            lambda: _node(node)["metadata"]["labels"].get("nvidia.com/mig.config.state"),
            lambda s: s == "success",
            90,
        )
        assert _node(node)["spec"].get("unschedulable")
    finally:
        node.kubectl("uncordon", NODE)
