"""The figures: targets, how many samples each part takes, per-run values, the table and the JSON.

Every metric is recorded once per run and reported as the median of its runs; a ratio to the Go
stub plugin is taken within one run (the two interleaved sample by sample), then the median of
those ratios. A metric a part could not measure reads ``n/a`` and makes the bench fail.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def say(message: str) -> None:
    """Progress on stderr (stdout is the table)."""
    print(f"==> {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Target:
    """How a metric is shown and judged."""

    unit: str
    text: str
    ok: Callable[[float], bool] = lambda v: True


RATIO = Target("x", "<= 1.25", lambda v: v <= 1.25)
# metric: target. The order is the table's.
TARGETS: dict[str, Target] = {
    "plan_ms_p50": Target("ms", "-"),
    "plan_ms_p99": Target("ms", "< 5 ms", lambda v: v < 5),
    "mutations_vs_recreate": Target("", "well < 0.5 (< 0.4)", lambda v: v < 0.4),
    "reconcile_s_p50": Target("s", "-"),
    "reconcile_s_p95": Target("s", "< 1 s", lambda v: v < 1),
    "configmap_s_p50": Target("s", "< 1 s", lambda v: v < 1),
    "startup_s": Target("s", "< 2 s", lambda v: v < 2),
    "agent_restart_admission_gap_s": Target("s", "< 2 s", lambda v: v < 2),
    "allocate_ms_p50": Target("ms", "-"),
    "allocate_ms_p99": Target("ms", "- (see the ratio)"),
    "allocate_vs_stub_p50": RATIO,
    "allocate_vs_stub_p99": RATIO,
    "preferred_ms_p99": Target("ms", "< 10 ms", lambda v: v < 10),
    "preferred_vs_stub_p99": RATIO,
    "listandwatch_ms_p95": Target("ms", "< 100 ms", lambda v: v < 100),
    "listandwatch_vs_stub_p95": RATIO,
    "agent_rss_mb": Target("MB", "< 100 MB", lambda v: v < 100),
    "restart_label_s": Target("s", "< 2 s", lambda v: v < 2),
    "hostile_configmap_mb": Target("MB", "< 30 MB", lambda v: v < 30),
    "hostile_configmap_s": Target("s", "< 1 s", lambda v: v < 1),
    "idle_cpu_pct": Target("%", "< 0.3 %", lambda v: v < 0.3),
    "idle_api_requests": Target("", "~0 (<= 1)", lambda v: v <= 1),
    "pod_start_vs_plain_p50": Target("x", "<= 1.2", lambda v: v <= 1.2),
    "label_to_allocatable_s_p95": Target("s", "< 1 s", lambda v: v < 1),
    "node_stop_s": Target("s", "< 3 s", lambda v: v < 3),
    "cluster_configmap_converge_s_p95": Target("s", "- (two nodes of three, from the PATCH)"),
    "cluster_upgrade_s": Target("s", "- (three nodes, helm upgrade to every node success)"),
    "cluster_upgrade_disrupted_pods": Target("", "0", lambda v: v == 0),
    "cluster_upgrade_allocatable_dips": Target("", "0 (kubelet >= 1.37)", lambda v: v == 0),
    "fleet_nodes": Target("", "100", lambda v: v >= 100),
    "fleet_converge_s_p50": Target("s", "-"),
    "fleet_converge_s_p95": Target("s", "- (bound by the cores: see the ratio)"),
    "fleet_converge_vs_cpu_floor": Target(
        "x", "<= 1.25 (p95 / all processes' CPU-s / cores)", lambda v: v <= 1.25
    ),
    "fleet_agent_cpu_per_converge_s": Target(
        "s", "<= 0.25 s (all threads, the fake driver's own work apart)", lambda v: v <= 0.25
    ),
    "fleet_fake_driver_cpu_per_converge_s": Target("s", "- (inside the fake libnvidia-ml.so.1)"),
    "fleet_nvml_calls_per_converge": Target("", "-"),
    "fleet_api_requests_per_converge": Target("", "-"),
    "fleet_idle_api_rpm": Target("", "0", lambda v: v == 0),
    "fleet_dra_apiserver_us_per_claim": Target(
        "us", "- (kube-apiserver CPU per claim change: flat in the number of agents)"
    ),
    "fleet_dra_agent_cpu_per_foreign_claim_us": Target(
        "us", "~0 (agent CPU beyond idle per change of another node's claim, p95)", lambda v: v <= 10
    ),
    "fleet_dra_requests_per_prepare": Target(
        "", "- (the agent's API requests per claim prepared on its node)"
    ),
    "fleet_dra_claim_reads_per_prepare": Target(
        "", "<= 1 (GETs of ResourceClaims per prepare)", lambda v: v <= 1
    ),
    "fleet_dra_agent_claim_lists": Target(
        "", "0 (LISTs and WATCHes of ResourceClaims by agents)", lambda v: v == 0
    ),
    "healthz_flood_s_max": Target("s", "< 1 s", lambda v: v < 1),
    "resourceslice_update_s_p50": Target("s", "-"),
    "resourceslice_update_s_p95": Target("s", "< 1 s", lambda v: v < 1),
    "resourceslice_publish_s_p50": Target("s", "-"),
    "resourceslice_publish_s_p95": Target("s", "-"),
    "dra_pod_start_vs_deviceplugin_p50": Target("x", "<= 1.2", lambda v: v <= 1.2),
    "dra_agent_rss_mb": Target("MB", "< 100 MB", lambda v: v < 100),
    "trace_shift_slice_seconds_vs_static": Target(
        "x",
        ">= 1.3 (shifting mix, median of seeds; compute-slice-seconds, policy / best preset)",
        lambda v: v >= 1.3,
    ),
    "trace_shift_slice_seconds_vs_hindsight": Target(
        "x", ">= 1.0 (median; vs the layout chosen in hindsight)", lambda v: v >= 1.0
    ),
    "trace_shift_served_vs_static_min": Target("x", ">= 1 (pods, worst seed)", lambda v: v >= 1),
    "trace_shift_stranded_share_ondemand": Target("", "- (median; free slices no waiting pod can use)"),
    "trace_shift_stranded_share_static": Target("", "- (median; the best preset's)"),
    "trace_slice_seconds_vs_static_min": Target("x", ">= 0.97 (steady mix, worst seed)", lambda v: v >= 0.97),
    "trace_served_vs_static_min": Target("x", ">= 0.97 (steady mix, pods, worst seed)", lambda v: v >= 0.97),
    "trace_slice_seconds_vs_hindsight": Target("x", "- (steady mix, median)"),
    "trace_stranded_share_ondemand": Target("", "- (steady mix, median)"),
    "trace_stranded_share_static": Target("", "- (steady mix, median; the best preset's)"),
    "trace_offline_policy_vs_plain_mean": Target(
        "x", ">= 1 (steady, pods; offline, seeds 1-40)", lambda v: v >= 1
    ),
    "trace_offline_policy_vs_plain_slice_mean": Target(
        "x", ">= 1 (steady, slice-s; offline, seeds 1-40)", lambda v: v >= 1
    ),
    "trace_shift_offline_policy_vs_plain_mean": Target(
        "x", ">= 1 (shifting, pods; offline, seeds 1-40)", lambda v: v >= 1
    ),
    "trace_shift_offline_policy_vs_plain_slice_mean": Target(
        "x", ">= 1 (shifting, slice-s; offline, seeds 1-40)", lambda v: v >= 1
    ),
    "dra_prepare_agent_share_s_p99": Target(
        "s", "<= 0.1 s (7 claims at once on one A100, NVML calls left out)", lambda v: v <= 0.1
    ),
    "dra_prepare_agent_share_tmpfs_s_p99": Target("s", "- (the same, its files on tmpfs: no fsync waits)"),
    "dra_prepare_agent_cpu_s_p99": Target(
        "s", "- (the agent's CPU time in those prepares: no waits for a core)"
    ),
    "ondemand_pod_start_s_p50": Target("s", "- (MIG calls at once)"),
    "ondemand_pod_start_s_p50_realistic": Target("s", "- (MIG calls at the fake driver's assumed latencies)"),
    "ondemand_pod_start_vs_premade_p50": Target("x", "<= 1.5", lambda v: v <= 1.5),
    "ondemand_create_share": Target("", "-"),
    "ondemand_idle_claim_requests_per_min": Target(
        "/min", "~0 (<= 1; ResourceClaim LISTs, cluster-wide, idle)", lambda v: v <= 1
    ),
    "usage_sampler_cpu_pct": Target(
        "%", "<= 0.5 % (8 GPUs, 56 MIG devices, 64 replicas; a sample every 10 s)", lambda v: v <= 0.5
    ),
    "usage_sample_nvml_share": Target("", "- (of that, in NVML calls: pynvml and the fake driver)"),
}


@dataclass(frozen=True)
class Budget:
    """How many runs and samples each part takes (full or --quick)."""

    plan_runs: int
    reconcile_runs: int
    reconcile_changes: int
    configmap_runs: int
    configmap_flips: int
    allocate_runs: int
    allocate_pods: int
    preferred_runs: int
    preferred_pods: int
    listandwatch_runs: int
    listandwatch_flips: int
    startup_runs: int
    idle_runs: int
    idle_window_s: float
    pod_starts: int
    label_changes: int
    fleet_nodes: int
    fleet_edits: int
    fleet_idle_s: float
    restart_runs: int
    flood_idle: int = 1000
    flood_rps: int = 200
    flood_window_s: float = 20.0
    slice_runs: int = 3
    slice_changes: int = 20
    trace_pods: int = 120
    trace_unit_s: float = 0.5
    """Real seconds per unit of trace time."""
    outage_s: float = 10.0
    """How long the API server is down in `restart`."""
    claim_idle_s: float = 30.0
    """The window `ondemand` counts ResourceClaim reads in while nothing changes."""
    prepare_rounds: int = 20
    """Rounds of seven claims prepared at once in `prepare`."""
    fleet_dra_claims: int = 1000
    """Claims created and deleted in `fleetdra`'s storm, over `fleet_dra_storm_s`."""
    fleet_dra_storm_s: float = 60.0
    usage_samples: int = 30
    """Samples the usage sampler takes in `usage` (after its first)."""


FULL = Budget(
    plan_runs=5, reconcile_runs=3, reconcile_changes=20, configmap_runs=3, configmap_flips=10,
    allocate_runs=3, allocate_pods=2000, preferred_runs=3, preferred_pods=1000, listandwatch_runs=3,
    listandwatch_flips=30, startup_runs=5, idle_runs=2, idle_window_s=60, pod_starts=12,
    label_changes=12, fleet_nodes=100, fleet_edits=3, fleet_idle_s=60, restart_runs=3,
)  # fmt: skip
QUICK = Budget(
    plan_runs=1, reconcile_runs=1, reconcile_changes=10, configmap_runs=1, configmap_flips=6,
    allocate_runs=1, allocate_pods=500, preferred_runs=1, preferred_pods=300, listandwatch_runs=1,
    listandwatch_flips=12, startup_runs=2, idle_runs=1, idle_window_s=20, pod_starts=3,
    label_changes=3, fleet_nodes=10, fleet_edits=1, fleet_idle_s=10, restart_runs=1, flood_window_s=8,
    prepare_rounds=5, fleet_dra_claims=300, fleet_dra_storm_s=30, usage_samples=10,
)  # fmt: skip
SMOKE = Budget(
    plan_runs=1, reconcile_runs=1, reconcile_changes=2, configmap_runs=1, configmap_flips=2,
    allocate_runs=1, allocate_pods=20, preferred_runs=1, preferred_pods=20, listandwatch_runs=1,
    listandwatch_flips=2, startup_runs=1, idle_runs=1, idle_window_s=3, pod_starts=1,
    label_changes=1, fleet_nodes=2, fleet_edits=1, fleet_idle_s=2, restart_runs=1, flood_idle=50,
    flood_rps=20, flood_window_s=2, slice_runs=1, slice_changes=2, trace_pods=12, trace_unit_s=0.1,
    outage_s=2, claim_idle_s=3, prepare_rounds=1, fleet_dra_claims=6, fleet_dra_storm_s=2, usage_samples=2,
)  # fmt: skip
"""Every part with a sample or two (`--smoke`): CI runs it so that no part rots unseen; its figures
mean nothing."""


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Results:
    """Per-run values of each metric, and informational rows for the table."""

    runs: dict[str, list[float]] = field(default_factory=dict)
    info: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds each part that ran took (it ran to its end or failed: see `errors`)."""

    def add(self, metric: str, value: float) -> None:
        self.runs.setdefault(metric, []).append(value)

    def note(self, what: str, value: str) -> None:
        self.info.append((what, value))
        say(f"   {what}: {value}")

    def value(self, metric: str) -> float | None:
        values = self.runs.get(metric)
        return statistics.median(values) if values else None

    def spread(self, metric: str) -> str:
        """min..max of the runs, when there is more than one."""
        values = self.runs.get(metric, [])
        return f"{_shown(min(values))}..{_shown(max(values))}" if len(values) > 1 else ""


def _shown(value: float) -> str:
    if value == int(value):
        return f"{value:.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def machine(quick: bool, results: Results, started: float, load_start: tuple[float, ...]) -> dict[str, Any]:
    """Where and how the figures were taken."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) // 1024
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "memory_mb": memory,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "bench_seconds": round(time.monotonic() - started, 1),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "runs": {k: len(v) for k, v in sorted(results.runs.items()) if not k.startswith("_")},
    }


def print_table(results: Results, info: dict[str, Any]) -> None:
    """The table on stdout: metric, median of runs, range of runs, target, met."""
    rows = [("metric", "value", "runs (min..max)", "target", "met?")]
    for metric, target in TARGETS.items():
        value = results.value(metric)
        if value is None:
            rows.append((metric, "n/a", "", target.text, "ERROR" if results.errors else "not run"))
            continue
        shown = f"{_shown(value)} {target.unit}".strip()
        rows.append((metric, shown, results.spread(metric), target.text, "yes" if target.ok(value) else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if results.info:
        print("\nalso measured (not targets):")
        for what, text in results.info:
            print(f"  {what}: {text}")
    print(
        f"\nmachine: {info['cpu_model']}, {info['cores']} cores, {info['memory_mb']} MB, "
        f"Python {info['python']}, load {info['loadavg_start']} -> {info['loadavg_end']}; "
        f"bench took {info['bench_seconds']:.0f} s"
    )
    for error in results.errors:
        print(f"ERROR: {error}")


def as_json(results: Results, info: dict[str, Any]) -> dict[str, Any]:
    """Every target metric (None when not measured), the extra figures, and the machine."""
    out: dict[str, Any] = {}
    for metric in TARGETS:
        value = results.value(metric)
        out[metric] = None if value is None else round(value, 4)
    for metric in sorted(results.runs):
        if metric not in TARGETS and not metric.startswith("_"):
            value = results.value(metric)
            out[metric] = None if value is None else round(value, 4)
    out["errors"] = results.errors
    out["parts_s"] = {part: round(seconds, 1) for part, seconds in results.parts.items()}
    out["machine"] = info
    return out
