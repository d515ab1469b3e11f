"""A real node (hack/lab: containerd, kubelet, scheduler, controller-manager, kube-proxy in private
namespaces, as tests/node brings it up), with the agent installed by its Helm chart as a DaemonSet
pod on the fake driver's GPUs (2x A100-SXM4-40GB + 2x H100 80GB HBM3).

- pod_start_vs_plain_p50: pod creation (the POST, from this process) until a pod watch shows it
  Running with its container ready, for a pod asking `nvidia.com/mig-1g.5gb: 1` over the same pod
  asking for nothing (busybox `sleep`); the two alternate, the order swapped every pair, after one
  untimed pair; each pod is deleted (grace 0) and gone before the next.
- label_to_allocatable_s_p95: label patch switching the node between two configs until a Node watch
  shows status.allocatable with the expected counts of the new config (computed from the config and
  the catalog); the time until the agent's labels say `success` for it is shown beside it, so the
  kubelet's part (its node status loop, `nodeStatusUpdateFrequency` 2 s in hack/lab) can be told
  from the agent's.

The node is the one the parts on a real node share (`bench.labnode.SharedNode`), this part the first
on it; node_stop_s is timed when the last of them takes it down.
"""

from __future__ import annotations

import contextlib
import time

from lab.helm import lab_values

from bench.clients import CONFIG_LABEL, Api, Watch, node_view, pod_view
from bench.expect import allocatable_match, expected_inventory, expected_labels, labels_match
from bench.labnode import NODE, PODS, SharedNode, pod_body, pod_name, timed_start, watching
from bench.report import Budget, Results, percentile, say
from sharing.config import parse_configmap
from sharing.mig.catalog import default_catalog

GPUS = ["A100-SXM4-40GB", "A100-SXM4-40GB", "H100-80GB-HBM3", "H100-80GB-HBM3"]
# Two configs with different allocatable, both with mig-1g.5gb (the device pods ask for one).
CONFIGS = {
    "bench-kinds": """version: v1
migStrategy: mixed
sharing:
  renameByDefault: true
gpus:
  - devices: [2]
    mig: disabled
  - devices: [3]
    mig: disabled
    replicas: 4
  - devices: {product: A100-SXM4-40GB}
    mig: {1g.5gb: 2, 2g.10gb: 1, 3g.20gb: 1}
    replicas: {2g.10gb: 2}
""",
    "bench-small": """version: v1
migStrategy: mixed
gpus:
  - devices: {product: A100-SXM4-40GB}
    mig: {1g.5gb: 7}
  - devices: all
    mig: disabled
    replicas: 2
""",
}


def bench_real_node(shared: SharedNode, budget: Budget, results: Results) -> None:
    start = time.monotonic()
    first = next(iter(CONFIGS))
    inventories = {name: _expected(name, text) for name, text in CONFIGS.items()}
    with contextlib.ExitStack() as stack:
        _, api = stack.enter_context(shared.chart({CONFIG_LABEL: first}, lab_values(CONFIGS)))
        nodes = stack.enter_context(watching(Watch(api, "/api/v1/nodes", node_view, f"metadata.name={NODE}")))
        pods = stack.enter_context(watching(Watch(api, PODS, pod_view)))
        nodes.wait(NODE, allocatable_match(inventories[first]), 0, 180)
        took = time.monotonic() - start
        results.note("real node: up, chart installed, slices allocatable", f"{took:.0f} s")
        _pod_starts(api, pods, budget, results)
        _label_changes(api, nodes, inventories, budget, results)


def _expected(name: str, text: str) -> dict[str, tuple[int, int, int]]:
    catalog = default_catalog()
    config = parse_configmap({name: text}, products=GPUS, catalog=catalog).get(name)
    assert config is not None, name
    return expected_inventory(config, GPUS, catalog)


def _start_pod(api: Api, pods: Watch, limits: dict[str, str]) -> float:
    """Seconds from the POST to Running and ready; the pod is deleted and gone before this returns."""
    return timed_start(api, pods, pod_body(pod_name(), limits=limits))


def _pod_starts(api: Api, pods: Watch, budget: Budget, results: Results) -> None:
    say(
        f"real node: {budget.pod_starts} pods asking nvidia.com/mig-1g.5gb: 1 and as many asking nothing, "
        "alternating"
    )
    device, plain = {"nvidia.com/mig-1g.5gb": "1"}, {}
    _start_pod(api, pods, device)
    _start_pod(api, pods, plain)
    with_device, without = [], []
    for i in range(budget.pod_starts):
        order = (
            [(device, with_device), (plain, without)] if i % 2 else [(plain, without), (device, with_device)]
        )
        for limits, samples in order:
            samples.append(_start_pod(api, pods, limits))
    results.add("pod_start_vs_plain_p50", percentile(with_device, 50) / percentile(without, 50))
    results.note(
        "real node: pod start p50/p95 with a MIG device / without",
        f"{percentile(with_device, 50):.2f}/{percentile(with_device, 95):.2f} s / "
        f"{percentile(without, 50):.2f}/{percentile(without, 95):.2f} s",
    )


def _label_changes(
    api: Api,
    nodes: Watch,
    inventories: dict[str, dict[str, tuple[int, int, int]]],
    budget: Budget,
    results: Results,
) -> None:
    say(f"real node: {budget.label_changes} label changes between {' and '.join(inventories)}")
    names = list(inventories)
    to_allocatable, to_labels = [], []
    for i in range(budget.label_changes):
        name = names[(i + 1) % len(names)]
        inventory = inventories[name]
        since = nodes.mark()
        start = time.monotonic()
        api.label_node(NODE, {CONFIG_LABEL: name})
        done = nodes.wait(NODE, labels_match(expected_labels(inventory), name), since, 90)
        allocatable = nodes.wait(NODE, allocatable_match(inventory), since, 90)
        to_labels.append(done - start)
        to_allocatable.append(allocatable - start)
    results.add("label_to_allocatable_s_p95", percentile(to_allocatable, 95))
    gaps = [a - b for a, b in zip(to_allocatable, to_labels, strict=True)]
    results.note(
        "real node: label change -> agent says success p50/p95; -> allocatable p50/p95; "
        "the kubelet's share p50/max",
        f"{percentile(to_labels, 50):.2f}/{percentile(to_labels, 95):.2f} s; "
        f"{percentile(to_allocatable, 50):.2f}/{percentile(to_allocatable, 95):.2f} s; "
        f"{percentile(gaps, 50):.2f}/{max(gaps):.2f} s",
    )
