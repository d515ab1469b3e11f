"""A label change right after an API server restart.

- restart_label_s: kube-apiserver stopped for `Budget.outage_s` (10 s; the agent's watches fail and back off
  meanwhile) and started again on the same etcd; as soon as it answers, the node is relabelled
  (time-slicing 4 <-> 8 replicas); until the harness shows the new devices and the Node says
  `success` (the larger, as in reconcile_s). The worst run is the figure. Before the fix the
  watches' first `410 Gone` waited out the outage's backoff: 13 s after a 10 s outage.
"""

from __future__ import annotations

from bench.clients import CONFIG_LABEL
from bench.cluster import NODE, Cluster
from bench.expect import resources_match
from bench.report import Budget, Results, say

GPUS_4 = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"
CONFIGS = ("all-replicas-4", "all-replicas-8")


def bench_restart(env: Cluster, budget: Budget, results: Results) -> None:
    env.stop_agent()
    env.sim_init(GPUS_4)
    env.api.label_node(NODE, {CONFIG_LABEL: CONFIGS[0]})
    inventory = env.expect(CONFIGS[0])
    since = env.watch.mark()
    env.start_agent()
    env.wait_resources(resources_match(inventory), 60)
    env.wait_labels(CONFIGS[0], inventory, since, 60)
    say(
        f"restart: {budget.restart_runs} API server restarts ({budget.outage_s:.0f} s down),"
        " then a label change"
    )
    samples = []
    for run in range(budget.restart_runs):
        env.check_agent()
        env.cp.restart_apiserver(down_s=budget.outage_s)
        harness_s, labels_s = env.converge(CONFIGS[(run + 1) % 2])
        samples.append(max(harness_s, labels_s))
        say(f"   run {run + 1}: harness {harness_s:.2f} s, labels {labels_s:.2f} s")
    results.add("restart_label_s", max(samples))
