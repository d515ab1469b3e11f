"""Each node follows its own label, and a ConfigMap edit reaches exactly the nodes that use the config.

Nodes a and b select config `work`, node c `work-c` (the same text). Editing `work` (GPU 1's
time-sliced replicas from 2 to 3) converges a and b; c, whose agent sees the same edit, changes
nothing: its allocatable and state stay as they were in every update of its Node, and it says
nothing new.
"""

from __future__ import annotations

import pytest
from bench.clients import Watch
from lab.cluster import CONFIG_LABEL, NODES, STATE_LABEL, WORK

from tests.cluster.conftest import Cluster
from tests.polling import poll

pytestmark = pytest.mark.node


def reconciles(cluster: Cluster, node: str) -> float:
    """How many reconciles the node's agent has run (its /metrics)."""
    text = cluster.agent_exec(node, "python3", "-c", METRICS)
    line = next(
        line for line in text.splitlines() if line.startswith("gpu_sharing_reconcile_duration_seconds_count")
    )
    return float(line.split()[-1])


METRICS = (
    "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9402/metrics').read().decode())"
)


def applied_events(cluster: Cluster, node: str) -> list[str]:
    selector = f"involvedObject.kind=Node,involvedObject.name={node},reason=ConfigApplied"
    items = cluster.get(f"/api/v1/namespaces/default/events?fieldSelector={selector}")["items"]
    return sorted(e["metadata"]["name"] for e in items)


def test_a_config_edit_converges_the_nodes_that_use_it_and_no_other(
    cluster: Cluster, node_watch: Watch
) -> None:
    for name, (_, config, expected) in NODES.items():
        assert (config, "success") == (cluster.labels(name)[CONFIG_LABEL], cluster.labels(name)[STATE_LABEL])
        assert expected == cluster.allocatable(name)
    quiet_before = applied_events(cluster, "node-c")
    seen_before = reconciles(cluster, "node-c")
    mark = node_watch.mark()
    three = {**NODES["node-a"][2], "nvidia.com/gpu-ts": "3"}
    try:
        cluster.put_config(
            "work",
            WORK.replace(
                "replicas: 2\n    rename: {nvidia.com/gpu: gpu-ts}",
                "replicas: 3\n    rename: {nvidia.com/gpu: gpu-ts}",
            ),
        )
        cluster.wait_converged("node-a", three)
        cluster.wait_converged("node-b", {**NODES["node-b"][2], "nvidia.com/gpu-ts": "3"})
        # node-c's agent has seen the edit too (a ConfigMap change starts a reconcile) ...
        poll(
            "node-c's agent reconciled after the edit",
            lambda: reconciles(cluster, "node-c"),
            lambda n: n > seen_before,
        )
        # ... and changed nothing: every update of its Node since the edit shows what it had.
        updates = [view for _, _, name, view in node_watch.since(mark) if name == "node-c"]
        assert all((v["allocatable"], v["state"]) == (NODES["node-c"][2], "success") for v in updates), (
            updates
        )
        assert NODES["node-c"][2] == cluster.allocatable("node-c")
        assert quiet_before == applied_events(cluster, "node-c")
        assert len(applied_events(cluster, "node-a")) > 0
    finally:
        cluster.put_config("work", WORK)
        for name in ("node-a", "node-b"):
            cluster.wait_converged(name, NODES[name][2])
