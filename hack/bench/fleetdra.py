"""The fleet on DRA: N nodes of the fleet (`bench.fleet`) with every A100 under `mig: dynamic` on the
DRA front-end, one kube-apiserver, and a storm of ResourceClaims on pools of nodes outside the fleet.

While a node has a dynamic GPU its agent watches every ResourceClaim of the cluster (no field
selector reaches into a claim's allocation), so each change of any claim reaches every agent. The
bench stands in for the kube-scheduler: it creates each claim (pending: ADDED), then writes its
`status.allocation` through the status subresource with a device of the pool of a node that is not
in the fleet (MODIFIED), as the scheduler's allocation would; then it reserves the claim for a pod
(MODIFIED) and deletes it (DELETED). Claims are spread evenly over the storm's two halves:

- fleet_dra_claim_event_us_p95: in the second half, every event is of a claim allocated on another
  node's pool (reserved, then deleted): each agent's CPU (all its threads) in that half, less its
  idle CPU over as long (measured before the storm), over the claim events it received, p95 over
  agents, in microseconds. The events are counted on the bench's
  own watch of every claim, which the API server sends the same changes as every agent's.
- fleet_dra_pending_claim_event_us_p50: the same for the first half, where each claim is pending
  and then allocated: events the pool acts on (a pending claim of a MIG class is checked against
  the dynamic GPUs' free placements, `sharing.dra.fragmentation`).
- fleet_dra_apiserver_us_per_claim_event: the kube-apiserver's CPU over the whole storm (its idle
  CPU taken off likewise) per claim event it delivered (events x watchers: the agents and the
  bench), its handling of the writes included.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import lab

from bench.clients import NAMESPACE as NAMESPACE_AGENT
from bench.clients import Api, Watch, node_view
from bench.cluster import AGENT_USER, NODE_CLAIM, audited_control_plane, deploy
from bench.fleet import Fleet, Node, _state_dir
from bench.procs import REPO, cpu_seconds
from bench.report import Budget, Results, percentile, say

KEY = "fleet-dra"
DYNAMIC = "version: v1\nmigStrategy: mixed\ngpus:\n  - devices: all\n    mig: dynamic\n"
DRIVER = "gpu.nvidia.com"
NAMESPACE = "default"
CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
CHART = REPO / "deploy/helm/gpu-sharing"
OTHER_POOLS = 1000
"""Claims are allocated round-robin on the pools of this many nodes outside the fleet."""
WATCHING_TIMEOUT_S = 600.0
IDLE_S = 15.0
"""The window before the storm that each process's idle CPU is measured in (at most half the storm)."""


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
        _wait_watching(fleet, audit_log)
        claims = Watch(api, CLAIMS, _claim_view).start()
        stack.callback(claims.stop)
        time.sleep(2)  # the bench's own watch is open before the storm
        _storm(fleet, claims, budget.fleet_dra_claims, budget.fleet_dra_storm_s, results)
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


def _claim_view(obj: dict[str, Any]) -> dict[str, Any]:
    return {}


def _wait_watching(fleet: Fleet, audit_log: Path) -> None:
    """Until every agent has opened its watch of the ResourceClaims (the audit log says so)."""
    say(f"fleetdra: until all {len(fleet.nodes)} agents watch the ResourceClaims")
    wanted = {node.name for node in fleet.nodes}
    deadline = time.monotonic() + WATCHING_TIMEOUT_S
    while (missing := wanted - _claim_watchers(audit_log)) and time.monotonic() < deadline:
        for node in fleet.nodes:
            if node.agent is not None and node.agent.poll() is not None:
                raise RuntimeError(f"the agent of {node.name} exited; see {node.driver.with_suffix('.log')}")
        time.sleep(1)
    if missing:
        raise TimeoutError(f"{len(missing)} agents do not watch the ResourceClaims: {sorted(missing)[:3]}")


def _claim_watchers(audit_log: Path) -> set[str]:
    """The nodes whose agent opened a watch of the ResourceClaims."""
    found: set[str] = set()
    with audit_log.open() as log:
        for line in log:
            if '"resourceclaims"' not in line or '"watch"' not in line:
                continue
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                user = event.get("user", {})
                if user.get("username") == AGENT_USER and event.get("verb") == "watch":
                    found.add((user.get("extra", {}).get(NODE_CLAIM) or [""])[0])
    return found


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


def _storm(fleet: Fleet, claims: Watch, count: int, seconds: float, results: Results) -> None:
    api, n = fleet.api, len(fleet.nodes)
    agents = fleet.groups()["agents"]
    server = fleet.groups()["kube-apiserver"][0]
    names = [f"storm-{i:05d}" for i in range(count)]
    allocated: dict[int, dict[str, Any]] = {}

    def allocate(i: int) -> None:
        claim = api.create(
            f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims", _claim(names[i])
        )
        claim["status"] = {"allocation": _allocation(i)}
        allocated[i] = api.request("PUT", _path(names[i], status=True), claim, merge=False)

    def release(i: int) -> None:
        claim = allocated.pop(i)
        pod = {"resource": "pods", "name": f"pod-{i}", "uid": f"00000000-0000-0000-0000-{i:012d}"}
        claim["status"]["reservedFor"] = [pod]
        api.request("PUT", _path(names[i], status=True), claim, merge=False)
        api.request("DELETE", _path(names[i]))

    idle = _idle_rates([*agents, server], min(seconds / 2, IDLE_S))
    server_before, storm_start = cpu_seconds(server), time.monotonic()
    marks, per_event = [], []
    for what, step in (("pending, then allocated elsewhere", allocate), ("reserved, then deleted", release)):
        say(f"fleetdra: {count} claims {what} over {seconds / 2:.0f} s, {n} agents watching")
        before = [cpu_seconds(p) for p in agents]
        mark, start = claims.mark(), time.monotonic()
        _paced(count, seconds / 2, step)
        time.sleep(2)  # the last events reach every agent
        events, took = claims.mark() - mark, time.monotonic() - start
        used = [cpu_seconds(p) - b - rate * took for p, b, rate in zip(agents, before, idle, strict=False)]
        per_event.append([1e6 * max(0.0, u) / max(events, 1) for u in used])
        marks.append(events)
    server_used = max(0.0, cpu_seconds(server) - server_before - idle[-1] * (time.monotonic() - storm_start))
    pending, foreign = per_event
    delivered = sum(marks) * (n + 1)
    results.add("fleet_dra_claim_event_us_p95", percentile(foreign, 95))
    results.add("fleet_dra_pending_claim_event_us_p50", percentile(pending, 50))
    results.add("fleet_dra_apiserver_us_per_claim_event", 1e6 * server_used / max(delivered, 1))
    results.note(
        "fleetdra: agent CPU per claim event p50/p95, claims on another node's pool / pending then allocated",
        f"{percentile(foreign, 50):.0f}/{percentile(foreign, 95):.0f} us / "
        f"{percentile(pending, 50):.0f}/{percentile(pending, 95):.0f} us ({marks[1]} / {marks[0]} events)",
    )
    results.note(
        "fleetdra: kube-apiserver CPU over the storm; per change, per event delivered to a watcher",
        f"{server_used:.1f} s; {1e6 * server_used / max(sum(marks), 1):.0f} us, "
        f"{1e6 * server_used / max(delivered, 1):.0f} us ({n} agents + the bench watching)",
    )
