"""A rolling upgrade of the agent while every node runs work: nothing it serves is disrupted.

On each of the three nodes a pod holds a MIG device, one a time-sliced replica and one an MPS
replica whose process stays attached to its GPU's MPS control daemon (it exits, failing its pod,
if the daemon goes). Then `helm upgrade` moves the agent to a new image (the same build under another
tag, as a release would be). The chart's update strategy starts each node's new agent beside the old
one (maxSurge 1) and stops the old one only once the new one is Ready (maxUnavailable 0); the MPS
keepers, a DaemonSet of their own updated only on delete, are left alone. What a user sees: every
agent replaced, no pod restarted or recreated, every MIG device and MPS daemon the same, no update of
any Node showing less allocatable than its pods hold, every node `success` on the new image.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lab
import pytest
from bench.clients import Watch
from lab.cluster import MIG, MPS_CLIENT, NODES, STATE_LABEL, install, mig_instances, mps_daemons, retag, runs
from lab.helm import NAMESPACE
from lab.images import agent_image

from tests.cluster.conftest import Cluster
from tests.polling import poll

pytestmark = pytest.mark.node

KEEPER = "app.kubernetes.io/name=gpu-sharing-mps-keeper"


def attached(node: lab.RealNode) -> Callable[[], bool]:
    return lambda: sum(clients for _, clients in mps_daemons(node).values()) == 1


def pods_of(cluster: Cluster, selector: str) -> dict[str, tuple[str, str]]:
    """Live pods of a DaemonSet by node: (UID, image)."""
    items = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")["items"]
    return {
        p["spec"]["nodeName"]: (p["metadata"]["uid"], p["spec"]["containers"][0]["image"])
        for p in items
        if not p["metadata"].get("deletionTimestamp")
    }


def workload(cluster: Cluster, names: list[str]) -> dict[str, tuple[str, str, int]]:
    """Each pod's UID, phase and restarts."""
    out = {}
    for name in names:
        pod = cluster.pod(name)
        restarts = sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))
        out[name] = (pod["metadata"]["uid"], pod["status"]["phase"], restarts)
    return out


def agents_on(cluster: Cluster, image: str) -> None:
    """Wait until every node's agent runs `image`, Ready, and its old pod is gone."""

    def done(pods: dict[str, dict[str, Any]]) -> bool:
        return len(pods) == len(NODES) and all(runs(p, image) for p in pods.values())

    def live() -> dict[str, dict[str, Any]]:
        items = cluster.get(
            f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app.kubernetes.io/name=gpu-sharing"
        )["items"]
        if len(items) != len(NODES):  # a surge pod beside an old one, or one terminating
            return {}
        return {p["spec"]["nodeName"]: p for p in items}

    poll(f"every node's agent on {image}, the old ones gone", live, done, 300)


@pytest.fixture
def upgraded(cluster: Cluster) -> Iterator[str]:
    """The new image's reference; afterwards the agents back on the session's image."""
    new = retag([cluster.node(n) for n in NODES], "upgrade")
    try:
        yield new
    finally:
        cluster.delete_pods()
        install(cluster.helm, agent_image())
        agents_on(cluster, agent_image())
        for name, (_, _, expected) in NODES.items():
            cluster.wait_converged(name, expected)


@pytest.mark.timeout(900)
def test_a_rolling_upgrade_with_work_on_every_node_restarts_no_pod_and_never_lowers_allocatable(
    cluster: Cluster, node_watch: Watch, upgraded: str
) -> None:
    held: dict[str, dict[str, int]] = {}
    names: list[str] = []
    for node in NODES:
        names += [
            cluster.start_pod(node, {MIG[node]: "1"}),
            cluster.start_pod(node, {"nvidia.com/gpu-ts": "1"}),
            cluster.start_pod(
                node,
                {"nvidia.com/gpu-mps": "1"},
                image=agent_image(),
                command=["python3", "-c", MPS_CLIENT],
            ),
        ]
        held[node] = {MIG[node]: 1, "nvidia.com/gpu-ts": 1, "nvidia.com/gpu-mps": 1}
    for name in names:
        cluster.wait_running(name)
    for node in NODES:
        poll(f"the MPS client on {node} attached", attached(cluster.node(node)), bool)
    before = workload(cluster, names)
    migs = {node: mig_instances(cluster.node(node)) for node in NODES}
    mps = {node: mps_daemons(cluster.node(node)) for node in NODES}
    agents = pods_of(cluster, "app.kubernetes.io/name=gpu-sharing")
    keepers = pods_of(cluster, KEEPER)
    assert set(keepers) == set(NODES)
    mark = node_watch.mark()

    install(cluster.helm, upgraded)
    agents_on(cluster, upgraded)
    for name, (_, _, expected) in NODES.items():
        cluster.wait_converged(name, expected)

    # Every agent replaced; the keepers (OnDelete) untouched.
    after = pods_of(cluster, "app.kubernetes.io/name=gpu-sharing")
    assert all(after[n][0] != agents[n][0] for n in NODES), (agents, after)
    assert keepers == pods_of(cluster, KEEPER)
    # No pod restarted, recreated or failed; every slice and daemon as it was.
    assert before == workload(cluster, names)
    assert all(phase == "Running" for _, phase, _ in before.values())
    assert migs == {node: mig_instances(cluster.node(node)) for node in NODES}
    assert mps == {node: mps_daemons(cluster.node(node)) for node in NODES}
    # At no update of any Node was its allocatable below what its pods held.
    updates = [(name, view) for _, _, name, view in node_watch.since(mark) if name in NODES]
    short = [
        (name, view["allocatable"])
        for name, view in updates
        if any(int(view["allocatable"].get(r, "0")) < n for r, n in held[name].items())
    ]
    assert short == [], short
    assert all(cluster.labels(n)[STATE_LABEL] == "success" for n in NODES)
