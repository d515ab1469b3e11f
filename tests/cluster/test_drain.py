"""`kubectl drain` of one node while another node is in the middle of a change.

Pods hold a MIG device on every node. node-b is given a config that would destroy the 3g.40gb its
pod holds: the change waits (`failed`, `ConfigApplyBlocked`) and destroys nothing. While it waits,
node-a is drained as an operator does before maintenance (`kubectl drain --ignore-daemonsets`: its
pod evicted, the agent's DaemonSet pod left) and its agent restarted (the DaemonSet puts a new one on
the cordoned node, as after a reboot). Nothing is destroyed on any node, node-a's new agent converges
to what it offered before, the node is uncordoned, and node-b's change finishes once its pod is gone:
every node `success`. The test puts node-b's config back and removes its own at the end.
"""

from __future__ import annotations

from typing import Any

import pytest
from lab.cluster import CONFIG_LABEL, MIG, NODES, STATE_LABEL, WORK
from lab.helm import NAMESPACE

from tests.cluster.conftest import Cluster
from tests.cluster.test_configs import reconciles
from tests.hardware import mig_devices
from tests.polling import poll

pytestmark = pytest.mark.node

# node-b's A100-80GB GPU 0: from {1g.10gb: 2, 3g.40gb: 1} to seven 1g.10gb, the rest as `work`.
SEVEN = WORK.replace(
    "mig: {1g.10gb: 2, 3g.40gb: 1}",
    "mig: {1g.10gb: 7}",
)
SEVEN_OFFERS = {**NODES["node-b"][2], "nvidia.com/mig-1g.10gb": "7"}
del SEVEN_OFFERS["nvidia.com/mig-3g.40gb"]


def instances(cluster: Cluster, node: str) -> dict[str, tuple[int, str]]:
    """{MIG device UUID: (GPU index, profile)} of every MIG device on the node, as its hardware has them."""
    devices = mig_devices(cluster.node(node).gpus_state)
    return {d["uuid"]: (index, d["profile"]) for index, rows in devices.items() for d in rows if d["uuid"]}


def state(cluster: Cluster, node: str) -> str | None:
    return cluster.labels(node).get(STATE_LABEL)


def events(cluster: Cluster, node: str, reason: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind=Node,involvedObject.name={node},reason={reason}"
    return list(cluster.get(f"/api/v1/namespaces/default/events?fieldSelector={selector}")["items"])


def seen(cluster: Cluster, pod: str) -> set[str]:
    lines = cluster.kubectl("exec", pod, "--", "env").splitlines()
    visible = next(
        (v for k, _, v in (line.partition("=") for line in lines) if k == "NVIDIA_VISIBLE_DEVICES"), ""
    )
    return set(visible.split(",")) - {""}


def test_a_drain_beside_a_waiting_change_destroys_nothing_and_every_node_converges(cluster: Cluster) -> None:
    blocked_before = len(events(cluster, "node-b", "ConfigApplyBlocked"))
    before = {node: instances(cluster, node) for node in NODES}
    pods = {
        "node-a": cluster.start_pod("node-a", {MIG["node-a"]: "1"}),
        "node-b": cluster.start_pod("node-b", {"nvidia.com/mig-3g.40gb": "1"}),
        "node-c": cluster.start_pod("node-c", {MIG["node-c"]: "1"}),
    }
    uids = {node: cluster.wait_running(pod)["metadata"]["uid"] for node, pod in pods.items()}
    held = {node: seen(cluster, pod) for node, pod in pods.items()}
    for node, uuids in held.items():
        assert 1 == len(uuids), (node, uuids)
        assert uuids <= set(before[node]), (node, uuids, before[node])
    (held_b,) = held["node-b"]
    assert (0, "3g.40gb") == before["node-b"][held_b]
    old_agent = cluster.agent_pods()["node-a"]["metadata"]["uid"]
    try:
        # node-b mid-change: the new config needs the 3g.40gb its pod holds; it waits.
        cluster.put_config("drain-seven", SEVEN)
        cluster.kubectl("label", "node", "node-b", f"{CONFIG_LABEL}=drain-seven", "--overwrite")
        poll(
            "node-b's change blocked by its pod",
            lambda: (state(cluster, "node-b"), len(events(cluster, "node-b", "ConfigApplyBlocked"))),
            lambda s: s[0] == "failed" and s[1] > blocked_before,
            120,
        )
        # node-a drained meanwhile, and its agent restarted on the cordoned node.
        drained = cluster.first.kubectl(
            "drain", "node-a", "--ignore-daemonsets", "--force", "--timeout=120s", timeout=150
        )
        assert 0 == drained.returncode, drained.stderr
        assert cluster.get("/api/v1/nodes/node-a")["spec"].get("unschedulable")
        poll(
            "node-a's pod evicted", lambda: pods["node-a"] in pod_names(cluster), lambda there: not there, 60
        )
        cluster.kubectl("-n", NAMESPACE, "delete", "pod", cluster.agent_pods()["node-a"]["metadata"]["name"])
        poll(
            "a new agent on the drained node-a, running",
            lambda: cluster.agent_pods().get("node-a"),
            lambda p: p is not None and p["metadata"]["uid"] != old_agent and running_agent(p),
            180,
        )
        # The new agent has reconciled the node (its own /metrics) and offers what the node offered.
        poll("node-a's new agent reconciled", lambda: reconciles(cluster, "node-a"), lambda n: n >= 1, 120)
        cluster.wait_converged("node-a", NODES["node-a"][2])
        # Nothing destroyed anywhere: every MIG device of before is there, the held ones included.
        for node in NODES:
            assert before[node] == instances(cluster, node), node
        for node in ("node-b", "node-c"):
            pod = cluster.wait_running(pods[node])
            assert uids[node] == pod["metadata"]["uid"]
            assert 0 == pod["status"]["containerStatuses"][0]["restartCount"]
            assert held[node] == seen(cluster, pods[node])
        assert "failed" == state(cluster, "node-b")
        cluster.kubectl("uncordon", "node-a")
        assert not cluster.get("/api/v1/nodes/node-a")["spec"].get("unschedulable")
        # node-b's change finishes once the pod that held it back is gone.
        cluster.kubectl("delete", "pod", pods["node-b"], "--wait=true", "--timeout=120s")
        cluster.wait_converged("node-b", SEVEN_OFFERS)
        assert held_b not in instances(cluster, "node-b")
        for node in ("node-a", "node-c"):
            assert NODES[node][2] == cluster.allocatable(node)
            assert "success" == state(cluster, node)
    finally:
        cluster.kubectl("uncordon", "node-a")
        cluster.delete_pods()
        cluster.kubectl("label", "node", "node-b", f"{CONFIG_LABEL}=work", "--overwrite")
        for node, (_, _, expected) in NODES.items():
            cluster.wait_converged(node, expected)
        cluster.put_config("drain-seven", None)


def pod_names(cluster: Cluster) -> set[str]:
    return {p["metadata"]["name"] for p in cluster.get("/api/v1/namespaces/default/pods")["items"]}


def running_agent(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    agent = [c for c in statuses if c["name"] == "agent"]
    return pod.get("status", {}).get("phase") == "Running" and bool(agent) and bool(agent[0].get("ready"))
