"""Workload traces on simulated GPUs (four A100-SXM4-40GB unless `--gpus` says otherwise), each run
four ways through the real kube-scheduler.

One control plane (etcd + kube-apiserver), kube-scheduler (default profile: DynamicResources and
NodeResourcesFit; backoff capped at 1 s so a retry is not mistaken for a wait) and
kube-controller-manager's resourceclaim and garbage-collector controllers (they free the claim of a
deleted pod, as on a real cluster). No kubelet: a pod counts as served when the scheduler binds it.
Per trace, four Ready Node objects, one per way, each with the same GPUs:

- ``preset``: the device-plugin front-end with the best shipped preset (profiles/*.yaml, written by
  hack/gen-presets.py) for the trace. Each preset is resolved for the GPUs (`tracesim.preset_on`)
  and the one ranking first in an offline replay of the trace wins (`tracesim.best_preset`, ranked
  by `tracesim.better`: compute-slice-seconds served, then pods): the best preset in hindsight,
  among presets. The node advertises what that preset's device plugin would:
  `nvidia.com/mig-<profile>` per pre-made instance, `nvidia.com/gpu` per whole GPU. A pod asking
  for a profile the preset lacks stays Pending until its patience ends.
- ``hindsight``: the same front-end with the best static layout for the trace, found by replaying
  the trace offline over every combination of the maximal per-GPU layouts the catalog's placements
  allow (`tracesim.best_static`, ranked the same way). No operator can choose it ahead: it is an
  upper bound for any static layout, shipped or not.
- ``policy``: on-demand, the agent's own pool: `sharing.dra.partitions.partitionable_slices` (a
  counter set per GPU, one device per profile x placement consuming its memory slices, each GPU's
  devices in `sharing.mig.policy.ranked` order; a whole-GPU device first when the trace asks for
  whole GPUs), built again from what the agent knows, the devices of the claims prepared on the
  node (the bench stands in for the kubelet: a claim whose pod is bound counts as prepared), and
  published by the agent's `SlicePublisher` each time that changes.
- ``plain``: the same devices with each GPU's in plain placement order (`sharing.mig.policy.plain`:
  profile, then lowest start), as NVIDIA's driver lists them, published once.

The traces: drawn from a seed with a steady mix or a shifting one (`tracesim.TraceSpec`), or read
from a CSV file (`tracesim.read_trace`; `--trace`). Figures are keyed `trace_*` (steady),
`trace_shift_*` (shifting) and `trace_file_*` (the file).

Why the order decides: the scheduler's allocator walks the pools, each pool's slices (by name) and
each slice's devices in order and allocates the first device that matches and fits (`allocateOne`
in k8s.io/dynamic-resource-allocation@v0.36.3 structured/internal/incubating/allocator_incubating.go;
`sharing.mig.policy` cites the lines); it has no scoring among the devices of one node.

Every pod asks for `nvidia.com/mig-<profile>: 1` (a whole GPU: `nvidia.com/gpu: 1`) in its limits,
the same spec all four ways; on the DRA nodes the DeviceClass's extendedResourceName turns it into a
claim. One trace second is `UNIT_S` real seconds (`--time-scale`). Each trace pod is created on the
four nodes at its arrival; a bound pod is force-deleted after its lifetime, an unbound one when its
patience ends (withdrawn, not served). Per way (`tracesim.summarize`): pods served,
compute-slice-seconds served and their share of the offered, mean and p95 wait (all and per
profile), the largest profile still placeable and the stranded share, sampled once a trace second.

Beside the figures, an offline replay of seeds 1-40 of each mix (``tracesim.vs_plain``, no
scheduler): the policy, a placement drawn at random and the GPU chosen by best fit across the GPUs
(``tracesim.best_fit``) instead of first fit in slice order, each against plain order, which shows
how far the order alone moves the pods and compute served beyond the noise of the trace itself.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lab
from lab import components
from lab.api import ApiError
from lab.process import Process

from bench import tracesim
from bench.clients import Api
from bench.report import Results, say
from bench.tracesim import Outcome, TracePod, TraceSpec
from sharing.config import parse_config
from sharing.dra.names import DRIVER, parse_ondemand_name
from sharing.dra.partitions import partitionable_slices
from sharing.dra.placements import named
from sharing.kube import ApiClient
from sharing.kube.api import SliceDevice, SliceSpec
from sharing.kube.resourceslices import SlicePublisher
from sharing.mig import default_catalog, policy
from sharing.model import DriverInfo, Gpu, GpuUuid, NodeState

CATALOG = default_catalog()
DEFAULT_GPUS = "A100-SXM4-40GB:4"
UNIT_S = 0.5
"""Real seconds per trace second (`--time-scale` is its inverse)."""
TICK_S = 0.1
DEFAULT_SEEDS = (1, 2, 3)
SHIFT_LENGTH = 2
"""A shifting trace has this many times the pods of a steady one: 240 at full size, 80 a phase, so a
phase lasts about 160 s, five mean lifetimes (a mix has not shifted while the pods of the phase
before still hold the GPUs)."""
OFFLINE_SEEDS = tuple(range(1, 41))
"""The seeds of the offline replay that shows what the order is worth against the trace's own
noise: the policy and a placement drawn at random, each against plain order."""
WAYS: tuple[tuple[str, tracesim.Way], ...] = (
    ("hindsight", "static"),
    ("preset", "static"),
    ("policy", "policy"),
    ("plain", "plain"),
)
"""(label, kind) of each way: both static ways replay as pre-made counts."""
PRESETS = Path(__file__).resolve().parents[2] / "profiles"
CONTROLLERS = "--controllers=resourceclaim-controller,garbage-collector-controller"
"""Free the claims of deleted pods; no node-lifecycle controller (no kubelet heartbeats here)."""
CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpu-sharing"
SCHEDULER_CONFIG = """apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection: {{kubeconfig: "{kubeconfig}", qps: 200, burst: 400}}
leaderElection: {{leaderElect: false}}
podInitialBackoffSeconds: 1
podMaxBackoffSeconds: 1
"""


# --- the on-demand pool ----------------------------------------------------------------------------


def occupancy(gpus: tracesim.Gpus, devices: Iterable[str]) -> list[int]:
    """Each GPU's mask of used slots, from the allocated on-demand device names (`gpu-<i>`: all)."""
    masks = [0] * len(gpus)
    for name in devices:
        whole = WHOLE_DEVICE.fullmatch(name)
        if whole is not None and int(whole[1]) < len(gpus):
            masks[int(whole[1])] = tracesim.mask(0, gpus[int(whole[1])].slots)
            continue
        parsed = parse_ondemand_name(name)
        if parsed is None or parsed[0] >= len(gpus):
            continue
        gpu, slug, start = parsed
        profile = named(gpus[gpu]).get(slug)
        if profile is not None:
            masks[gpu] |= tracesim.mask(start, profile.size)
    return masks


WHOLE_DEVICE = re.compile(r"gpu-(\d+)")
"""`device_name_of_gpu`: the whole-GPU device of a dynamic GPU."""


def ondemand_node(node: str, gpus: tracesim.Gpus) -> NodeState:
    """The GPUs in MIG mode with no instances, their geometry from the catalog."""
    made = tuple(
        Gpu(index, GpuUuid(f"GPU-{node}-{index}"), f"NVIDIA {(*product.nvml_names, product.name)[0]}",
            product.memory_mib, True, True, True, (), compute_capability=product.compute_capability or (8, 0),
            minor=index, pci_bus_id=f"0000:{index + 16:02x}:00.0", brand="Nvidia", profiles=product)
        for index, product in enumerate(gpus)
    )  # fmt: skip
    return NodeState(made, driver=DriverInfo("550.107.02", 12040))


def plain_order(specs: Sequence[SliceSpec], gpus: tracesim.Gpus) -> tuple[SliceSpec, ...]:
    """The same slices with each one's devices in plain placement order (`policy.plain`)."""
    ranks = [
        {(r.placement.profile, r.placement.start): n for n, r in enumerate(policy.plain(product, ()))}
        for product in gpus
    ]

    def key(device: SliceDevice) -> int:
        parsed = parse_ondemand_name(device.name)
        if parsed is None:
            return -1  # a whole-GPU device first, as NVIDIA's driver lists it
        gpu, slug, start = parsed
        profile = named(gpus[gpu]).get(slug)
        return -1 if profile is None else ranks[gpu][(profile.name, start)]

    return tuple(replace(s, devices=tuple(sorted(s.devices, key=key))) for s in specs)


def ondemand_slices(
    node: str,
    state: NodeState,
    way: str,
    gpus: tracesim.Gpus,
    prepared: Iterable[str] = (),
    *,
    whole: bool = False,
) -> tuple[SliceSpec, ...]:
    """The pool the agent would publish for the way: policy order given the devices of the claims
    `prepared` on the node, or plain order; with `whole`, each GPU's whole-GPU device too (listed
    first)."""
    dynamic = {g.uuid for g in state.gpus}
    specs = partitionable_slices(node, state, dynamic, CATALOG, prepared=prepared, whole_gpu=whole)
    return specs if way == "policy" else plain_order(specs, gpus)


# --- the cluster -----------------------------------------------------------------------------------


@dataclass
class WayRun:
    """One way's node and what happened on it."""

    label: str
    way: tracesim.Way
    node: str
    namespace: str
    gpus: tracesim.Gpus
    profiles: Sequence[str]
    static: Mapping[str, int] = field(default_factory=dict)
    publisher: SlicePublisher | None = None
    state: NodeState | None = None
    wanted: tuple[SliceSpec, ...] = ()
    placed: dict[int, float] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    live: dict[int, str] = field(default_factory=dict)
    """Bound and not yet deleted: trace index -> profile."""
    allocated: tuple[str, ...] = ()
    prepared: tuple[str, ...] = ()
    """The allocated devices whose pod is bound: what the agent knows of (its checkpoint)."""
    largest: list[int] = field(default_factory=list)
    stranded: list[float] = field(default_factory=list)
    republished: int = 0

    def sample(self, waiting: Iterable[str]) -> None:
        """The largest profile placeable now and, with a pod waiting, the stranded share."""
        if self.way == "static":
            free = dict(self.static)
            for profile in self.live.values():
                free[profile] = free.get(profile, 0) - 1
            top, lost = tracesim.sample(self.gpus, self.profiles, waiting, static=self.static, free=free)
        else:
            occupied = occupancy(self.gpus, self.allocated)
            top, lost = tracesim.sample(self.gpus, self.profiles, waiting, occupied=occupied)
        self.largest.append(top)
        if lost is not None:
            self.stranded.append(lost)


def _ready_node(api: Api, name: str, allocatable: Mapping[str, str]) -> None:
    base = {"cpu": "64", "memory": "512Gi", "pods": "500"}
    status = {
        "allocatable": {**base, **allocatable},
        "capacity": {**base, **allocatable},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "bench"}],
    }
    api.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    # The API server taints a new Node not-ready (admission TaintNodesByCondition); no kubelet clears it.
    api.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}})
    api.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": status})


def _publish(run: WayRun, specs: tuple[SliceSpec, ...]) -> None:
    """The agent's publisher writes the pool (blocking) and says whether the API server kept it all."""
    assert run.publisher is not None
    if run.wanted:
        run.republished += 1
    run.wanted = specs
    run.publisher.want(specs)
    run.publisher.sync()
    if run.publisher.problems:
        raise RuntimeError(f"the API server dropped parts of {run.node}'s pool: {run.publisher.problems}")


def _pod_body(run: WayRun, pod: TracePod) -> dict[str, Any]:
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [run.node]}]}
    affinity = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    }
    limits = {resource_of(pod.profile): "1"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod.name, "namespace": run.namespace, "labels": {"trace": "1"}},
        "spec": {
            "affinity": affinity,
            "automountServiceAccountToken": False,
            "containers": [{"name": "main", "image": "x", "resources": {"limits": limits}}],
        },
    }


def _delete_pod(api: Api, run: WayRun, pod: TracePod) -> None:
    try:
        api.request("DELETE", f"/api/v1/namespaces/{run.namespace}/pods/{pod.name}?gracePeriodSeconds=0")
    except ApiError as err:
        if err.status != 404:
            raise


def _bound(api: Api, run: WayRun) -> dict[str, str]:
    """pod name -> node, for the bound pods of the way's namespace."""
    listed = api.request("GET", f"/api/v1/namespaces/{run.namespace}/pods")
    return {
        p["metadata"]["name"]: p["spec"].get("nodeName", "")
        for p in listed["items"]
        if p["spec"].get("nodeName")
    }


def _allocated(api: Api, run: WayRun) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The devices of the way's pool allocated to claims (what the yardsticks sample), and those of
    the claims whose pod is bound: what the node's kubelet would have prepared, and so all the agent
    knows of (it reads no claim it has not prepared, `sharing.dra.frontend`)."""
    listed = api.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{run.namespace}/resourceclaims")
    bound = set(_bound(api, run))
    devices, prepared = [], []
    for claim in listed["items"]:
        results = claim.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
        mine = [r["device"] for r in results if r.get("pool") == run.node and r.get("driver") == DRIVER]
        devices += mine
        users = {r.get("name") for r in claim.get("status", {}).get("reservedFor", [])}
        if users & bound:
            prepared += mine
    return tuple(sorted(devices)), tuple(sorted(prepared))


def resource_of(profile: str) -> str:
    """The extended resource a trace pod asks for (the DeviceClass of the same name serves it on the
    DRA nodes)."""
    return "nvidia.com/gpu" if profile == tracesim.WHOLE else f"nvidia.com/mig-{profile}"


def run_trace(api: Api, pods: Sequence[TracePod], runs: Sequence[WayRun], unit_s: float = UNIT_S) -> None:
    """Play the trace on every way's node at once, on one clock."""
    by_name = {p.name: p for p in pods}
    releases: dict[str, list[tuple[float, int]]] = {r.label: [] for r in runs}
    arrivals = sorted(pods, key=lambda p: p.arrival)
    created = 0
    last = max(p.arrival + p.patience for p in pods)
    start = time.monotonic()
    next_sample = 0.0

    def now() -> float:
        return (time.monotonic() - start) / unit_s

    while True:
        t = now()
        while created < len(arrivals) and arrivals[created].arrival <= t:
            for run in runs:
                api.create(f"/api/v1/namespaces/{run.namespace}/pods", _pod_body(run, arrivals[created]))
            created += 1
        for run in runs:
            for name in _bound(api, run):
                pod = by_name[name]
                if pod.index not in run.placed and pod.index not in run.gone:
                    run.placed[pod.index] = now()
                    run.live[pod.index] = pod.profile
                    releases[run.label].append((run.placed[pod.index] + pod.lifetime, pod.index))
            due = [i for when, i in releases[run.label] if when <= t]
            releases[run.label] = [(w, i) for w, i in releases[run.label] if w > t]
            for index in due:
                _delete_pod(api, run, pods[index])
                run.live.pop(index, None)
                run.gone.add(index)
            for pod in arrivals[:created]:
                waiting = pod.index not in run.placed and pod.index not in run.gone
                if waiting and pod.arrival + pod.patience <= t:
                    _delete_pod(api, run, pod)
                    run.gone.add(pod.index)
            if run.way != "static":
                allocated, prepared = _allocated(api, run)
                run.allocated = allocated
                if prepared != run.prepared:
                    run.prepared = prepared
                    if run.way == "policy" and run.state is not None:
                        whole = tracesim.WHOLE in run.profiles
                        specs = ondemand_slices(
                            run.node, run.state, "policy", run.gpus, prepared, whole=whole
                        )
                        if specs != run.wanted:
                            _publish(run, specs)
        while next_sample <= t and next_sample <= last:
            for run in runs:
                run.sample(
                    p.profile
                    for p in arrivals[:created]
                    if p.index not in run.placed and p.index not in run.gone
                )
            next_sample += 1.0
        if t > last and created == len(arrivals):
            break
        time.sleep(TICK_S)
    for run in runs:  # leave nothing behind for the next seed's nodes
        for index in list(run.live):
            _delete_pod(api, run, pods[index])


def outcomes(pods: Sequence[TracePod], run: WayRun) -> list[Outcome]:
    return [Outcome(p, run.placed.get(p.index)) for p in pods]


def summary_of(pods: Sequence[TracePod], run: WayRun) -> tracesim.Summary:
    samples = tracesim.Samples(tuple(run.largest), tuple(run.stranded))
    return tracesim.summarize(outcomes(pods, run), samples, tracesim.biggest_g(run.gpus, pods), run.gpus)


# --- the part --------------------------------------------------------------------------------------


def _start_daemons(cp: lab.ControlPlane, bins: lab.Binaries) -> list[Process]:
    scheduler_kc = cp.user_kubeconfig("system:kube-scheduler")
    manager_kc = cp.user_kubeconfig("system:kube-controller-manager")
    config = cp.dir / "scheduler-config.yaml"
    config.write_text(SCHEDULER_CONFIG.format(kubeconfig=scheduler_kc))
    scheduler = Process(
        "kube-scheduler",
        [str(bins.kube_scheduler), f"--config={config}", f"--authentication-kubeconfig={scheduler_kc}",
         f"--authorization-kubeconfig={scheduler_kc}"],
        cp.dir / "scheduler.log",
    )  # fmt: skip
    manager = Process(
        "kube-controller-manager",
        [*components.controller_manager_args(bins, cp, manager_kc), CONTROLLERS],
        cp.dir / "controller-manager.log",
    )
    started = []
    for process in (scheduler, manager):
        process.start()
        started.append(process)
    return started


def _device_classes(cp: lab.ControlPlane, bins: lab.Binaries) -> None:
    rendered = subprocess.run(
        [str(bins.helm), "template", "x", str(CHART), "--set", "dra.enabled=true",
         "--show-only", "templates/deviceclasses.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cp.kubectl("apply", "-f", "-", input=rendered, check=True)


def _wait(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _scheduler_ready(api: Api, namespace: str, node: str) -> bool:
    """A probe pod on `node` is bound (the scheduler and its informers are up)."""
    try:
        pods = api.request("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
    except RuntimeError:
        return False
    return any(p["spec"].get("nodeName") == node for p in pods)


def shipped_presets(gpus: tracesim.Gpus, directory: Path = PRESETS) -> tuple[tracesim.Preset, ...]:
    """Every shipped preset as the device plugin would advertise it on this bench's node; presets
    that advertise the same there are one (`all-balanced` and `a100-mig-h100-time-sliced` on an A100)."""
    found = []
    names = sorted({p.name for p in gpus})
    for path in sorted(directory.glob("*.yaml")):
        for config in parse_config(path.stem, path.read_text(), products=names, catalog=CATALOG):
            found.append(tracesim.preset_on(config, gpus))
    if not found:
        raise RuntimeError(f"no presets in {directory}")
    return tracesim.merge_same(found)


@dataclass(frozen=True)
class Trace:
    """A trace to play: `tag` names its nodes and namespaces, `prefix` its figures."""

    tag: str
    prefix: str
    title: str
    pods: tuple[TracePod, ...]


def _ways(
    api: Api, kube: ApiClient, gpus: tracesim.Gpus, trace: Trace, results: Results
) -> tuple[list[WayRun], str]:
    """Each way's node (Ready, its allocatable or its pool) and namespace; the best preset's name."""
    pods = trace.pods
    profiles = sorted({p.profile for p in pods})
    layouts, predicted, tried = tracesim.best_static(gpus, pods)
    hindsight = tracesim.node_counts(layouts)
    results.note(
        f"trace {trace.title} hindsight layout",
        f"{tracesim.show_layouts(layouts)} (best of {tried} layouts of the {len(gpus)} GPUs by an offline "
        f"replay of the trace: {predicted.slice_seconds:.0f} slice-s, {predicted.served} pods offline)",
    )
    presets = shipped_presets(gpus)
    preset, offline_preset = tracesim.best_preset(gpus, pods, presets)
    ranking = sorted(
        ((tracesim.replay(gpus, "static", pods, p.counts), p.name) for p in presets),
        key=lambda t: (tracesim.better(t[0]), t[1]),
    )
    results.note(
        f"trace {trace.title} best preset",
        f"{preset.name}: {preset.show()} (best of {len(presets)} shipped presets by an offline replay of "
        f"the trace: {offline_preset.slice_seconds:.0f} slice-s, {offline_preset.served} pods; all: "
        + ", ".join(f"{name} {s.slice_seconds:.0f}/{s.served}" for s, name in ranking)
        + ")",
    )
    runs = []
    for label, way in WAYS:
        node = f"trace-{trace.tag}-{label}"
        counts = hindsight if label == "hindsight" else preset.counts if label == "preset" else {}
        _ready_node(api, node, {resource_of(p): str(n) for p, n in counts.items()})
        namespace = node
        api.create(
            "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
        run = WayRun(label, way, node, namespace, gpus, profiles, static=counts)
        if way != "static":
            run.state = ondemand_node(node, gpus)
            run.publisher = SlicePublisher(kube, node, DRIVER)
            _publish(run, ondemand_slices(node, run.state, way, gpus, whole=tracesim.WHOLE in profiles))
        runs.append(run)
    return runs, preset.name


def play(
    api: Api, kube: ApiClient, gpus: tracesim.Gpus, trace: Trace, results: Results, *, unit_s: float
) -> dict[str, tracesim.Summary]:
    """One trace on the four ways' nodes at once; each way's summary, its figures and notes."""
    pods = trace.pods
    say(f"trace {trace.title}: {len(pods)} pods ({tracesim.mix_counts(pods)}), {len(gpus)} GPUs")
    runs, preset = _ways(api, kube, gpus, trace, results)
    run_trace(api, pods, runs, unit_s)
    summaries = {}
    biggest = tracesim.biggest_g(gpus, pods)
    for run in runs:
        summary = summary_of(pods, run)
        offline = tracesim.replay(gpus, run.way, pods, run.static)
        summaries[run.label] = summary
        for key, value in (
            ("served", summary.served),
            ("slice_seconds", summary.slice_seconds),
            ("slice_share", summary.slice_share),
            ("stranded_share", summary.stranded_share),
            ("wait_mean", summary.wait_mean),
            ("wait_p95", summary.wait_p95),
            ("largest_mean_g", summary.largest_mean_g),
        ):
            if not math.isnan(value):
                results.add(f"{trace.prefix}_{run.label}_{key}", value)
        extra = f"; slices re-published {run.republished} times" if run.way == "policy" else ""
        extra += f"; preset {preset}" if run.label == "preset" else ""
        results.note(
            f"trace {trace.title} {run.label}",
            f"served {summary.served}/{len(pods)} pods, {summary.slice_seconds:.0f} slice-s "
            f"({summary.slice_share:.0%} of offered; offline replay: {offline.served} pods, "
            f"{offline.slice_seconds:.0f} slice-s), wait mean {summary.wait_mean:.1f} "
            f"p95 {summary.wait_p95:.1f} s "
            f"[{summary.show_waits()}], stranded {_share(summary.stranded_share)}, largest placeable mean "
            f"{summary.largest_mean_g:.2f}g ({biggest}g {summary.largest_7g_share:.0%} of samples; min per "
            f"10 s {tracesim.timeline(run.largest)}){extra}",
        )
    return summaries


def _share(value: float) -> str:
    return "n/a (no pod waited)" if math.isnan(value) else f"{value:.1%}"


def _ratios(
    prefix: str, tag: str, summaries: dict[str, tracesim.Summary], results: Results
) -> dict[str, float]:
    """The policy way against the others, recorded per trace and returned."""
    policy, preset, hindsight = summaries["policy"], summaries["preset"], summaries["hindsight"]
    ratios = {
        "slice_seconds_vs_static": policy.slice_seconds / max(1e-9, preset.slice_seconds),
        "slice_seconds_vs_hindsight": policy.slice_seconds / max(1e-9, hindsight.slice_seconds),
        "slice_seconds_vs_plain": policy.slice_seconds / max(1e-9, summaries["plain"].slice_seconds),
        "served_vs_static": policy.served / max(1, preset.served),
        "served_vs_hindsight": policy.served / max(1, hindsight.served),
        "served_vs_plain": policy.served / max(1, summaries["plain"].served),
    }
    for key, value in ratios.items():
        results.add(f"{prefix}_{key}", value)
        results.add(f"{prefix}_{tag}_{key}", value)  # per trace in --json
    for key, way in (("ondemand", policy), ("static", preset)):
        if not math.isnan(way.stranded_share):
            results.add(f"{prefix}_stranded_share_{key}", way.stranded_share)
    return ratios


def traces(
    gpus: tracesim.Gpus, kinds: Sequence[str], seeds: Sequence[int], pods: int, trace_file: Path | None
) -> list[Trace]:
    """The traces to play: each seed of each kind (`steady`, `shift`), then the file."""
    out = []
    for kind in kinds:
        for seed in seeds:
            spec = (
                TraceSpec(seed, pods) if kind == "steady" else TraceSpec.shifting(seed, pods * SHIFT_LENGTH)
            )
            say(f"trace {kind} {spec.describe()}")
            prefix = "trace" if kind == "steady" else "trace_shift"
            out.append(
                Trace(f"{kind}-{seed}", prefix, f"{kind} seed {seed}", tracesim.generate(spec, gpus[0]))
            )
    if trace_file is not None:
        out.append(
            Trace("file", "trace_file", f"file {trace_file.name}", tracesim.read_trace(trace_file, gpus))
        )
    return out


def _offline(gpus: tracesim.Gpus, pods: int, results: Results) -> None:
    """The policy, a placement drawn at random and best fit across the GPUs against plain order,
    offline, over many seeds."""
    for kind, prefix in (("steady", "trace"), ("shift", "trace_shift")):
        specs = [
            TraceSpec(s, pods) if kind == "steady" else TraceSpec.shifting(s, pods * SHIFT_LENGTH)
            for s in OFFLINE_SEEDS
        ]
        for way in ("policy", "random", "bestfit"):
            against = tracesim.vs_plain(gpus, way, specs)
            results.add(f"{prefix}_offline_{way}_vs_plain_mean", against.mean)
            results.add(f"{prefix}_offline_{way}_vs_plain_slice_mean", against.slice_mean)
            results.note(
                f"{prefix} offline {way}/plain, seeds {OFFLINE_SEEDS[0]}-{OFFLINE_SEEDS[-1]}",
                f"pods: mean {against.mean:.3f}, worst {against.worst:.2f}, fewer on {against.losing}; "
                f"slice-s: mean {against.slice_mean:.3f}, worst {against.slice_worst:.2f}, "
                f"fewer on {against.slice_losing} of {len(specs)} seeds",
            )


def bench_trace(
    tmp: Path,
    results: Results,
    plays: Sequence[Trace],
    gpus: tracesim.Gpus,
    *,
    unit_s: float = UNIT_S,
    offline_pods: int = 120,
) -> None:
    names = ", ".join(f"{n}x {p.name}" for p, n in Counter(gpus).items())
    say(f"trace: {len(plays)} traces on {names}; 1 trace second = {unit_s} s")
    bins = lab.binaries()
    with lab.ControlPlane(base_dir=tmp, bins=bins) as cp:
        daemons = _start_daemons(cp, bins)
        api = Api(cp.server, cp.dir)
        kube = ApiClient(str(cp.kubeconfig))
        try:
            _device_classes(cp, bins)
            api.create(
                "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "probe"}}
            )
            _ready_node(api, "trace-probe", {})
            probe = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "probe", "namespace": "probe"},
                "spec": {"automountServiceAccountToken": False, "containers": [{"name": "m", "image": "x"}]},
            }
            api.create("/api/v1/namespaces/probe/pods", probe)
            _wait("the scheduler", lambda: _scheduler_ready(api, "probe", "trace-probe"))
            api.request("PATCH", "/api/v1/nodes/trace-probe", {"spec": {"unschedulable": True}})
            per_prefix: dict[str, list[dict[str, float]]] = {}
            for trace in plays:
                summaries = play(api, kube, gpus, trace, results, unit_s=unit_s)
                per_prefix.setdefault(trace.prefix, []).append(
                    _ratios(trace.prefix, trace.tag, summaries, results)
                )
            for prefix, rows in per_prefix.items():
                for key in ("slice_seconds_vs_static", "served_vs_static", "slice_seconds_vs_hindsight"):
                    results.add(f"{prefix}_{key}_min", min(r[key] for r in rows))
                    results.note(f"{prefix} {key} per trace", ", ".join(f"{r[key]:.2f}" for r in rows))
            _offline(gpus, offline_pods, results)
        finally:
            api.close()
            kube.close()
            for process in reversed(daemons):
                process.stop()
