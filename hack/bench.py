#!/usr/bin/env python3
"""The performance bench: planner, applier, reconcile loop, device plugins and idle cost, with targets.

    $(hack/venv.sh)/bin/python hack/bench.py [--json PATH] [--quick]

It builds or reuses the Go binaries (lab.binaries()), starts its own etcd + kube-apiserver (with
an audit log, so the agent's API requests are counted by the API server) and kubelet harness (the
kubelet's own device manager), applies deploy/, runs `sharing agent` with its ServiceAccount token
on simulated GPUs, measures, and stops everything again, also on Ctrl-C or SIGTERM.

How each figure is measured (every figure is the median over runs; --quick runs fewer):
- plan_ms_*: `plan_gpu` on the catalog product with the most memory, over every profile multiset
  within max counts (from an empty GPU) and 1,000 seeded transitions (a valid layout with a random
  busy subset, to a random multiset that fits an empty GPU). In process, one call per sample.
- reconcile_s_*: label patch (sent to the API server by this process) until (a) the harness's
  /resources long-poll shows exactly the expected device counts (computed from the config and the
  catalog, independently of the agent) and (b) a Node watch shows `mig.config.state=success` with
  the expected count/replicas labels. The larger of (a) and (b) is the figure. (a) is read at the
  harness, so its Node-status copy interval (500 ms) does not count; the harness samples its device
  manager every 10 ms here (--poll-interval), which bounds the resolution.
- configmap_s_p50: ConfigMap patch (replicas 2 <-> 3 in a bench key) until (a).
- allocate_ms_*: POST /pods to the harness (device manager admission: GetPreferredAllocation +
  Allocate over the agent's socket) on a kept-alive connection; the pod is deleted untimed. The
  table also shows the harness's cost for a pod without devices, the same admission against the Go
  stub plugin (the floor of kubelet + harness), and direct gRPC calls on the agent's socket from a
  Python client (plugin side; this replaces the former hack/bench_deviceplugin.py).
- preferred_ms_p99: direct gRPC GetPreferredAllocation (size 4 of 512 available) on the running
  agent's socket (8 simulated GPUs x 64 replicas).
- listandwatch_ms_p95: the production Fleet in a child process serving 2,048 devices (8 GPUs x 256
  replicas) to a second harness; one GPU's health is flipped (`Fleet.apply_health`) and the time to
  the harness showing the new allocatable count is taken (clock: CLOCK_MONOTONIC, shared by both
  processes). The table also shows a direct ListAndWatch client's receipt time.
- startup_s: agent process start (node already labelled, GPUs already partitioned, as after a pod
  restart) until the harness has every expected resource allocatable.
- agent_rss_mb, idle_cpu_pct, idle_api_requests: the agent on 8 simulated GPUs x 64 replicas,
  60 s windows with nothing changing: VmRSS at the end, utime+stime over the window (percent of one
  core), API requests from the audit log (user system:serviceaccount:gpu-sharing:gpu-sharing,
  de-duplicated by auditID, counted by requestReceivedTimestamp; watch renewals shown separately).
- mutations_vs_recreate: 20 fixed MIG transitions on one simulated A100 and one H100 through
  `apply_config`: mutating NVML calls (sim counters) / what destroy-all-and-recreate would need
  (2 calls per destroyed and per created instance, 1 per mode change; 0 for a GPU that matches).
  The transitions (_LAYOUTS) mix small edits with reshapes that keep nothing (any layout <-> 7g).

A full run takes about 7 minutes on 2 cores (three 60 s idle windows are most of it), --quick about 2.
Needs root (the harness's private mount namespace) and the Go binaries (built once, ~10 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import glob
import http.client
import itertools
import json
import logging
import math
import os
import platform
import random
import re
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO / "hack"), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import grpc  # noqa: E402
import lab  # noqa: E402
import structlog  # noqa: E402

from sharing.apply import apply_config  # noqa: E402
from sharing.catalog import Catalog, Product, default_catalog  # noqa: E402
from sharing.cli.sim import parse_gpus  # noqa: E402
from sharing.config import parse_config, parse_configmap  # noqa: E402
from sharing.gpu import open_backend, simstate  # noqa: E402
from sharing.inventory import Device, DeviceId, Health, inventory_from  # noqa: E402
from sharing.journal import Journal  # noqa: E402
from sharing.kubeletapi import deviceplugin_v1beta1_pb2 as api  # noqa: E402
from sharing.kubeletapi import deviceplugin_v1beta1_pb2_grpc as api_grpc  # noqa: E402
from sharing.model import GpuUuid, HealthEvent  # noqa: E402
from sharing.plan import Existing, plan_gpu  # noqa: E402
from sharing.plan import Plan as GpuPlan  # noqa: E402
from sharing.serve.fleet import Fleet, FleetSettings  # noqa: E402
from sharing.spec import MigMode, MigStrategy, Rule, Selector, SharingConfig  # noqa: E402

NODE = "bench-gpu-node"
NAMESPACE = "gpu-sharing"
CONFIGMAP = "gpu-sharing-config"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
STATE_LABEL = "nvidia.com/mig.config.state"
AGENT_USER = "system:serviceaccount:gpu-sharing:gpu-sharing"
GPUS_4 = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"
GPUS_8 = "A100-SXM4-40GB:4,H100-80GB-HBM3:4"
PRESETS = ("a100-mig-h100-time-sliced", "all-1g", "all-balanced", "all-replicas-4", "all-3g")
HARNESS_POLL = "--poll-interval=10ms"
STUB_RESOURCE = "bench.example.com/stub"
IDLE_WINDOW_S = 60.0

# metric: (unit, target as printed, met?)
TARGETS: dict[str, tuple[str, str, Callable[[float], bool]]] = {
    "plan_ms_p50": ("ms", "-", lambda v: True),
    "plan_ms_p99": ("ms", "< 5 ms", lambda v: v < 5),
    "reconcile_s_p50": ("s", "-", lambda v: True),
    "reconcile_s_p95": ("s", "< 1 s", lambda v: v < 1),
    "configmap_s_p50": ("s", "< 1 s", lambda v: v < 1),
    "allocate_ms_p50": ("ms", "-", lambda v: True),
    "allocate_ms_p99": ("ms", "< 2 ms", lambda v: v < 2),
    "preferred_ms_p99": ("ms", "< 10 ms", lambda v: v < 10),
    "listandwatch_ms_p95": ("ms", "< 100 ms", lambda v: v < 100),
    "startup_s": ("s", "< 2 s", lambda v: v < 2),
    "agent_rss_mb": ("MB", "< 80 MB", lambda v: v < 80),
    "idle_cpu_pct": ("%", "< 1 %", lambda v: v < 1),
    "idle_api_requests": ("", "~0 (<= 1)", lambda v: v <= 1),
    "mutations_vs_recreate": ("", "well < 0.5 (< 0.4)", lambda v: v < 0.4),
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
    allocate_calls: int
    preferred_runs: int
    preferred_calls: int
    listandwatch_runs: int
    listandwatch_flips: int
    startup_runs: int
    idle_runs: int


FULL = Budget(5, 3, 20, 3, 10, 3, 5000, 3, 2000, 3, 30, 5, 3)
QUICK = Budget(2, 1, 20, 1, 6, 1, 5000, 1, 500, 1, 15, 2, 1)


def say(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# statistics and results


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

    def add(self, metric: str, value: float) -> None:
        self.runs.setdefault(metric, []).append(value)

    def note(self, what: str, value: str) -> None:
        self.info.append((what, value))
        say(f"   {what}: {value}")

    def value(self, metric: str) -> float | None:
        values = self.runs.get(metric)
        return statistics.median(values) if values else None


# ----------------------------------------------------------------------------------------------
# planner


def bench_plan(plan: Budget, results: Results) -> None:

    catalog = default_catalog()
    product = max(catalog.products, key=lambda p: (p.memory_slices, p.memory_mib, p.name))
    names = [p.name for p in product.profiles]
    multisets = [
        dict(zip(names, counts, strict=True))
        for counts in itertools.product(*(range(p.max_count + 1) for p in product.profiles))
    ]
    feasible = [m for m in multisets if isinstance(plan_gpu(product, (), m), GpuPlan)]
    rng = random.Random(20240607)
    transitions = []
    for _ in range(1000):
        layout = plan_gpu(product, (), rng.choice(feasible))
        assert isinstance(layout, GpuPlan)
        existing = tuple(Existing(p.profile, p.start, busy=rng.random() < 0.3) for p in layout.layout)
        transitions.append((existing, rng.choice(feasible)))
    planned = sum(isinstance(plan_gpu(product, e, w), GpuPlan) for e, w in transitions)
    say(
        f"planner: {product.name}, {len(multisets)} multisets ({len(feasible)} feasible) + "
        f"{len(transitions)} transitions ({planned} feasible), {plan.plan_runs} runs"
    )
    cases = [((), m) for m in multisets] + transitions
    worst = 0.0
    for _ in range(plan.plan_runs):
        samples = []
        for existing, want in cases:
            start = time.perf_counter_ns()
            plan_gpu(product, existing, want)
            samples.append((time.perf_counter_ns() - start) / 1e6)
        results.add("plan_ms_p50", percentile(samples, 50))
        results.add("plan_ms_p99", percentile(samples, 99))
        worst = max(worst, *samples)
        transition_p99 = percentile(samples[len(multisets) :], 99)
    results.note(
        "plan: max single call / p99 of transitions only (last run)",
        f"{worst:.3f} ms / {transition_p99:.3f} ms",
    )


# ----------------------------------------------------------------------------------------------
# applier: mutations versus destroy-all-and-recreate

# 19 layouts of the 8-slice geometry, by profile kind; the H100 walks them from another offset.
_KINDS = {0: "1g", 7: "1g+me", 9: "1g-double", 1: "2g", 2: "3g", 3: "4g", 4: "7g"}
_LAYOUTS: tuple[dict[str, int], ...] = (
    {"1g": 7},
    {"1g": 3, "3g": 1},
    {"3g": 2},
    {"3g": 1, "2g": 2},
    {"1g": 2, "2g": 1, "3g": 1},
    {"7g": 1},
    {"4g": 1, "3g": 1},
    {"4g": 1, "1g": 3},
    {"2g": 3},
    {"2g": 2, "1g": 3},
    {"1g-double": 4},
    {"1g-double": 2, "3g": 1},
    {"1g+me": 1, "1g": 6},
    {"3g": 1, "1g": 4},
    {"2g": 1, "1g": 5},
    {"1g": 7},
    {"3g": 2},
    {"1g": 2, "2g": 1, "3g": 1},
    {"7g": 1},
)


def _named(product: Product, layout: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    by_kind = {_KINDS[p.enum]: p.name for p in product.profiles}
    return tuple(sorted((by_kind[kind], n) for kind, n in layout.items()))


def bench_mutations(tmp: Path, results: Results) -> None:
    asyncio.run(_mutations(tmp, results))


async def _mutations(tmp: Path, results: Results) -> None:
    catalog = default_catalog()
    sim = tmp / "mutations.json"
    simstate.init_state(
        sim,
        [
            simstate.resolve_product(catalog, "A100-SXM4-40GB"),
            simstate.resolve_product(catalog, "H100-80GB-HBM3"),
        ],
    )
    products = [catalog.product("A100-SXM4-40GB"), catalog.product("H100-80GB-HBM3")]
    offsets = (0, 7)
    # Per GPU: 19 MIG layouts, then MIG off again: 20 transitions starting from MIG off.
    sequences = [
        [_named(p, _LAYOUTS[(i + off) % len(_LAYOUTS)]) for i in range(len(_LAYOUTS))] + [None]
        for p, off in zip(products, offsets, strict=True)
    ]
    backend = open_backend("sim", catalog, sim_state=sim)
    journal = Journal(tmp / "mutations-journal.jsonl")
    recreate_calls = agent_calls = nothing_kept = 0
    try:
        current: list[tuple[tuple[str, int], ...] | None] = [None, None]
        for step in range(20):
            rules = []
            step_recreate = 0
            for index, seq in enumerate(sequences):
                want = seq[step]
                rules.append(
                    Rule(Selector(indices=(index,)), MigMode.DISABLED)
                    if want is None
                    else Rule(Selector(indices=(index,)), MigMode.ENABLED, instances=want)
                )
                step_recreate += _recreate_cost(current[index], want)
                current[index] = want
            config = SharingConfig(f"t{step}", MigStrategy.MIXED, rules=tuple(rules))
            before = simstate.counters(sim).mutating_calls
            report = await apply_config(backend, config, catalog=catalog, journal=journal)
            if not report.ok:
                raise RuntimeError(f"transition {step} failed: {report}")
            step_agent = simstate.counters(sim).mutating_calls - before
            agent_calls += step_agent
            recreate_calls += step_recreate
            nothing_kept += step_agent == step_recreate
    finally:
        await backend.close()
    results.add("mutations_vs_recreate", agent_calls / recreate_calls)
    results.note(
        "mutations: agent NVML mutating calls / destroy-all-and-recreate calls (20 transitions x 2 GPUs)",
        f"{agent_calls} / {recreate_calls}; in {nothing_kept} of 20 steps neither GPU could keep anything",
    )


def _recreate_cost(have: tuple[tuple[str, int], ...] | None, want: tuple[tuple[str, int], ...] | None) -> int:
    """What mig-parted does: nothing when it matches, else destroy every instance and create every one."""
    if have == want:
        return 0
    destroyed = sum(n for _, n in have or ())
    created = sum(n for _, n in want or ())
    mode = int((have is None) != (want is None))
    return 2 * destroyed + 2 * created + mode


# ----------------------------------------------------------------------------------------------
# expectations, computed from the config and the catalog (not by asking the agent)


def expected_inventory(
    config: SharingConfig, gpus: Sequence[str], catalog: Catalog
) -> dict[str, tuple[int, int, int]]:
    """{resource: (devices, physical devices, replicas)} the node should advertise."""
    found: dict[str, list[int]] = {}

    def add(resource: str, physical: int, replicas: int, rename: Mapping[str, str]) -> None:
        if physical == 0:
            return
        name = resource
        if replicas > 1:
            name = rename.get(resource) or (resource + ".shared" if config.rename_by_default else resource)
        entry = found.setdefault(name, [0, 0, replicas])
        entry[0] += physical * max(1, replicas)
        entry[1] += physical

    for index, product_name in enumerate(gpus):
        product = catalog.find(product_name)
        rule = config.rule_for(index, product.name if product else product_name)
        if rule is None or rule.mig is MigMode.UNCHANGED:
            raise ValueError(
                f"config {config.name!r} leaves GPU {index} as it is; the bench cannot predict it"
            )
        rename = dict(rule.rename)
        if rule.mig is MigMode.DISABLED or config.mig_strategy is MigStrategy.NONE:
            add("nvidia.com/gpu", 1, rule.replicas.for_kind("gpu"), rename)
            continue
        for profile, count in rule.instances:
            resource = (
                "nvidia.com/gpu"
                if config.mig_strategy is MigStrategy.SINGLE
                else "nvidia.com/mig-" + profile.replace("+", ".")
            )
            add(resource, count, rule.replicas.for_kind(profile), rename)
    return {name: (d, p, r) for name, (d, p, r) in found.items()}


def expected_labels(inventory: Mapping[str, tuple[int, int, int]]) -> dict[str, str]:
    """The count and replicas labels (GFD names) and the success state."""
    labels = {STATE_LABEL: "success"}
    for name, (_, physical, replicas) in inventory.items():
        key = name.removeprefix("nvidia.com/").removesuffix(".shared")
        if key == "gpu":  # gpu.count/replicas now follow GFD (physical GPUs of one model)
            continue
        labels[f"nvidia.com/{key}.count"] = str(physical)
        labels[f"nvidia.com/{key}.replicas"] = str(replicas)
    return labels


_COUNT_LABEL = re.compile(r"^nvidia\.com/mig-.*\.count$")


def labels_match(expected: Mapping[str, str]) -> Callable[[Mapping[str, str]], bool]:
    def match(labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in expected.items()):
            return False
        return not any(_COUNT_LABEL.match(k) and k not in expected for k in labels)

    return match


def resources_match(inventory: Mapping[str, tuple[int, int, int]]) -> Callable[[dict[str, Any]], bool]:
    """The harness shows exactly these devices, all allocatable, and nothing else allocatable."""

    def match(resources: dict[str, Any]) -> bool:
        for name, info in resources.items():
            want = inventory.get(name, (0, 0, 0))[0]
            if want == 0:
                if info.get("allocatable", 0) != 0:
                    return False
            elif info.get("capacity") != want or info.get("allocatable") != want:
                return False
        return all(name in resources for name in inventory)

    return match


def nothing_allocatable(names: Sequence[str]) -> Callable[[dict[str, Any]], bool]:
    return lambda resources: all(resources.get(n, {}).get("allocatable", 0) == 0 for n in names)


def replicas_config(replicas: int) -> str:
    return f"version: v1\ngpus:\n  - devices: all\n    mig: disabled\n    replicas: {replicas}\n"


# ----------------------------------------------------------------------------------------------
# clients: the API server (admin, kept alive), a Node watch, the harness (kept alive)


class Api:
    """Admin requests to kube-apiserver on one kept-alive TLS connection."""

    def __init__(self, cp: lab.ControlPlane) -> None:
        url = urllib.parse.urlsplit(cp.server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.context = ssl.create_default_context(cafile=str(cp.ca_path))
        self.context.load_cert_chain(cp.dir / "admin.crt", cp.dir / "admin.key")
        self._conn: http.client.HTTPSConnection | None = None

    def connect(self, timeout: float | None = 30) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, merge: bool = True) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/merge-patch+json" if merge else "application/json"}
        for attempt in (1, 2):
            if self._conn is None:
                self._conn = self.connect()
            try:
                self._conn.request(method, path, body=data, headers=headers)
                resp = self._conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                self._conn.close()
                self._conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status >= 300:
                raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {raw[:300]!r}")
            return json.loads(raw)
        raise AssertionError("unreachable")

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> None:
        self.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": dict(labels)}})

    def put_config(self, key: str, text: str) -> None:
        path = f"/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIGMAP}"
        self.request("PATCH", path, {"data": {key: text}})

    def configmap_data(self) -> dict[str, str]:
        return dict(self.request("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIGMAP}")["data"])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class NodeWatch:
    """Watches one Node from a thread and keeps (receive time, labels) of every event."""

    def __init__(self, api: Api, name: str) -> None:
        self.api = api
        self.name = name
        self.history: list[tuple[float, dict[str, str]]] = []
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self._conn: http.client.HTTPSConnection | None = None
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            if self._conn is not None and self._conn.sock is not None:
                self._conn.sock.shutdown(socket.SHUT_RDWR)

    def mark(self) -> int:
        with self.cond:
            return len(self.history)

    def labels(self) -> dict[str, str]:
        with self.cond:
            return dict(self.history[-1][1]) if self.history else {}

    def wait(self, ok: Callable[[Mapping[str, str]], bool], since: int, timeout: float) -> float:
        """Receive time of the first event from index `since` whose labels satisfy `ok`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            index = since
            while True:
                while index < len(self.history):
                    at, labels = self.history[index]
                    if ok(labels):
                        return at
                    index += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self.history[-1][1] if self.history else {}
                    raise TimeoutError(f"node labels not as expected within {timeout}s; last: {last}")
                self.cond.wait(min(left, 1.0))

    def _run(self) -> None:
        selector = urllib.parse.quote(f"metadata.name={self.name}")
        while not self._stop.is_set():
            try:
                self._conn = self.api.connect(timeout=None)
                self._conn.request(
                    "GET", f"/api/v1/nodes?watch=1&fieldSelector={selector}&timeoutSeconds=3600"
                )
                resp = self._conn.getresponse()
                for line in iter(resp.readline, b""):
                    now = time.monotonic()
                    event = json.loads(line)
                    labels = event.get("object", {}).get("metadata", {}).get("labels") or {}
                    with self.cond:
                        self.history.append((now, labels))
                        self.cond.notify_all()
            except (OSError, http.client.HTTPException, ValueError):
                if self._stop.wait(0.2):
                    return
            finally:
                if self._conn is not None:
                    self._conn.close()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Harness:
    """The harness control API on one kept-alive connection (admission latency without reconnects)."""

    def __init__(self, control_socket: Path) -> None:
        self.conn = _UnixConnection(control_socket, 60)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"harness {method} {path}: HTTP {resp.status}: {raw[:300]!r}")
        return json.loads(raw) if raw else None

    def close(self) -> None:
        self.conn.close()


# ----------------------------------------------------------------------------------------------
# processes


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_process(proc: subprocess.Popen[Any] | None, timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def lab_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Cluster:
    """Everything the cluster part runs: control plane, harness, agent, clients."""

    tmp: Path
    cp: lab.ControlPlane
    kubelet: lab.KubeletHarness
    api: Api
    watch: NodeWatch
    audit_log: Path
    agent_kubeconfig: Path
    catalog: Catalog
    agent: subprocess.Popen[bytes] | None = None
    agents: int = 0
    sim: Path = Path()
    gpus: list[str] = field(default_factory=list)

    def sim_init(self, gpus: str) -> None:
        specs = parse_gpus(gpus)
        self.sim = self.tmp / f"gpus-{len(specs)}-{self.agents}.json"
        simstate.init_state(self.sim, specs)
        self.gpus = [s.product for s in specs]

    def start_agent(self) -> subprocess.Popen[bytes]:
        log = self.tmp / f"agent-{self.agents}.log"
        self.agents += 1
        args = [
            "--node-name", NODE,
            "--namespace", NAMESPACE,
            "--configmap", CONFIGMAP,
            "--kubeconfig", str(self.agent_kubeconfig),
            "--backend", "sim",
            "--sim-state", str(self.sim),
            "--device-plugin-dir", str(self.kubelet.device_plugin_dir),
            "--pod-resources-socket", str(self.kubelet.pod_resources_socket),
            "--journal", str(self.sim.with_suffix(".journal")),
            "--log-format", "json",
            "--cdi-spec-dir", str(self.tmp / "cdi"),
            "--http-port", str(lab_free_port()),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with log.open("wb") as out:
            self.agent = subprocess.Popen(
                [sys.executable, "-m", "sharing", "agent", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        return self.agent

    def stop_agent(self) -> None:
        stop_process(self.agent)
        self.agent = None

    def config(self, name: str) -> SharingConfig:
        data = self.api.configmap_data()
        configs = parse_configmap({name: data[name]}, products=self.gpus, catalog=self.catalog)
        config = configs.get(name)
        if config is None:
            raise RuntimeError(f"config {name!r} is invalid: {configs.errors}")
        return config

    def expect(self, name: str) -> dict[str, tuple[int, int, int]]:
        return expected_inventory(self.config(name), self.gpus, self.catalog)

    def check_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is not None:
            raise RuntimeError(f"the agent exited with {self.agent.returncode}; see {self.tmp}/agent-*.log")

    def wait_resources(self, ok: Callable[[dict[str, Any]], bool], timeout: float = 60) -> float:
        """Time the harness reply that first satisfies `ok` arrived."""
        self.kubelet.wait_resources(ok, timeout=timeout)
        return time.monotonic()

    def converge(self, name: str, timeout: float = 90) -> tuple[float, float]:
        """Label the node with config `name`; (seconds to the harness, seconds to the labels)."""
        inventory = self.expect(name)
        since = self.watch.mark()
        start = time.monotonic()
        self.api.label_node(NODE, {CONFIG_LABEL: name})
        at_harness = self.wait_resources(resources_match(inventory), timeout)
        at_labels = self.watch.wait(labels_match(expected_labels(inventory)), since, timeout)
        return at_harness - start, at_labels - start

    def audit(self, start_wall: float, end_wall: float) -> tuple[int, int]:
        """(requests, of which watches) the agent's ServiceAccount sent in [start, end)."""
        seen: dict[str, str] = {}
        with self.audit_log.open() as log:
            for line in log:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("user", {}).get("username") != AGENT_USER:
                    continue
                if event.get("stage") not in ("ResponseStarted", "ResponseComplete"):
                    continue
                received = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
                if start_wall <= received < end_wall:
                    seen[event["auditID"]] = event.get("verb", "")
        return len(seen), sum(verb == "watch" for verb in seen.values())


AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["{AGENT_USER}"]
  - level: None
"""


@contextlib.contextmanager
def running_cluster(tmp: Path) -> Iterator[Cluster]:
    bins = lab.binaries()
    policy = tmp / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    audit_log = tmp / "audit.log"
    say("starting etcd + kube-apiserver (audit log on) and the kubelet harness")
    with contextlib.ExitStack() as stack:
        cp = stack.enter_context(
            lab.ControlPlane(
                base_dir=tmp / "control-plane",
                extra_apiserver_args=[f"--audit-policy-file={policy}", f"--audit-log-path={audit_log}"],
                bins=bins,
            )
        )
        kubelet = stack.enter_context(
            lab.KubeletHarness(
                tmp / "kubelet",
                kubeconfig=cp.kubeconfig,
                node_name=NODE,
                extra_args=[HARNESS_POLL],
                binary=bins.kubelet_harness,
            )
        )
        api = Api(cp)
        stack.callback(api.close)
        deadline = time.monotonic() + 60
        while True:
            try:
                api.request("GET", f"/api/v1/nodes/{NODE}")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        cp.kubectl("apply", "-f", str(REPO / "deploy"), check=True)
        # deploy/ leaves the user's ConfigMap to the user: make it from the presets, as before.
        presets = cp.kubectl(
            "get", "configmap", "gpu-sharing-presets", "-n", NAMESPACE, "-o", "json", check=True
        )
        user = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CONFIGMAP, "namespace": NAMESPACE},
        }
        user["data"] = json.loads(presets.stdout)["data"]
        cp.kubectl("apply", "-f", "-", input=json.dumps(user), check=True)
        # The admission policy in deploy/ admits only a token bound to a pod on the agent's node.
        placeholder = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"agent-{NODE}", "namespace": NAMESPACE},
            "spec": {
                "nodeName": NODE,
                "serviceAccountName": "gpu-sharing",
                "containers": [{"name": "agent", "image": "gpu-sharing:placeholder"}],
            },
        }
        cp.kubectl("apply", "-f", "-", input=json.dumps(placeholder), check=True)
        token = cp.kubectl(
            "create", "token", "gpu-sharing", "-n", NAMESPACE, "--duration=2h",
            "--bound-object-kind=Pod", f"--bound-object-name=agent-{NODE}", check=True,
        ).stdout.strip()  # fmt: skip
        watch = NodeWatch(api, NODE).start()
        stack.callback(watch.stop)
        env = Cluster(
            tmp, cp, kubelet, api, watch, audit_log, cp.token_kubeconfig(token, "gpu-sharing-agent"),
            default_catalog(),
        )  # fmt: skip
        stack.callback(env.stop_agent)
        yield env


# ----------------------------------------------------------------------------------------------
# cluster benches


def bench_startup_and_reconcile(env: Cluster, plan: Budget, results: Results) -> None:
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
    env.watch.wait(labels_match(expected_labels(inventory)), 0, 60)

    say(f"startup: {plan.startup_runs} restarts of the agent on a partitioned, labelled node")
    for _ in range(plan.startup_runs):
        env.stop_agent()
        env.wait_resources(nothing_allocatable(list(inventory)), 30)
        start = time.monotonic()
        env.start_agent()
        env.wait_resources(ready, 60)
        results.add("startup_s", time.monotonic() - start)
    env.watch.wait(labels_match(expected_labels(inventory)), 0, 60)

    say(
        f"reconcile: {plan.reconcile_runs} runs x {plan.reconcile_changes} label changes "
        f"over {len(PRESETS)} presets"
    )
    for preset in PRESETS:  # fail early on a preset the bench cannot predict
        expected_inventory(env.config(preset), env.gpus, env.catalog)
    changes = 0
    wall_start = time.time()
    by_change: dict[str, list[float]] = {}
    for run in range(plan.reconcile_runs):
        harness_s, labels_s = [], []
        preset = first
        for i in range(plan.reconcile_changes):
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
        results.add("reconcile_s_p50", max(percentile(harness_s, 50), percentile(labels_s, 50)))
        results.add("reconcile_s_p95", max(percentile(harness_s, 95), percentile(labels_s, 95)))
        results.add("_reconcile_a_p50", percentile(harness_s, 50))
        results.add("_reconcile_a_p95", percentile(harness_s, 95))
        results.add("_reconcile_b_p50", percentile(labels_s, 50))
        results.add("_reconcile_b_p95", percentile(labels_s, 95))
        say(
            f"   run {run + 1}: harness p50/p95 {percentile(harness_s, 50):.3f}/"
            f"{percentile(harness_s, 95):.3f} s, labels p50/p95 {percentile(labels_s, 50):.3f}/"
            f"{percentile(labels_s, 95):.3f} s"
        )
    requests, watches = env.audit(wall_start, time.time())
    results.note(
        "reconcile: (a) harness p50/p95, (b) labels p50/p95 (median of runs)",
        f"{results.value('_reconcile_a_p50'):.3f}/{results.value('_reconcile_a_p95'):.3f} s, "
        f"{results.value('_reconcile_b_p50'):.3f}/{results.value('_reconcile_b_p95'):.3f} s",
    )
    results.note(
        "reconcile: agent API requests per label change (audit)", f"{(requests - watches) / changes:.1f}"
    )
    slowest = sorted(by_change.items(), key=lambda kv: -statistics.median(kv[1]))
    results.note(
        "reconcile: median per transition, slowest first",
        ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in slowest),
    )


def bench_configmap_and_allocate(env: Cluster, plan: Budget, results: Results) -> None:
    key = "bench-replicas"
    env.api.put_config(key, replicas_config(2))
    env.converge(key)
    say(f"configmap: {plan.configmap_runs} runs x {plan.configmap_flips} edits (replicas 2 <-> 3)")
    replicas = 2
    for _ in range(plan.configmap_runs):
        samples = []
        for _ in range(plan.configmap_flips):
            replicas = 5 - replicas
            text = replicas_config(replicas)
            inventory = expected_inventory(
                parse_config(key, text, products=env.gpus)[0], env.gpus, env.catalog
            )
            env.check_agent()
            start = time.monotonic()
            env.api.put_config(key, text)
            samples.append(env.wait_resources(resources_match(inventory), 60) - start)
        results.add("configmap_s_p50", percentile(samples, 50))

    devices = len(env.gpus) * replicas
    say(
        f"allocate: {plan.allocate_runs} runs x {plan.allocate_calls} pods through the harness "
        f"({devices} devices)"
    )
    harness = Harness(env.kubelet.control_socket)
    try:
        empty = _admissions(harness, plan.allocate_calls // 5, None)
        results.note(
            "allocate: harness admission of a pod without devices p50/p99 (overhead)",
            f"{percentile(empty, 50):.3f}/{percentile(empty, 99):.3f} ms",
        )
        # The same admission against the Go stub plugin: the floor of kubelet + harness + gRPC.
        stub_devices = [f"Stub-{n}" for n in range(devices)]
        with lab.StubDevicePlugin(env.kubelet.device_plugin_dir, STUB_RESOURCE, stub_devices, preferred=True):
            env.wait_resources(lambda r: r.get(STUB_RESOURCE, {}).get("allocatable") == devices, 30)
            stub = _admissions(harness, plan.allocate_calls // 5, STUB_RESOURCE)
        env.wait_resources(nothing_allocatable([STUB_RESOURCE]), 30)
        results.note(
            f"allocate: the same admission against the Go stub device plugin p50/p99 (kubelet floor, "
            f"{devices} devices, preferred allocation on)",
            f"{percentile(stub, 50):.3f}/{percentile(stub, 99):.3f} ms",
        )
        for _ in range(plan.allocate_runs):
            samples = _admissions(harness, plan.allocate_calls, "nvidia.com/gpu")
            results.add("allocate_ms_p50", percentile(samples, 50))
            results.add("allocate_ms_p99", percentile(samples, 99))
    finally:
        harness.close()
    ids = env.kubelet.resources()["resources"]["nvidia.com/gpu"]["healthy"]
    sock = plugin_socket(env.kubelet.device_plugin_dir, "gpu-sharing", "gpu")
    direct = grpc_latency(sock, plan.allocate_calls, allocate_request=[ids[0]])
    results.note(
        "allocate: direct gRPC Allocate on the agent's socket p50/p99 (plugin side, Python client)",
        f"{percentile(direct, 50):.3f}/{percentile(direct, 99):.3f} ms",
    )
    direct = grpc_latency(sock, plan.allocate_calls, preferred=(ids, 1))
    results.note(
        f"allocate: direct GetPreferredAllocation size 1 of {len(ids)} p50/p99 (the kubelet's other call)",
        f"{percentile(direct, 50):.3f}/{percentile(direct, 99):.3f} ms",
    )


def _admissions(harness: Harness, calls: int, resource: str | None) -> list[float]:
    limits = {resource: "1"} if resource else {}
    samples = []
    for i in range(calls):
        body = {"namespace": "bench", "name": f"p{i}", "containers": [{"name": "main", "limits": limits}]}
        start = time.perf_counter()
        pod = harness.call("POST", "/pods", body)
        samples.append((time.perf_counter() - start) * 1e3)
        harness.call("DELETE", f"/pods/{urllib.parse.quote(pod['uid'], safe='')}")
    return samples


def plugin_socket(plugin_dir: Path, prefix: str, short: str) -> Path:
    found = [Path(p) for p in glob.glob(str(plugin_dir / f"{prefix}-{short}-*.sock"))]
    found = [
        p
        for p in found
        if re.fullmatch(rf"{re.escape(prefix)}-{re.escape(short)}-[0-9a-f]{{8}}\.sock", p.name)
    ]
    if not found:
        raise RuntimeError(f"no plugin socket for {short} in {plugin_dir}")
    return max(found, key=lambda p: p.stat().st_mtime)


def grpc_latency(
    sock: Path,
    calls: int,
    *,
    allocate_request: list[str] | None = None,
    preferred: tuple[list[str], int] | None = None,
) -> list[float]:

    with grpc.insecure_channel(f"unix://{sock}") as channel:
        stub = api_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        if allocate_request is not None:
            req: Any = api.AllocateRequest(
                container_requests=[api.ContainerAllocateRequest(devices_ids=allocate_request)]
            )
            call = stub.Allocate
        else:
            assert preferred is not None
            available, size = preferred
            req = api.PreferredAllocationRequest(
                container_requests=[
                    api.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available, allocation_size=size
                    )
                ]
            )
            call = stub.GetPreferredAllocation
        for _ in range(min(100, calls)):  # warm the channel
            call(req, timeout=10)
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            call(req, timeout=10)
            samples.append((time.perf_counter() - start) * 1e3)
    return samples


def bench_idle_and_preferred(env: Cluster, plan: Budget, results: Results) -> None:
    key = "bench-8x64"
    env.api.put_config(key, replicas_config(64))
    env.stop_agent()
    env.sim_init(GPUS_8)
    inventory = env.expect(key)
    env.api.label_node(NODE, {CONFIG_LABEL: key})
    say(
        f"idle: agent on {GPUS_8} x 64 replicas ({inventory['nvidia.com/gpu'][0]} devices), "
        f"{plan.idle_runs} windows of {IDLE_WINDOW_S:.0f} s"
    )
    since = env.watch.mark()
    born = time.time()
    pid = env.start_agent().pid
    env.wait_resources(resources_match(inventory), 120)
    env.watch.wait(labels_match(expected_labels(inventory)), since, 60)
    time.sleep(2)  # let the first reconcile's Event and label patch land before the window
    for run in range(plan.idle_runs):
        wall, cpu, start = time.time(), cpu_seconds(pid), time.monotonic()
        end = start + IDLE_WINDOW_S
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
    results.note(
        "idle: watch renewals among the idle requests (median of windows)",
        f"{results.value('_idle_watches'):.0f}",
    )
    lifetime, lifetime_watches = env.audit(born, time.time() + 1)
    results.note(
        "idle: this agent's API requests over its whole life (start-up, first reconcile, idle)",
        f"{lifetime} ({lifetime_watches} watches)",
    )

    ids = env.kubelet.resources()["resources"]["nvidia.com/gpu"]["healthy"]
    sock = plugin_socket(env.kubelet.device_plugin_dir, "gpu-sharing", "gpu")
    say(f"preferred: {plan.preferred_runs} runs x {plan.preferred_calls} calls, size 4 of {len(ids)}")
    for _ in range(plan.preferred_runs):
        samples = grpc_latency(sock, plan.preferred_calls, preferred=(ids, 4))
        results.add("preferred_ms_p99", percentile(samples, 99))
        results.add("_preferred_p50", percentile(samples, 50))
    results.note("preferred: p50 (median of runs)", f"{results.value('_preferred_p50'):.3f} ms")
    env.stop_agent()


# ----------------------------------------------------------------------------------------------
# ListAndWatch: the production Fleet in a child process, a harness without a Node

LW_GPUS, LW_REPLICAS = 8, 256


def bench_listandwatch(tmp: Path, plan: Budget, results: Results) -> None:
    total = LW_GPUS * LW_REPLICAS
    say(
        f"listandwatch: {plan.listandwatch_runs} runs x {plan.listandwatch_flips} health flips, "
        f"{total} devices"
    )
    with contextlib.ExitStack() as stack:
        kubelet = stack.enter_context(lab.KubeletHarness(tmp / "kubelet-lw", extra_args=[HARNESS_POLL]))
        child = subprocess.Popen(
            [sys.executable, __file__, "--fleet-child", str(kubelet.device_plugin_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            cwd=REPO,
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
        stack.callback(stop_process, child)

        def ask(command: str) -> float:
            assert child.stdin is not None
            assert child.stdout is not None
            child.stdin.write(command + "\n")
            child.stdin.flush()
            reply = child.stdout.readline()
            if not reply:
                raise RuntimeError("the fleet child exited")
            return float(reply)

        def allocatable(n: int) -> Callable[[dict[str, Any]], bool]:
            return lambda r: r.get("bench.example.com/gpu", {}).get("allocatable") == n

        ask(f"init {LW_GPUS} {LW_REPLICAS}")
        kubelet.wait_resources(allocatable(total), 60)
        sick = False
        for _ in range(plan.listandwatch_runs):
            samples = []
            for _ in range(plan.listandwatch_flips):
                sick = not sick
                at = ask("sick" if sick else "well")
                kubelet.wait_resources(allocatable(total - LW_REPLICAS if sick else total), 30)
                samples.append((time.monotonic() - at) * 1e3)
            results.add("listandwatch_ms_p95", percentile(samples, 95))
            results.add("_lw_p50", percentile(samples, 50))
        direct = _direct_listandwatch(
            plugin_socket(kubelet.device_plugin_dir, "bench", "gpu"), ask, plan.listandwatch_flips, sick
        )
    results.note("listandwatch: harness p50 (median of runs)", f"{results.value('_lw_p50'):.1f} ms")
    results.note(
        "listandwatch: direct ListAndWatch client receipt p50/p95 (second stream)",
        f"{percentile(direct, 50):.1f}/{percentile(direct, 95):.1f} ms",
    )


def _direct_listandwatch(sock: Path, ask: Callable[[str], float], flips: int, sick: bool) -> list[float]:

    received: list[tuple[float, int]] = []
    cond = threading.Condition()
    channel = grpc.insecure_channel(f"unix://{sock}")
    stream = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())  # type: ignore[no-untyped-call]

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            for response in stream:
                now = time.monotonic()
                unhealthy = sum(d.health != "Healthy" for d in response.devices)
                with cond:
                    received.append((now, unhealthy))
                    cond.notify_all()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    samples = []
    try:
        with cond:
            cond.wait_for(lambda: received, 10)
        for _ in range(flips):
            sick = not sick
            with cond:
                mark = len(received)
            at = ask("sick" if sick else "well")
            got = _first_with(received, cond, mark, LW_REPLICAS if sick else 0)
            samples.append((got - at) * 1e3)
    finally:
        stream.cancel()
        channel.close()
    return samples


def _first_with(
    received: list[tuple[float, int]], cond: threading.Condition, mark: int, unhealthy: int
) -> float:
    """Receive time of the first list from index `mark` on with `unhealthy` unhealthy devices."""
    with cond:
        if not cond.wait_for(lambda: any(u == unhealthy for _, u in received[mark:]), 10):
            raise TimeoutError("the direct ListAndWatch stream did not see the change")
        return next(t for t, u in received[mark:] if u == unhealthy)


def fleet_child(plugin_dir: Path) -> None:
    """Serve a Fleet; stdin: `init G R`, `sick`, `well`; stdout: the monotonic time of each change."""
    asyncio.run(_fleet_child(plugin_dir))


async def _fleet_child(plugin_dir: Path) -> None:

    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, socket_prefix="bench"))
    await fleet.start()
    first = GpuUuid("GPU-00000000-bench-0000-0000-000000000000")
    try:
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).split()
            if not line:
                return
            at = time.monotonic()
            if line[0] == "init":
                gpus, replicas = int(line[1]), int(line[2])
                devices = [
                    Device(DeviceId(f"{uuid}::{n}"), Health.HEALTHY, g % 2, uuid, replica=n)
                    for g in range(gpus)
                    for uuid in [first if g == 0 else GpuUuid(f"GPU-{g:08d}-bench-0000-0000-000000000000")]
                    for n in range(replicas)
                ]
                fleet.update(inventory_from({"bench.example.com/gpu": devices}))
            else:
                fleet.apply_health(HealthEvent(first, healthy=line[0] == "well", xid=79))
            print(at, flush=True)
    finally:
        await fleet.stop()


# ----------------------------------------------------------------------------------------------
# machine, table, main


def quiet_logs() -> None:
    """Warnings and errors of the in-process code to stderr (stdout is the table, or the child's replies)."""

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def machine(
    plan: Budget, quick: bool, results: Results, started: float, load_start: tuple[float, ...]
) -> dict[str, Any]:
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
        "samples": {
            "plan_calls_per_run": "every multiset + 1000 transitions",
            "reconcile_label_changes_per_run": plan.reconcile_changes,
            "configmap_edits_per_run": plan.configmap_flips,
            "allocate_pods_per_run": plan.allocate_calls,
            "preferred_calls_per_run": plan.preferred_calls,
            "listandwatch_flips_per_run": plan.listandwatch_flips,
            "idle_window_s": IDLE_WINDOW_S,
        },
    }


def print_table(results: Results, info: dict[str, Any]) -> None:
    rows = [("metric", "value", "target", "met?")]
    for metric, (unit, target, ok) in TARGETS.items():
        value = results.value(metric)
        if value is None:
            rows.append((metric, "n/a", target, "ERROR"))
            continue
        shown = (
            f"{value:.0f}"
            if metric == "idle_api_requests"
            else f"{value:.3f}"
            if value < 10
            else f"{value:.1f}"
        )
        rows.append((metric, f"{shown} {unit}".strip(), target, "yes" if ok(value) else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
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
        f"Python {info['python']}, "
        f"load {info['loadavg_start']} -> {info['loadavg_end']}; bench took {info['bench_seconds']:.0f} s"
    )
    for error in results.errors:
        print(f"ERROR: {error}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures as one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer runs (a few minutes)")
    parser.add_argument("--fleet-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quiet_logs()
    if args.fleet_child is not None:
        fleet_child(args.fleet_child)
        return 0

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    plan = QUICK if args.quick else FULL
    results = Results()
    started, load_start = time.monotonic(), os.getloadavg()
    say(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="gs-bench-") as tmp_name:
        tmp = Path(tmp_name)
        parts: list[tuple[str, Callable[[], None]]] = [
            ("planner", lambda: bench_plan(plan, results)),
            ("mutations", lambda: bench_mutations(tmp, results)),
            ("listandwatch", lambda: bench_listandwatch(tmp, plan, results)),
        ]
        try:
            for name, part in parts:
                try:
                    part()
                except Exception as err:  # report it, go on with the other parts
                    results.errors.append(f"{name}: {err}")
                    say(f"{name} failed: {err}")
            with running_cluster(tmp) as env:
                for name, cluster_part in (
                    ("startup/reconcile", bench_startup_and_reconcile),
                    ("configmap/allocate", bench_configmap_and_allocate),
                    ("idle/preferred", bench_idle_and_preferred),
                ):
                    try:
                        cluster_part(env, plan, results)
                    except Exception as err:  # report it, go on with the other parts
                        results.errors.append(f"{name}: {err}")
                        say(f"{name} failed: {err}; agent logs in {tmp} are kept only while running")
        except KeyboardInterrupt:
            say("interrupted: stopping everything")
            return 130
        except lab.ClusterError as err:
            results.errors.append(f"cluster: {err}")
    info = machine(plan, args.quick, results, started, load_start)
    print_table(results, info)
    if args.json:
        out: dict[str, Any] = {}
        for metric in TARGETS:
            value = results.value(metric)
            out[metric] = None if value is None else round(value, 4)
        out["machine"] = info
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
