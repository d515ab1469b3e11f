"""On-demand MIG on a real node (hack/lab, as tests/node brings it up; the one the parts on a real node
share, `bench.labnode.SharedNode`), the chart with dra.enabled.

- ondemand_pod_start_vs_premade_p50: a pod whose claim is allocated an on-demand 1g.5gb device (the
  instance is made at prepare) over a pod whose claim gets a pre-made 1g.5gb, in the same run and on
  the same node (A100 0 carved into 7x 1g.5gb ahead, A100 1 under `mig: dynamic`; the claims pick the
  GPU by `parentUUID`, class mig.nvidia.com). Each sample: the POST of the claim, then of its pod,
  until a pod watch shows it Running and ready; pod and claim gone before the next (for an
  on-demand claim, that is also the instance destroyed at unprepare). One untimed start of each first.
- ondemand_create_share: the share of the on-demand start spent making the instance: (mean
  NodePrepareResources time of the on-demand claims - that of the pre-made ones, from the agent's
  `gpu_sharing_dra_prepare_duration_seconds` histogram) / the on-demand start p50.
- ondemand_pod_start_s_p50: that on-demand start's p50 in seconds, the fake driver's MIG calls
  returning at once; ondemand_pod_start_s_p50_realistic: the same once they take the fake driver's
  assumed latencies (`sharing sim latency --realistic`: 1 s to make an instance, 0.5 s to destroy one;
  hack/fakedriver/README.md, "Latencies"), a series of its own after the others.
- ondemand_idle_claim_requests_per_min: then 30 s with nothing changing, the API server's own count
  of ResourceClaim LIST requests (`apiserver_request_total`, every client: the scheduler's and the
  controller's informers list once and watch, so what moves is the agent's).
"""

from __future__ import annotations

import json
import time
from typing import Any

import lab
from lab.helm import NAMESPACE, lab_values

from bench.clients import CONFIG_LABEL, Api, Watch, pod_view
from bench.dra import FRONTEND_LABEL
from bench.labnode import (
    DRIVER,
    NODE,
    PODS,
    SharedNode,
    pod_body,
    pod_name,
    pool_devices,
    timed_start,
    wait_until,
    watching,
)
from bench.report import Budget, Results, percentile, say
from sharing.gpu import simstate

CONFIG = "bench-ondemand"
MIXED = """version: v1
migStrategy: mixed
gpus:
  - devices: [0]
    mig: {1g.5gb: 7}
  - devices: [1]
    mig: dynamic
  - devices: [2, 3]
    mig: disabled
"""
PREPARE = "gpu_sharing_dra_prepare_duration_seconds"
METRICS = (
    "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9402/metrics').read().decode())"
)


def bench_ondemand(shared: SharedNode, budget: Budget, results: Results) -> None:
    values = lab_values({CONFIG: MIXED}, dra={"enabled": True})
    with shared.chart({CONFIG_LABEL: "all-disabled", FRONTEND_LABEL: "dra"}, values) as (node, api):
        # From whole GPUs: the instances an earlier part's config left on GPU 1 would be adopted by
        # its on-demand claims as they are (made=[]), and nothing would be made at prepare.
        wait_until(lambda: set(_devices(api)) == {f"gpu-{i}" for i in range(4)}, 120, "every GPU whole")
        api.label_node(NODE, {CONFIG_LABEL: CONFIG})
        wait_until(lambda: _ready(api), 240, "pre-made 1g.5gb on GPU 0 and on-demand devices of GPU 1")
        parents = _parents(api)
        with watching(Watch(api, PODS, pod_view)) as pods:
            premade, premade_prep = _series(
                node, api, pods, budget.pod_starts, parent=parents[0], what="pre-made"
            )
            made, made_prep = _series(node, api, pods, budget.pod_starts, parent=parents[1], what="on-demand")
            simstate.set_latencies(node.gpus_state, simstate.REALISTIC_LATENCIES)
            slow, slow_prep = _series(
                node, api, pods, budget.pod_starts, parent=parents[1], what="on-demand, realistic latencies"
            )
            simstate.set_latencies(node.gpus_state, {}, replace=True)
            idle = _idle_claim_requests(node, budget.claim_idle_s)
    results.add("ondemand_idle_claim_requests_per_min", idle)
    ratio = percentile(made, 50) / percentile(premade, 50)
    share = max(0.0, made_prep - premade_prep) / percentile(made, 50)
    results.add("ondemand_pod_start_vs_premade_p50", ratio)
    results.add("ondemand_create_share", share)
    results.add("ondemand_pod_start_s_p50", percentile(made, 50))
    results.add("ondemand_pod_start_s_p50_realistic", percentile(slow, 50))
    results.note(
        "ondemand: pod start p50/p95, on-demand / pre-made 1g.5gb; mean prepare on-demand / pre-made",
        f"{percentile(made, 50):.2f}/{percentile(made, 95):.2f} s / "
        f"{percentile(premade, 50):.2f}/{percentile(premade, 95):.2f} s; "
        f"{made_prep * 1000:.0f} / {premade_prep * 1000:.0f} ms",
    )
    results.note(
        "ondemand: at the realistic latencies, on-demand pod start p50/p95; mean prepare",
        f"{percentile(slow, 50):.2f}/{percentile(slow, 95):.2f} s; {slow_prep * 1000:.0f} ms",
    )


def _claim_lists(node: lab.RealNode) -> float:
    """The API server's count of LIST requests for ResourceClaims so far (every client). WATCH is
    left out: the informers of the scheduler, the controller manager and the agent renew theirs
    every few minutes, which in a short window is noise, not polling."""
    done = node.kubectl("get", "--raw", "/metrics", check=True)
    total = 0.0
    for line in done.stdout.splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="resourceclaims"' in line:
            total += float(line.rsplit(" ", 1)[1]) if 'verb="LIST"' in line else 0.0
    return total


def _idle_claim_requests(node: lab.RealNode, seconds: float) -> float:
    """ResourceClaim LISTs per minute while nothing changes, a dynamic GPU on the node."""
    say(f"ondemand: {seconds:.0f} s with nothing changing, counting the ResourceClaim reads")
    before = _claim_lists(node)
    time.sleep(seconds)
    return (_claim_lists(node) - before) * 60 / seconds


def _devices(api: Api) -> dict[str, dict[str, Any]]:
    return pool_devices(api, NODE)


def _ready(api: Api) -> bool:
    devices = _devices(api)
    premade = [a for a in devices.values() if a.get("profile") == "1g.5gb" and "uuid" in a]
    ondemand = [a for a in devices.values() if a.get("profile") == "1g.5gb" and "placementStart" in a]
    return len(premade) == 7 and len(ondemand) == 7


def _parents(api: Api) -> tuple[str, str]:
    """(the pre-made 1g.5gb devices' GPU UUID, the on-demand ones' GPU UUID)."""
    devices = [a for a in _devices(api).values() if a.get("profile") == "1g.5gb"]
    premade = next(str(a["parentUUID"]) for a in devices if "uuid" in a)
    ondemand = next(str(a["parentUUID"]) for a in devices if "placementStart" in a)
    return premade, ondemand


def _claim(name: str, parent: str) -> dict[str, Any]:
    cel = (
        f"device.attributes['{DRIVER}'].profile == '1g.5gb' && "
        f"device.attributes['{DRIVER}'].parentUUID == '{parent}'"
    )
    exactly = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": cel}}]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": exactly}]}},
    }


def _prepare_totals(node: lab.RealNode) -> tuple[float, float]:
    """(sum, count) of the agent's prepare-time histogram, over its profiles."""
    done = node.kubectl("-n", NAMESPACE, "exec", "ds/gpu-sharing", "--", "python3", "-c", METRICS, check=True)
    totals = {"_sum": 0.0, "_count": 0.0}
    for line in done.stdout.splitlines():
        name, _, value = line.partition(" ")
        for suffix in totals:
            if name.startswith(f"{PREPARE}{suffix}{{"):
                totals[suffix] += float(value)
    return totals["_sum"], totals["_count"]


def _start(api: Api, pods: Watch, parent: str) -> float:
    name = pod_name()
    return timed_start(api, pods, pod_body(name, claim=name), _claim(name, parent))


def _series(
    node: lab.RealNode, api: Api, pods: Watch, count: int, *, parent: str, what: str
) -> tuple[list[float], float]:
    """`count` timed starts on the GPU `parent`, and the mean prepare time over them."""
    say(f"ondemand: {count} pods with a {what} 1g.5gb")
    _start(api, pods, parent)
    time.sleep(1.1)  # /metrics renders at most once a second: the untimed start out of the totals
    before = _prepare_totals(node)
    took = [_start(api, pods, parent) for _ in range(count)]
    time.sleep(1.1)
    after = _prepare_totals(node)
    calls = after[1] - before[1]
    mean = (after[0] - before[0]) / calls if calls else 0.0
    say(f"ondemand: {what}: {json.dumps([round(t, 3) for t in took])}")
    return took, mean
