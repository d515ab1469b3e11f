"""The reconcile loop through real parts: agent start, label change, ConfigMap edit.

- startup_s: agent process start (node already labelled, GPUs already partitioned, as after a pod
  restart) until the harness has every expected resource allocatable.
- reconcile_s_*: label patch (sent by this process) until (a) the harness's /resources long-poll
  shows exactly the expected device counts (computed from the config and the catalog, not by
  asking the agent) and (b) a Node watch shows state `success`, the expected MIG count labels and
  the agent's annotation naming the config. The larger of (a) and (b) is the figure. (a) is read at
  the harness, so its Node-status copy does not count; the harness samples its device manager every
  10 ms here, which bounds the resolution.
- configmap_s_p50: ConfigMap patch (replicas 2 <-> 3 in a bench key) until (a).
"""

from __future__ import annotations

import statistics
import time

from bench.clients import CONFIG_LABEL
from bench.cluster import NODE, Cluster
from bench.expect import expected_inventory, nothing_allocatable, replicas_config, resources_match
from bench.report import Budget, Results, percentile, say
from sharing.config import parse_config

GPUS_4 = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"
PRESETS = ("a100-mig-h100-time-sliced", "all-1g", "all-balanced", "all-replicas-4", "all-3g")
REPLICAS_KEY = "bench-replicas"


def bench_startup_and_reconcile(env: Cluster, budget: Budget, results: Results) -> None:
    env.sim_init(GPUS_4)
    first = PRESETS[0]
    env.api.label_node(NODE, {CONFIG_LABEL: first})
    inventory = env.expect(first)
    ready = resources_match(inventory)
    say(f"agent on {GPUS_4}, node labelled {first}: first start (MIG carved from scratch)")
    start = time.monotonic()
    env.start_agent()
    env.wait_resources(ready, 120)
    results.note("first start incl. partitioning 4 GPUs (single run)", f"{time.monotonic() - start:.2f} s")
    env.wait_labels(first, inventory, 0, 60)

    say(f"startup: {budget.startup_runs} restarts of the agent on a partitioned, labelled node")
    for _ in range(budget.startup_runs):
        env.stop_agent()
        env.wait_resources(nothing_allocatable(list(inventory)), 30)
        start = time.monotonic()
        env.start_agent()
        env.wait_resources(ready, 60)
        results.add("startup_s", time.monotonic() - start)
    env.wait_labels(first, inventory, 0, 60)

    say(
        f"reconcile: {budget.reconcile_runs} runs x {budget.reconcile_changes} label changes "
        f"over {len(PRESETS)} presets"
    )
    for preset in PRESETS:  # fail early on a preset the bench cannot predict
        env.expect(preset)
    changes = 0
    wall_start = time.time()
    by_change: dict[str, list[float]] = {}
    for run in range(budget.reconcile_runs):
        harness_s, labels_s = [], []
        preset = first
        for i in range(budget.reconcile_changes):
            before, preset = preset, PRESETS[(i + 1) % len(PRESETS)]
            env.check_agent()
            a, b = env.converge(preset)
            harness_s.append(a)
            labels_s.append(b)
            by_change.setdefault(f"{before} -> {preset}", []).append(max(a, b))
            changes += 1
        if preset != first:  # every run starts from the same state
            env.converge(first)
            changes += 1
        both = [max(a, b) for a, b in zip(harness_s, labels_s, strict=True)]
        results.add("reconcile_s_p50", percentile(both, 50))
        results.add("reconcile_s_p95", percentile(both, 95))
        say(
            f"   run {run + 1}: harness p50/p95 {percentile(harness_s, 50):.3f}/"
            f"{percentile(harness_s, 95):.3f} s, labels p50/p95 {percentile(labels_s, 50):.3f}/"
            f"{percentile(labels_s, 95):.3f} s"
        )
    requests, watches = env.audit(wall_start, time.time())
    results.note(
        "reconcile: agent API requests per label change (audit)", f"{(requests - watches) / changes:.1f}"
    )
    slowest = sorted(by_change.items(), key=lambda kv: -statistics.median(kv[1]))
    results.note(
        "reconcile: median per transition, slowest first",
        ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in slowest),
    )


def bench_configmap(env: Cluster, budget: Budget, results: Results) -> int:
    """configmap_s_p50; leaves the node on the replicas config and returns its replica count."""
    env.api.put_config(REPLICAS_KEY, replicas_config(2))
    env.converge(REPLICAS_KEY)
    say(f"configmap: {budget.configmap_runs} runs x {budget.configmap_flips} edits (replicas 2 <-> 3)")
    replicas = 2
    for _ in range(budget.configmap_runs):
        samples = []
        for _ in range(budget.configmap_flips):
            replicas = 5 - replicas
            text = replicas_config(replicas)
            config = parse_config(REPLICAS_KEY, text, products=env.gpus)[0]
            inventory = expected_inventory(config, env.gpus, env.catalog)
            env.check_agent()
            start = time.monotonic()
            env.api.put_config(REPLICAS_KEY, text)
            samples.append(env.wait_resources(resources_match(inventory), 60) - start)
        results.add("configmap_s_p50", percentile(samples, 50))
    return replicas
