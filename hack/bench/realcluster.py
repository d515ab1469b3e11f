"""Three real nodes of three kinds (`lab.cluster`, as tests/cluster brings them up: one control plane,
each node its own containerd, kubelet, kube-proxy and fake GPUs), the agent on all of them from its
chart as one DaemonSet.

- cluster_configmap_converge_s_p95: an edit of config `work` in the user's ConfigMap (GPU 1's
  time-sliced replicas 2 <-> 3), from the PATCH until a Node watch shows both nodes that use it
  offering the new count with the state label `success`.
- cluster_upgrade_s: `helm upgrade` to the agent's image under another tag (a release built from the
  same Dockerfile) while every node runs a pod holding a MIG device, one a time-sliced replica and an
  MPS client attached to its daemon, until every node's agent runs the new image, Ready, the old
  agents gone and every node `success`.
- cluster_upgrade_disrupted_pods: those pods restarted, recreated or no longer Running afterwards,
  plus MIG instances or MPS daemons that are not the ones they were (must be 0);
  cluster_upgrade_allocatable_dips: Node updates during the upgrade with less allocatable than the
  node's pods hold (must be 0).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import lab
from lab import cluster, images
from lab.cluster import MIG, MPS_CLIENT, NODES, STATE_LABEL, WORK
from lab.helm import NAMESPACE

from bench.clients import Api, Watch, pod_view
from bench.labnode import PODS, watching
from bench.report import Budget, Results, percentile, say

INDEX = 4
"""The cluster's real-node index (the bench's real node is 2, its DRA node 3)."""
AGENTS = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=app.kubernetes.io/name=gpu-sharing"


def bench_real_cluster(budget: Budget, results: Results) -> None:
    bins = lab.binaries()
    say("real cluster: images, then three nodes up and converged (~2 min)")
    archives = images.all_images(bins)
    start = time.monotonic()
    first, helm = cluster.up("bench-cluster", INDEX, bins, archives)
    try:
        api = Api(f"https://{first.api_address}:6443", first.kubeconfig.parent)
        with contextlib.ExitStack() as stack:
            nodes = stack.enter_context(watching(Watch(api, "/api/v1/nodes", _node_view)))
            pods = stack.enter_context(watching(Watch(api, PODS, pod_view)))
            for name, (_, _, offers) in NODES.items():
                nodes.wait(name, lambda v, offers=offers: v == (offers, "success"), 0, 300)
            results.note(
                "real cluster: up, chart installed, every node success", f"{time.monotonic() - start:.0f} s"
            )
            _configmap_edits(first, nodes, budget, results)
            _upgrade(first, helm, api, (nodes, pods), results)
    finally:
        first.down()


def _node_view(node: Any) -> Any:
    allocatable = node.get("status", {}).get("allocatable", {})
    offers = {k: v for k, v in allocatable.items() if k.startswith("nvidia.com/") and v != "0"}
    return (offers, node.get("metadata", {}).get("labels", {}).get(STATE_LABEL))


def _put(first: lab.RealNode, name: str, text: str) -> None:
    patch = json.dumps({"data": {name: text}})
    first.kubectl(
        "-n", NAMESPACE, "patch", "configmap", "gpu-sharing-config", "--type=merge", "-p", patch, check=True
    )


def _configmap_edits(first: lab.RealNode, nodes: Watch, budget: Budget, results: Results) -> None:
    edits = max(2, budget.label_changes + budget.label_changes % 2)  # even: `work` as it was after
    say(f"real cluster: {edits} edits of config `work` (nodes a and b use it), each until both converge")
    users = [n for n, (_, config, _) in NODES.items() if config == "work"]
    samples = []
    for i in range(edits):
        replicas = 3 if i % 2 == 0 else 2
        text = WORK.replace(
            "replicas: 2\n    rename: {nvidia.com/gpu: gpu-ts}",
            f"replicas: {replicas}\n    rename: {{nvidia.com/gpu: gpu-ts}}",
        )
        since = nodes.mark()
        start = time.monotonic()
        _put(first, "work", text)
        done = [
            nodes.wait(
                n,
                lambda v, want={**NODES[n][2], "nvidia.com/gpu-ts": str(replicas)}: v == (want, "success"),
                since,
                180,
            )
            for n in users
        ]
        samples.append(max(done) - start)
    results.add("cluster_configmap_converge_s_p95", percentile(samples, 95))


def _upgrade(
    first: lab.RealNode, helm: Any, api: Api, watches: tuple[Watch, Watch], results: Results
) -> None:
    nodes, pods = watches
    say(
        "real cluster: a MIG device, a time-sliced replica and an MPS client on every node, then helm upgrade"
    )
    members = [first, *first.members]
    held: dict[str, dict[str, int]] = {}
    names = []
    for node in NODES:
        for limits, image, command in (
            ({MIG[node]: "1"}, images.TOOLBOX, ["sleep", "1000000"]),
            ({"nvidia.com/gpu-ts": "1"}, images.TOOLBOX, ["sleep", "1000000"]),
            ({"nvidia.com/gpu-mps": "1"}, images.agent_image(), ["python3", "-c", MPS_CLIENT]),
        ):
            name = f"work-{len(names)}"
            api.create(PODS, _pod(name, node, limits, image, command))
            names.append(name)
        held[node] = {MIG[node]: 1, "nvidia.com/gpu-ts": 1, "nvidia.com/gpu-mps": 1}
    for name in names:
        pods.wait(name, lambda v: v["running"], 0, 180)
    for member in members:
        deadline = time.monotonic() + 60
        while sum(c for _, c in cluster.mps_daemons(member).values()) != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the MPS client on {member.node_name} did not attach")
            time.sleep(0.1)
    before = {n: _pod_state(api, n) for n in names}
    hardware = {n.node_name: (cluster.mig_instances(n), cluster.mps_daemons(n)) for n in members}
    old = {p["metadata"]["uid"] for p in api.request("GET", AGENTS)["items"]}
    new = cluster.retag(members, "bench-upgrade")
    since = nodes.mark()
    start = time.monotonic()
    cluster.install(helm, new)
    while not _upgraded(api, new, old):
        if time.monotonic() - start > 600:
            raise TimeoutError("the agents were not all replaced within 10 minutes")
        time.sleep(0.2)
    for name, (_, _, offers) in NODES.items():
        nodes.wait(name, lambda v, offers=offers: v == (offers, "success"), since, 300)
    results.add("cluster_upgrade_s", time.monotonic() - start)
    disrupted = sum(_pod_state(api, n) != before[n] or before[n][1] != "Running" for n in names)
    disrupted += sum(
        (cluster.mig_instances(n), cluster.mps_daemons(n)) != hardware[n.node_name] for n in members
    )
    results.add("cluster_upgrade_disrupted_pods", disrupted)
    dips = sum(
        1
        for _, _, name, (offers, _) in nodes.since(since)
        if name in held and any(int(offers.get(r, "0")) < k for r, k in held[name].items())
    )
    results.add("cluster_upgrade_allocatable_dips", dips)
    for name in names:
        api.request("DELETE", f"{PODS}/{name}?gracePeriodSeconds=0")


def _pod(name: str, node: str, limits: dict[str, str], image: str, command: list[str]) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "resources": {"limits": limits},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [container],
        },
    }


def _pod_state(api: Api, name: str) -> tuple[str, str, int]:
    pod = api.request("GET", f"{PODS}/{name}")
    restarts = sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))
    return (pod["metadata"]["uid"], pod["status"]["phase"], restarts)


def _upgraded(api: Api, image: str, old: set[str]) -> bool:
    """Every node's agent on `image` and Ready, none of the `old` pods left."""
    items = api.request("GET", AGENTS)["items"]
    if len(items) != len(NODES) or any(p["metadata"]["uid"] in old for p in items):
        return False
    return all(cluster.runs(p, image) for p in items)
