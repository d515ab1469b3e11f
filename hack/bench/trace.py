"""A seeded workload trace on four simulated A100-40GB, run three ways through the real kube-scheduler.

One control plane (etcd + kube-apiserver), kube-scheduler (default profile: DynamicResources and
NodeResourcesFit; backoff capped at 1 s so a retry is not mistaken for a wait) and
kube-controller-manager's resourceclaim and garbage-collector controllers (they free the claim of a
deleted pod, as on a real cluster). No kubelet: a pod counts as served when the scheduler binds it.
Four Ready Node objects, one per way, each with four A100-SXM4-40GB:

- ``preset``: the device-plugin front-end with the best shipped preset (profiles/*.yaml, written by
  hack/gen-presets.py) for the trace. Each preset is resolved for four A100-SXM4-40GB
  (`tracesim.preset_on`) and the one serving the most pods in an offline replay of the trace wins
  (`tracesim.best_preset`: the best preset in hindsight, among presets). The node advertises what
  that preset's device plugin would: `nvidia.com/mig-<profile>` per pre-made instance,
  `nvidia.com/gpu` per whole GPU. A pod asking for a profile the preset lacks stays Pending until
  its patience ends (no preset has `7g.40gb`; a whole GPU of all-disabled would serve such a pod
  only if it asked for `nvidia.com/gpu`, and the trace's pods keep their one spec).
- ``hindsight``: the same front-end with the best static layout for the trace, found by replaying
  the trace offline over every combination of the maximal per-GPU layouts the catalog's placements
  allow (`tracesim.best_static`: most pods served, then lowest mean wait). No operator can choose
  it ahead: it is an upper bound for any static layout, shipped or not.
- ``policy``: on-demand, the agent's own pool: `sharing.dra.partitions.partitionable_slices` (a
  counter set per GPU, one device per profile x placement consuming its memory slices, each GPU's
  devices in `sharing.mig.policy.ranked` order), built again with the allocated devices and
  published by the agent's `SlicePublisher` each time the allocations change.
- ``plain``: the same devices with each GPU's in plain placement order (`sharing.mig.policy.plain`:
  profile, then lowest start), as NVIDIA's driver lists them, published once.

Why the order decides: the scheduler's allocator walks the pools, each pool's slices (by name) and
each slice's devices in order and allocates the first device that matches and fits (`allocateOne`
in k8s.io/dynamic-resource-allocation@v0.36.3 structured/internal/incubating/allocator_incubating.go;
`sharing.mig.policy` cites the lines); it has no scoring among the devices of one node.

Every pod asks for `nvidia.com/mig-<profile>: 1` in its limits (the same spec all three ways; on
the DRA nodes the DeviceClass's extendedResourceName turns it into a claim). One simulated unit is
`UNIT_S` real seconds. Each trace pod is created on the three nodes at its arrival; a bound pod is
force-deleted after its lifetime, an unbound one when its patience ends (withdrawn, not served).
Per way: pods served, mean and p95 wait (units), and the largest profile still placeable, sampled
once a unit (static: the largest free pre-made instance; on-demand: the largest profile with a free
placement on some GPU given the allocated claims).

Two yardsticks beside the figures. ``trace_served_vs_static_bound``: all of a trace's pods over those
the best preset serves, the most that any way could reach against it on that trace. And an offline
replay of seeds 1-40 (``tracesim.vs_plain``, no scheduler): the policy and a placement drawn at random,
each against plain order, which shows how far the order alone moves the pods served beyond the
noise of the trace itself.
"""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lab
from lab import components
from lab.process import Process

from bench import tracesim
from bench.clients import Api
from bench.report import Results, say
from bench.tracesim import Outcome, TracePod, TraceSpec
from sharing.config import parse_config
from sharing.dra.names import DRIVER, parse_ondemand_name, profile_slug
from sharing.dra.partitions import partitionable_slices
from sharing.dra.placements import named
from sharing.kube import ApiClient
from sharing.kube.api import SliceDevice, SliceSpec
from sharing.kube.resourceslices import SlicePublisher
from sharing.mig import default_catalog, policy
from sharing.mig.catalog import Product
from sharing.model import DriverInfo, Gpu, GpuUuid, NodeState

PRODUCT = "A100-SXM4-40GB"
CATALOG = default_catalog()
NVML_NAME = "NVIDIA A100-SXM4-40GB"
GPUS = 4
UNIT_S = 0.5
TICK_S = 0.1
DEFAULT_SEEDS = (1, 2, 3)
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


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def occupancy(product: Product, devices: Iterable[str]) -> list[int]:
    """Each GPU's mask of used slots, from the allocated on-demand device names."""
    slugs = {profile_slug(p.name): p for p in product.profiles}
    masks = [0] * GPUS
    for name in devices:
        parsed = parse_ondemand_name(name)
        if parsed is None or parsed[1] not in slugs:
            continue
        gpu, slug, start = parsed
        masks[gpu] |= _mask(start, slugs[slug].size)
    return masks


def ondemand_node(node: str, product: Product) -> NodeState:
    """Four A100-SXM4-40GB in MIG mode with no instances, their geometry from the catalog."""
    gpus = tuple(
        Gpu(index, GpuUuid(f"GPU-{node}-{index}"), NVML_NAME, product.memory_mib, True, True, True, (),
            compute_capability=(8, 0), minor=index, pci_bus_id=f"0000:{index + 16:02x}:00.0", brand="Nvidia",
            profiles=product)
        for index in range(GPUS)
    )  # fmt: skip
    return NodeState(gpus, driver=DriverInfo("550.107.02", 12040))


def plain_order(specs: Sequence[SliceSpec], product: Product) -> tuple[SliceSpec, ...]:
    """The same slices with each one's devices in plain placement order (`policy.plain`)."""
    slugs = named(product)
    rank = {(r.placement.profile, r.placement.start): n for n, r in enumerate(policy.plain(product, ()))}

    def key(device: SliceDevice) -> int:
        parsed = parse_ondemand_name(device.name)
        if parsed is None or parsed[1] not in slugs:
            return -1  # a whole-GPU device first, as NVIDIA's driver lists it
        return rank[(slugs[parsed[1]].name, parsed[2])]

    return tuple(replace(s, devices=tuple(sorted(s.devices, key=key))) for s in specs)


def ondemand_slices(
    node: str, state: NodeState, way: str, product: Product, allocated: Iterable[str] = ()
) -> tuple[SliceSpec, ...]:
    """The pool the agent would publish for the way: policy order given `allocated`, or plain order."""
    dynamic = {g.uuid for g in state.gpus}
    specs = partitionable_slices(node, state, dynamic, CATALOG, allocated=allocated)
    return specs if way == "policy" else plain_order(specs, product)


# --- the cluster -----------------------------------------------------------------------------------


@dataclass
class WayRun:
    """One way's node and what happened on it."""

    label: str
    way: tracesim.Way
    node: str
    namespace: str
    product: Product
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
    samples: list[int] = field(default_factory=list)
    republished: int = 0


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
    limits = {f"nvidia.com/mig-{pod.profile}": "1"}
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
    except RuntimeError as err:
        if "HTTP 404" not in str(err):
            raise


def _bound(api: Api, run: WayRun) -> dict[str, str]:
    """pod name -> node, for the bound pods of the way's namespace."""
    listed = api.request("GET", f"/api/v1/namespaces/{run.namespace}/pods")
    return {
        p["metadata"]["name"]: p["spec"].get("nodeName", "")
        for p in listed["items"]
        if p["spec"].get("nodeName")
    }


def _allocated(api: Api, run: WayRun) -> tuple[str, ...]:
    listed = api.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{run.namespace}/resourceclaims")
    devices = []
    for claim in listed["items"]:
        results = claim.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
        devices += [r["device"] for r in results if r.get("pool") == run.node and r.get("driver") == DRIVER]
    return tuple(sorted(devices))


def _largest(run: WayRun) -> int:
    if run.way == "static":
        free = dict(run.static)
        for profile in run.live.values():
            free[profile] = free.get(profile, 0) - 1
        top = tracesim.largest_free_count(free, run.product)
    else:
        top = tracesim.largest_placeable(run.product, occupancy(run.product, run.allocated), run.profiles)
    return 0 if top is None else top.compute_slices


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
                allocated = _allocated(api, run)
                if allocated != run.allocated:
                    run.allocated = allocated
                    if run.way == "policy" and run.state is not None:
                        specs = ondemand_slices(run.node, run.state, "policy", run.product, allocated)
                        if specs != run.wanted:
                            _publish(run, specs)
        while next_sample <= t and next_sample <= last:
            for run in runs:
                run.samples.append(_largest(run))
            next_sample += 1.0
        if t > last and created == len(arrivals):
            break
        time.sleep(TICK_S)
    for run in runs:  # leave nothing behind for the next seed's nodes
        for index in list(run.live):
            _delete_pod(api, run, pods[index])


def outcomes(pods: Sequence[TracePod], run: WayRun) -> list[Outcome]:
    return [Outcome(p, run.placed.get(p.index)) for p in pods]


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


def shipped_presets(product: Product, directory: Path = PRESETS) -> tuple[tracesim.Preset, ...]:
    """Every shipped preset as the device plugin would advertise it on this bench's node; presets
    that advertise the same there are one (`all-balanced` and `a100-mig-h100-time-sliced` on an A100)."""
    found = []
    for path in sorted(directory.glob("*.yaml")):
        for config in parse_config(path.stem, path.read_text(), products=[product.name], catalog=CATALOG):
            found.append(tracesim.preset_on(config, product, GPUS))
    if not found:
        raise RuntimeError(f"no presets in {directory}")
    return tracesim.merge_same(found)


def trace_seed(
    api: Api, kube: ApiClient, product: Product, spec: TraceSpec, results: Results, *, unit_s: float = UNIT_S
) -> dict[str, tracesim.Summary]:
    seed = spec.seed
    pods = tracesim.generate(spec)
    profiles = sorted({p.profile for p in pods})
    say(f"trace {spec.describe()}; drawn: {tracesim.mix_counts(pods)}")
    layouts, predicted, tried = tracesim.best_static(product, GPUS, pods)
    hindsight = tracesim.node_counts(layouts)
    results.note(
        f"trace seed {seed} hindsight layout",
        f"{tracesim.show_layouts(layouts)} (best of {tried} layouts of {GPUS} GPUs by an offline replay of "
        f"the trace: {predicted.served} served offline)",
    )
    presets = shipped_presets(product)
    preset, offline_preset = tracesim.best_preset(product, GPUS, pods, presets)
    ranking = sorted(
        ((tracesim.replay(product, GPUS, "static", pods, p.mig_counts).served, p.name) for p in presets),
        key=lambda t: (-t[0], t[1]),
    )
    results.note(
        f"trace seed {seed} best preset",
        f"{preset.name}: {preset.show()} (best of {len(presets)} shipped presets by an offline replay of "
        f"the trace: {offline_preset.served} served offline; all: "
        + ", ".join(f"{name} {served}" for served, name in ranking)
        + ")",
    )
    runs = []
    for label, way in WAYS:
        node = f"trace-{seed}-{label}"
        if label == "hindsight":
            counts = hindsight
            allocatable = {f"nvidia.com/mig-{p}": str(n) for p, n in counts.items()}
        elif label == "preset":
            counts = preset.mig_counts
            allocatable = {k: str(n) for k, n in preset.resources.items()}
        else:
            counts, allocatable = {}, {}
        _ready_node(api, node, allocatable)
        namespace = f"trace-{seed}-{label}"
        api.create(
            "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
        run = WayRun(label, way, node, namespace, product, profiles, static=counts)
        if way != "static":
            run.state = ondemand_node(node, product)
            run.publisher = SlicePublisher(kube, node, DRIVER)
            _publish(run, ondemand_slices(node, run.state, way, product))
        runs.append(run)
    run_trace(api, pods, runs, unit_s)
    summaries = {}
    biggest = max(product.require_profile(p).compute_slices for p in profiles)
    for run in runs:
        summary = tracesim.summarize(outcomes(pods, run), run.samples, biggest, product)
        offline = tracesim.replay(product, GPUS, run.way, pods, run.static)
        summaries[run.label] = summary
        for key, value in (
            ("served", summary.served),
            ("served_g", summary.served_g),
            ("wait_mean", summary.wait_mean),
            ("wait_p95", summary.wait_p95),
            ("largest_mean_g", summary.largest_mean_g),
            ("largest_7g_share", summary.largest_7g_share),
        ):
            if not math.isnan(value):
                results.add(f"trace_{run.label}_{key}", value)
        extra = f"; slices re-published {run.republished} times" if run.way == "policy" else ""
        extra += f"; preset {preset.name}" if run.label == "preset" else ""
        results.note(
            f"trace seed {seed} {run.label}",
            f"served {summary.served}/{len(pods)} ({summary.served_g}g in all; offline replay: "
            f"{offline.served}), wait mean {summary.wait_mean:.2f} p95 {summary.wait_p95:.2f} units, "
            f"largest placeable mean {summary.largest_mean_g:.2f}g, {biggest}g placeable "
            f"{summary.largest_7g_share:.0%} of samples, "
            f"over time (g, min per 10 units) {tracesim.timeline(run.samples)}{extra}",
        )
    return summaries


def bench_trace(
    tmp: Path,
    results: Results,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    pods: int = 120,
    unit_s: float = UNIT_S,
) -> None:
    product = CATALOG.product(PRODUCT)
    say(f"trace: seeds {', '.join(map(str, seeds))}; {GPUS} x {PRODUCT}; 1 unit = {unit_s} s")
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
            vs_static, vs_hindsight, vs_plain = [], [], []
            for seed in seeds:
                summary = trace_seed(api, kube, product, TraceSpec(seed, pods=pods), results, unit_s=unit_s)
                vs_static.append(summary["policy"].served / max(1, summary["preset"].served))
                vs_hindsight.append(summary["policy"].served / max(1, summary["hindsight"].served))
                vs_plain.append(summary["policy"].served / max(1, summary["plain"].served))
                results.add("trace_served_vs_static_bound", pods / max(1, summary["preset"].served))
                results.add("trace_served_vs_static", vs_static[-1])
                results.add("trace_served_vs_hindsight_static", vs_hindsight[-1])
                for key, value in (("static", vs_static[-1]), ("hindsight_static", vs_hindsight[-1])):
                    results.add(f"trace_seed{seed}_served_vs_{key}", value)  # per seed in --json
            results.add("trace_served_vs_plain_min", min(vs_plain))
            results.add("trace_seeds", len(seeds))
            results.note("trace policy/best preset per seed", ", ".join(f"{v:.2f}" for v in vs_static))
            results.note(
                "trace policy/hindsight static per seed", ", ".join(f"{v:.2f}" for v in vs_hindsight)
            )
            results.note("trace policy/plain per seed", ", ".join(f"{v:.2f}" for v in vs_plain))
            offline = [TraceSpec(s, pods=pods) for s in OFFLINE_SEEDS]
            for way in ("policy", "random"):
                against = tracesim.vs_plain(product, GPUS, way, offline)
                results.add(f"trace_offline_{way}_vs_plain_mean", against.mean)
                results.note(
                    f"trace offline {way}/plain, seeds {OFFLINE_SEEDS[0]}-{OFFLINE_SEEDS[-1]}",
                    f"mean {against.mean:.3f}, worst {against.worst:.2f}, fewer pods than plain order on "
                    f"{against.losing} of {len(offline)} seeds",
                )
        finally:
            api.close()
            kube.close()
            for process in reversed(daemons):
                process.stop()
