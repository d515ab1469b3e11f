"""An agent restart, as a DaemonSet rollout or a crash makes one: how long the kubelet refuses pods.

- agent_restart_admission_gap_s: the node partitioned and labelled, the agent serving; this process
  asks the kubelet harness (the kubelet's own device manager) to admit a pod requesting
  `nvidia.com/mig-1g.5gb: 1` over and over (each admitted pod deleted again), while the agent gets
  SIGTERM and, once it has exited, a new agent starts at once (as the kubelet restarts a
  container). The figure is the time from the first refused admission (the old agent's plugins
  have gone: the kubelet holds their devices unhealthy) to the next admitted one (the new agent's
  plugins registered and listed their devices). The resolution is one admission, a few ms.
  Shown beside it: the old agent's SIGTERM -> exit, the new agent's process start -> first
  admitted pod, and the same gap when the new agent cannot reach the API server (its kubeconfig
  names a closed port): an agent that waited for the API server would refuse pods until it gave up.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.clients import CONFIG_LABEL, Harness
from bench.cluster import NODE, Cluster
from bench.expect import resources_match
from bench.report import Budget, Results, percentile, say

GPUS_4 = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"
PRESET = "a100-mig-h100-time-sliced"
RESOURCE = "nvidia.com/mig-1g.5gb"


class _Prober(threading.Thread):
    """Admits a pod asking for one device, deletes it, again: (time of the answer, admitted?)."""

    def __init__(self, harness: Harness) -> None:
        super().__init__(daemon=True)
        self.harness = harness
        self.answers: list[tuple[float, bool]] = []
        self._done = threading.Event()

    def run(self) -> None:
        n = 0
        while not self._done.is_set():
            n += 1
            container = {"name": "main", "limits": {RESOURCE: "1"}}
            body = {"namespace": "bench", "name": f"probe-{n}", "containers": [container]}
            try:
                pod = self.harness.call("POST", "/pods", body)
            except RuntimeError:  # HTTP 409: not admitted
                self.answers.append((time.monotonic(), False))
                continue
            self.answers.append((time.monotonic(), True))
            self.harness.call("DELETE", f"/pods/{pod['uid']}")

    def admitted_after(self, since: float) -> float | None:
        return next((t for t, ok in list(self.answers) if ok and t > since), None)

    def refused_after(self, since: float) -> float | None:
        return next((t for t, ok in list(self.answers) if not ok and t > since), None)

    def stop(self) -> None:
        self._done.set()
        self.join(30)


def _wait(what: str, find: Callable[[float], float | None], since: float, timeout: float) -> float:
    """The time `find(since)` names, once it names one."""
    deadline = time.monotonic() + timeout
    while (found := find(since)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {timeout:.0f} s")
        time.sleep(0.01)
    return found


def bench_restart(env: Cluster, budget: Budget, results: Results) -> None:
    env.sim_init(GPUS_4)
    env.api.label_node(NODE, {CONFIG_LABEL: PRESET})
    inventory = env.expect(PRESET)
    env.start_agent()
    env.wait_resources(resources_match(inventory), 120)
    env.wait_labels(PRESET, inventory, 0, 60)
    say(f"restart: {budget.startup_runs} agent restarts while pods asking {RESOURCE}: 1 keep arriving")
    gaps, exits, starts = [], [], []
    for _ in range(budget.startup_runs):
        gap, exit_s, start_s = _restart(env)
        results.add("agent_restart_admission_gap_s", gap)
        gaps.append(gap)
        exits.append(exit_s)
        starts.append(start_s)
        env.wait_resources(resources_match(inventory), 60)
    results.note(
        "restart: kubelet refuses pods p50/max; old agent SIGTERM -> exit p50; new agent start -> "
        "first admitted pod p50",
        f"{percentile(gaps, 50):.2f}/{max(gaps):.2f} s; {percentile(exits, 50):.2f} s; "
        f"{percentile(starts, 50):.2f} s",
    )
    unreachable = env.tmp / "unreachable.kubeconfig"
    unreachable.write_text(env.agent_kubeconfig.read_text().replace(env.cp.server, "https://127.0.0.1:9"))
    gap, _, _ = _restart(env, unreachable)
    results.note(
        "restart: kubelet refuses pods, the new agent without the API server (one run)", f"{gap:.2f} s"
    )
    _restart(env)  # back to an agent that reaches the API server
    env.wait_resources(resources_match(inventory), 60)


def _restart(env: Cluster, kubeconfig: Path | None = None) -> tuple[float, float, float]:
    """One restart: (refused -> admitted again, old agent SIGTERM -> exit, new agent start -> admitted)."""
    prober = _Prober(Harness(env.kubelet.control_socket))
    prober.start()
    try:
        _wait("an admitted pod before the restart", prober.admitted_after, 0, 30)
        old = env.agent
        assert old is not None
        term = time.monotonic()
        old.send_signal(signal.SIGTERM)
        old.wait(30)
        exited = time.monotonic()
        env.start_agent(kubeconfig)
        started = time.monotonic()
        refused = _wait("a refused admission", prober.refused_after, term, 30)
        admitted = _wait("an admitted pod after the restart", prober.admitted_after, refused, 60)
    finally:
        prober.stop()
        prober.harness.close()
    return admitted - refused, exited - term, admitted - started
