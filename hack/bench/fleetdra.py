"""The fleet on DRA: N nodes of the fleet (`bench.fleet`) with every A100 under `mig: dynamic` on the
DRA front-end, one kube-apiserver, a storm of ResourceClaims on pools of nodes outside the fleet, and
a claim prepared on every node of the fleet.

No agent lists or watches ResourceClaims (they read a claim by name when the kubelet prepares it, and
the claims their node's pods name before a change destroys devices of their pool), so another node's
claims cost them nothing and the API server nothing per agent. The bench stands in for the
kube-scheduler: it creates each claim (pending), writes its `status.allocation` through the status
subresource with a device of the pool of a node that is not in the fleet, as the scheduler's
allocation would, then reserves the claim for a pod and deletes it: four changes per claim. Every
agent is registered first by the kubelet's own DRA code (hack/go/k8s/dra-kubelet: the plugin
watcher's registration). Then, per node, the bench stands in for the kubelet's DRA client: a claim
allocated an on-demand 1g.5gb of that node's pool is prepared (NodePrepareResources on the plugin's
socket, as the kubelet calls it) and unprepared.

- fleet_dra_apiserver_us_per_claim: the kube-apiserver's CPU over the storm (its idle CPU taken off)
  per claim change. With nobody watching the claims it does not grow with the number of agents:
  compare the runs of 10 and 30 agents (`--fleet N`).
- fleet_dra_agent_cpu_per_foreign_claim_us: each agent's CPU over the storm less its idle CPU over as
  long (measured before the storm), per claim change, p95 over agents: about nothing.
- fleet_dra_requests_per_prepare: the API requests an agent sends from the start of a prepare until
  it has re-published its pool after it (the audit log, by the agent's ServiceAccount and node):
  mean over the nodes; `..._claim_reads_per_prepare` of those, the GETs of ResourceClaims (the rest
  are the pool's ResourceSlice writes: its order follows what is prepared).
- fleet_dra_agent_claim_lists: LISTs and WATCHes of ResourceClaims by any agent over the whole run
  (the chart's RBAC forbids them; a refused one counts too).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import lab

from bench.clients import NAMESPACE as NAMESPACE_AGENT
from bench.clients import Api, Watch, node_view
from bench.cluster import AGENT_USER, NODE_CLAIM, audited_control_plane, deploy
from bench.fleet import Fleet, Node, _state_dir
from bench.procs import REPO, cpu_seconds
from bench.report import Budget, Results, percentile, say
from sharing.kubelet.api import dra_v1_pb2 as dra
from sharing.kubelet.api import dra_v1_pb2_grpc as dra_grpc

KEY = "fleet-dra"
DYNAMIC = "version: v1\nmigStrategy: mixed\ngpus:\n  - devices: all\n    mig: dynamic\n"
DRIVER = "gpu.nvidia.com"
NAMESPACE = "default"
CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
CHART = REPO / "deploy/helm/gpu-sharing"
OTHER_POOLS = 1000
"""Claims are allocated round-robin on the pools of this many nodes outside the fleet."""
POOL_TIMEOUT_S = 600.0
CHANGES_PER_CLAIM = 4
"""Created, allocated, reserved, deleted."""
PREPARED_DEVICE = "gpu-0-mig-1g-5gb-at-0"


def bench_fleet_dra(n: int, budget: Budget, results: Results) -> None:
    bins = lab.binaries()
    root = _state_dir()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        cp, audit_log = audited_control_plane(root, bins)
        stack.enter_context(cp)
        api = Api(cp.server, cp.dir)
        stack.callback(api.close)
        deploy(cp, {KEY: DYNAMIC})
        _dra_rbac(cp, bins)
        nodes = Watch(api, "/api/v1/nodes", node_view).start()
        stack.callback(nodes.stop)
        fleet = Fleet(cp, api, nodes, audit_log, results)
        stack.callback(fleet.stop)
        say(f"fleetdra: {n} nodes, every A100 under mig: dynamic on the DRA front-end")
        fleet.add_nodes(root, n, bins, config=KEY)
        fleet.start_agents(_dra_flags)
        _register(fleet, cp, bins)
        _storm(fleet, budget.fleet_dra_claims, budget.fleet_dra_storm_s, results)
        _prepares(fleet, audit_log, results)
        results.add("fleet_dra_agent_claim_lists", _claim_lists(audit_log))
        say("fleetdra: stopping")


def _dra_rbac(cp: lab.ControlPlane, bins: lab.Binaries) -> None:
    """What the chart adds with dra.enabled to deploy/'s RBAC and admission policy (same names)."""
    rendered = subprocess.run(
        [str(bins.helm), "template", "x", str(CHART), "--namespace", NAMESPACE_AGENT,
         "--set", "dra.enabled=true", "--set", "fullnameOverride=gpu-sharing",
         "--show-only", "templates/rbac.yaml",
         "--show-only", "templates/admission-policy.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=rendered, check=True)


def _dra_flags(node: Node) -> list[str]:
    """The DRA front-end on every node, its sockets and checkpoint in the node's own directories."""
    base = node.driver.parent
    return [
        "--frontend", "dra",
        "--kubelet-plugins-dir", str(base / "plugins"),
        "--kubelet-registry-dir", str(base / "plugins_registry"),
        "--mps-root", str(base / "mps"),
    ]  # fmt: skip


def _dra_kubelet(cp: lab.ControlPlane, bins: lab.Binaries, node: Node, *args: str) -> dict[str, Any]:
    """One run of the kubelet's DRA side against the node's agent (a fresh kubelet each time)."""
    done = subprocess.run(
        [str(bins.dra_kubelet), "--registry-dir", str(node.driver.parent / "plugins_registry"),
         "--kubeconfig", str(cp.kubeconfig), "--node", node.name, "--driver", DRIVER, *args],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"dra-kubelet for {node.name}: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout))


def _register(fleet: Fleet, cp: lab.ControlPlane, bins: lab.Binaries) -> None:
    """Every agent registered with a kubelet (its DRA part) and its pool on the API server."""
    say(f"fleetdra: registering {len(fleet.nodes)} DRA plugins, until every pool is published")
    deadline = time.monotonic() + POOL_TIMEOUT_S
    for node in fleet.nodes:
        while not list((node.driver.parent / "plugins_registry").glob("*.sock")):
            if node.agent is not None and node.agent.poll() is not None:
                raise RuntimeError(f"the agent of {node.name} exited; see {node.driver.with_suffix('.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent of {node.name} serves no DRA registration socket")
            time.sleep(0.2)  # polling a directory the agent makes, with a deadline
        _dra_kubelet(cp, bins, node)
    for node in fleet.nodes:
        while PREPARED_DEVICE not in _pool(fleet.api, node.name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pool of {node.name} was not published")
            time.sleep(0.2)  # polling the API server, with a deadline


def _pool(api: Api, node: str) -> set[str]:
    """The device names of the node's pool, as the API server holds them."""
    query = f"fieldSelector=spec.nodeName={node},spec.driver={DRIVER}"
    listed = api.request("GET", f"/apis/resource.k8s.io/v1/resourceslices?{query}")
    return {d["name"] for s in listed.get("items", []) for d in s["spec"].get("devices") or []}


def _claim(name: str) -> dict[str, Any]:
    """A claim for a 1g.5gb MIG device through its per-profile class, as a pod's template makes it."""
    exactly = {"deviceClassName": "mig-1g.5gb.nvidia.com"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def _allocation(index: int) -> dict[str, Any]:
    """An allocation on the pool of a node outside the fleet, as the scheduler writes it."""
    pool = f"elsewhere-{index % OTHER_POOLS:04d}"
    selector = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}
    result = {"request": "gpu", "driver": DRIVER, "pool": pool, "device": f"gpu-{index % 8}-mig-1g-5gb-0"}
    return {"devices": {"results": [result]}, "nodeSelector": {"nodeSelectorTerms": [selector]}}


def _path(name: str, status: bool = False) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{name}" + (
        "/status" if status else ""
    )


def _paced(count: int, seconds: float, step: Any) -> None:
    """`step(i)` for i in 0..count-1, spread evenly over `seconds` (as fast as it goes when behind)."""
    start = time.monotonic()
    for i in range(count):
        ahead = start + i * seconds / count - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
        step(i)


def _idle_rates(pids: list[int], seconds: float) -> list[float]:
    """CPU seconds per second each process uses with no claim changing (its timers, its watches'
    renewals): taken off its CPU in the storm, which is what the claim events cost."""
    before = [cpu_seconds(p) for p in pids]
    time.sleep(seconds)
    return [(cpu_seconds(p) - b) / seconds for p, b in zip(pids, before, strict=True)]


def _storm(fleet: Fleet, count: int, seconds: float, results: Results) -> None:
    api, n = fleet.api, len(fleet.nodes)
    agents = fleet.groups()["agents"]
    server = fleet.groups()["kube-apiserver"][0]
    names = [f"storm-{i:05d}" for i in range(count)]
    allocated: dict[int, dict[str, Any]] = {}

    def allocate(i: int) -> None:
        claim = api.create(
            CLAIMS.replace("/resourceclaims", f"/namespaces/{NAMESPACE}/resourceclaims"), _claim(names[i])
        )
        claim["status"] = {"allocation": _allocation(i)}
        allocated[i] = api.request("PUT", _path(names[i], status=True), claim, merge=False)

    def release(i: int) -> None:
        claim = allocated.pop(i)
        pod = {"resource": "pods", "name": f"pod-{i}", "uid": f"00000000-0000-0000-0000-{i:012d}"}
        claim["status"]["reservedFor"] = [pod]
        api.request("PUT", _path(names[i], status=True), claim, merge=False)
        api.request("DELETE", _path(names[i]))

    # As long as the storm: CPU is read in clock ticks (10 ms), and a shorter window scaled up
    # scales their rounding too (a 15 s window: one tick is 10 us per change of 4,000).
    idle = _idle_rates([*agents, server], seconds)
    server_before, agents_before, start = (
        cpu_seconds(server),
        [cpu_seconds(p) for p in agents],
        time.monotonic(),
    )
    for what, step in (("pending, then allocated elsewhere", allocate), ("reserved, then deleted", release)):
        say(f"fleetdra: {count} claims {what} over {seconds / 2:.0f} s, {n} agents serving")
        _paced(count, seconds / 2, step)
    took = time.monotonic() - start
    changes = count * CHANGES_PER_CLAIM
    server_used = max(0.0, cpu_seconds(server) - server_before - idle[-1] * took)
    used = [
        max(0.0, cpu_seconds(p) - b - rate * took)
        for p, b, rate in zip(agents, agents_before, idle, strict=False)
    ]
    per_change = [1e6 * u / changes for u in used]
    results.add("fleet_dra_apiserver_us_per_claim", 1e6 * server_used / changes)
    results.add("fleet_dra_agent_cpu_per_foreign_claim_us", percentile(per_change, 95))
    results.note(
        f"fleetdra: {n} agents, {changes} claim changes on other nodes' pools over {took:.0f} s",
        f"kube-apiserver {server_used:.2f} CPU-s ({1e6 * server_used / changes:.0f} us per change); "
        f"agent CPU beyond idle per change p50/p95 {percentile(per_change, 50):.1f}/"
        f"{percentile(per_change, 95):.1f} us",
    )


def _prepares(fleet: Fleet, audit_log: Path, results: Results) -> None:
    """Per node, a claim allocated an on-demand 1g.5gb of its pool prepared through the plugin's socket;
    the agent's requests from the prepare's start until its pool was re-published, by the audit log."""
    say(f"fleetdra: a claim prepared on each of the {len(fleet.nodes)} nodes")
    requests, reads = [], []
    kinds: Counter[tuple[str, str]] = Counter()
    for node in fleet.nodes:
        name = f"prep-{node.name}"
        claim = fleet.api.create(
            f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims", _claim(name)
        )
        selector = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node.name]}]}
        result = {"request": "gpu", "driver": DRIVER, "pool": node.name, "device": PREPARED_DEVICE}
        pod = {"resource": "pods", "name": f"pod-{node.name}", "uid": str(uuid.uuid4())}
        claim["status"] = {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {"nodeSelectorTerms": [selector]},
            },
            "reservedFor": [pod],
        }
        claim = fleet.api.request("PUT", _path(name, status=True), claim, merge=False)
        key = dra.Claim(namespace=NAMESPACE, name=name, uid=claim["metadata"]["uid"])
        before = set(_pool(fleet.api, node.name))
        started = time.time()
        answer = _plugin(node).NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[key]), timeout=60)
        errors = [r.error for r in answer.claims.values() if r.error]
        if errors:
            raise RuntimeError(f"prepare on {node.name}: {errors}")
        deadline = time.monotonic() + 60
        while _pool(fleet.api, node.name) == before and time.monotonic() < deadline:
            time.sleep(0.1)  # until the agent re-published its pool for the instance
        time.sleep(1)  # what the audit log records within its flush
        counted = _requests(audit_log, node.name, started, time.time())
        requests.append(len(counted))
        kinds.update(counted)
        reads.append(sum(1 for verb, resource in counted if resource == "resourceclaims" and verb == "get"))
        _plugin(node).NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=[key]), timeout=60)
        fleet.api.request("DELETE", _path(name))
    mean = sum(requests) / max(len(requests), 1)
    results.add("fleet_dra_requests_per_prepare", mean)
    results.add("fleet_dra_claim_reads_per_prepare", sum(reads) / max(len(reads), 1))
    results.note(
        "fleetdra: an agent's API requests per claim prepared on its node (the kubelet's own apart)",
        f"mean {mean:.1f} (min {min(requests)}, max {max(requests)}): "
        + ", ".join(f"{verb} {what} {n / len(requests):.1f}" for (verb, what), n in sorted(kinds.items())),
    )


def _plugin(node: Node) -> dra_grpc.DRAPluginStub:
    """The node's DRA plugin as the kubelet's DRA client dials it (its socket under the plugins dir)."""
    (socket,) = (node.driver.parent / "plugins" / DRIVER).glob("*.sock")
    return dra_grpc.DRAPluginStub(grpc.insecure_channel(f"unix://{socket}"))


def _requests(audit_log: Path, node: str, start: float, end: float) -> list[tuple[str, str]]:
    """(verb, resource) of each request the agent of `node` sent in [start, end), by audit ID."""
    seen: dict[str, tuple[str, str]] = {}
    for event in _agent_events(audit_log):
        if (event["user"].get("extra", {}).get(NODE_CLAIM) or [""])[0] != node:
            continue
        received = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
        if start <= received < end:
            seen[event["auditID"]] = (event.get("verb", ""), event.get("objectRef", {}).get("resource", ""))
    return list(seen.values())


def _claim_lists(audit_log: Path) -> int:
    """LISTs and WATCHes of ResourceClaims any agent sent (allowed or not), by audit ID."""
    return len({
        e["auditID"]
        for e in _agent_events(audit_log)
        if e.get("objectRef", {}).get("resource") == "resourceclaims" and e.get("verb") in ("list", "watch")
    })  # fmt: skip


def _agent_events(audit_log: Path) -> list[dict[str, Any]]:
    events = []
    with audit_log.open() as log:
        for line in log:
            if AGENT_USER not in line:
                continue
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("user", {}).get("username") == AGENT_USER:
                    events.append(event)
    return events
