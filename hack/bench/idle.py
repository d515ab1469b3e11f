"""What an agent costs while nothing changes: memory, CPU and API requests.

The agent on 8 fake-driver GPUs x 64 replicas (512 devices), started fresh; once the node shows the
config done, windows of `idle_window_s` with nothing changing: VmRSS at the end of each window
(agent_rss_mb: the first window ends ~60 s after start in a full run), utime+stime over the window
in percent of one core (idle_cpu_pct), and the agent's API requests from the audit log
(idle_api_requests: user system:serviceaccount:gpu-sharing:gpu-sharing, by audit ID, counted by
requestReceivedTimestamp; watch renewals shown separately).
"""

from __future__ import annotations

import time

from bench.clients import CONFIG_LABEL
from bench.cluster import NODE, Cluster
from bench.expect import replicas_config, resources_match
from bench.procs import cpu_seconds, rss_mb
from bench.report import Budget, Results, say

GPUS_8 = "A100-SXM4-40GB:4,H100-80GB-HBM3:4"
KEY = "bench-8x64"


def bench_idle(env: Cluster, budget: Budget, results: Results) -> None:
    """Leaves the agent running on 512 devices (the preferred-allocation bench uses them)."""
    env.api.put_config(KEY, replicas_config(64))
    env.stop_agent()
    env.sim_init(GPUS_8)
    inventory = env.expect(KEY)
    env.api.label_node(NODE, {CONFIG_LABEL: KEY})
    say(
        f"idle: agent on {GPUS_8} x 64 replicas ({inventory['nvidia.com/gpu'][0]} devices), "
        f"{budget.idle_runs} windows of {budget.idle_window_s:.0f} s"
    )
    since = env.watch.mark()
    born = time.time()
    pid = env.start_agent().pid
    env.wait_resources(resources_match(inventory), 120)
    env.wait_labels(KEY, inventory, since, 60)
    time.sleep(2)  # let the first reconcile's Event and label patch land before the window
    for run in range(budget.idle_runs):
        wall, cpu, start = time.time(), cpu_seconds(pid), time.monotonic()
        end = start + budget.idle_window_s
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 5))
            env.check_agent()
        used, elapsed = cpu_seconds(pid) - cpu, time.monotonic() - start
        requests, watches = env.audit(wall, time.time())
        results.add("idle_cpu_pct", 100 * used / elapsed)
        results.add("agent_rss_mb", rss_mb(pid))
        results.add("idle_api_requests", requests)
        results.add("_idle_watches", watches)
        say(
            f"   window {run + 1}: cpu {100 * used / elapsed:.2f} %, rss {rss_mb(pid):.1f} MB, "
            f"{requests} requests ({watches} watch renewals)"
        )
    results.note("idle: agent age at the end of the last window", f"{time.time() - born:.0f} s")
    lifetime, lifetime_watches = env.audit(born, time.time() + 1)
    results.note(
        "idle: this agent's API requests over its whole life (start-up, first reconcile, idle)",
        f"{lifetime} ({lifetime_watches} watches)",
    )
