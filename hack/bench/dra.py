"""The DRA front-end on a real node (hack/lab, as tests/node brings it up; the one the parts on a real
node share, `bench.labnode.SharedNode`), the chart with dra.enabled.

- dra_pod_start_vs_deviceplugin_p50: a MIG device for a pod through DRA (the POST of a ResourceClaim
  of class mig.nvidia.com with a CEL selector on profile 1g.5gb, then of its pod, until a pod watch
  shows it Running and ready) over the same pod asking `nvidia.com/mig-1g.5gb: 1` through the device
  plugins, in the same run and on the same node: first the device-plugin samples, then the node is
  switched to DRA (its label) and the DRA samples are taken; one untimed start on each front-end
  first; each pod (and claim) is deleted and gone before the next.
- resourceslice_update_s_p95: label patch switching the DRA node between two configs until the pool's
  ResourceSlices (listed every 50 ms) name exactly the devices of the new config.
- dra_agent_rss_mb: the agent's resident memory (VmRSS of PID 1 in its container) once serving DRA.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from lab.helm import NAMESPACE, lab_values

from bench.clients import CONFIG_LABEL, Api, Watch, pod_view
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
from bench.realnode import CONFIGS
from bench.report import Budget, Results, percentile, say

FRONTEND_LABEL = "nvidia.com/gpu-sharing.frontend"
# The pool's device names per config (replicas are shares of one device, not devices).
POOLS = {
    "bench-kinds": {*(f"gpu-{g}-mig-{m}" for g in (0, 1) for m in range(4)), "gpu-2", "gpu-3"},
    "bench-small": {*(f"gpu-{g}-mig-{m}" for g in (0, 1) for m in range(7)), "gpu-2", "gpu-3"},
}
CEL = f"device.attributes['{DRIVER}'].profile == '1g.5gb'"


def bench_dra(shared: SharedNode, budget: Budget, results: Results) -> None:
    first = next(iter(CONFIGS))
    values = lab_values(CONFIGS, dra={"enabled": True})
    with shared.chart({CONFIG_LABEL: first}, values) as (node, api), contextlib.ExitStack() as stack:
        pods = stack.enter_context(watching(Watch(api, PODS, pod_view)))
        wait_until(lambda: _allocatable(api).get("nvidia.com/mig-1g.5gb") == "4", 180, "device plugins")
        plugin = _starts(api, pods, budget.pod_starts, dra=False)
        api.label_node(NODE, {FRONTEND_LABEL: "dra"})
        wait_until(lambda: _pool(api) == POOLS[first], 120, "the pool's slices")
        dra = _starts(api, pods, budget.pod_starts, dra=True)
        results.add("dra_pod_start_vs_deviceplugin_p50", percentile(dra, 50) / percentile(plugin, 50))
        results.note(
            "dra: pod start p50/p95 with a MIG device through a claim / through the device plugins",
            f"{percentile(dra, 50):.2f}/{percentile(dra, 95):.2f} s / "
            f"{percentile(plugin, 50):.2f}/{percentile(plugin, 95):.2f} s",
        )
        _slice_updates(api, budget.label_changes, results)
        rss = node.kubectl(
            "-n", NAMESPACE, "exec", "ds/gpu-sharing", "--", "cat", "/proc/1/status", check=True
        )  # fmt: skip
        kb = next(int(line.split()[1]) for line in rss.stdout.splitlines() if line.startswith("VmRSS:"))
        results.add("dra_agent_rss_mb", kb / 1024)


def _allocatable(api: Api) -> dict[str, str]:
    return dict(api.request("GET", f"/api/v1/nodes/{NODE}")["status"].get("allocatable", {}))


def _pool(api: Api) -> set[str]:
    return set(pool_devices(api, NODE))


def _claim(name: str) -> dict[str, Any]:
    exactly = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": CEL}}]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": exactly}]}},
    }


def _start(api: Api, pods: Watch, *, dra: bool) -> float:
    """Seconds from the first POST to Running and ready; pod and claim gone before this returns."""
    name = pod_name()
    if dra:
        return timed_start(api, pods, pod_body(name, claim=name), _claim(name))
    return timed_start(api, pods, pod_body(name, limits={"nvidia.com/mig-1g.5gb": "1"}))


def _starts(api: Api, pods: Watch, count: int, *, dra: bool) -> list[float]:
    say(f"dra: {count} pods with a MIG device through {'a claim' if dra else 'the device plugins'}")
    _start(api, pods, dra=dra)
    return [_start(api, pods, dra=dra) for _ in range(count)]


def _slice_updates(api: Api, count: int, results: Results) -> None:
    say(f"dra: {count} label changes between {' and '.join(POOLS)}, until the slices follow")
    names = list(POOLS)
    took = []
    for i in range(count):
        name = names[(i + 1) % len(names)]
        start = time.monotonic()
        api.label_node(NODE, {CONFIG_LABEL: name})
        wait_until(lambda name=name: _pool(api) == POOLS[name], 90, f"the slices of {name}")
        took.append(time.monotonic() - start)
    results.add("resourceslice_update_s_p95", percentile(took, 95))
    results.note(
        "dra: label change -> the pool's ResourceSlices p50/p95",
        f"{percentile(took, 50):.2f}/{percentile(took, 95):.2f} s",
    )
