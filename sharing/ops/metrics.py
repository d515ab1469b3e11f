"""Prometheus metrics of the agent, named as Prometheus asks (`gpu_sharing_…`, base units, `_total`).

Two kinds: events the agent counts as they happen (reconciles, applies, claim prepares and each MIG
operation on the driver timed, hardware steps, changes by outcome, XIDs), and the node's state, read
at scrape time from the same status document `sharing status` prints (slices advertised and
allocated per resource, which pod holds which slice, GPU health, the config state, the plugins
registered, and what the usage sampler last read: per GPU, per MIG device, per held slice for its own
pod, and what no pod accounts for), so metrics and status never disagree.
docs/metrics.md lists every metric.
"""

from __future__ import annotations

import datetime
from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sharing.gpu import MIG_OPERATIONS
from sharing.labels import ConfigState

PREFIX = "gpu_sharing_"
POD_METRICS = tuple(
    PREFIX + name
    for name in (
        "slice_owner_info", "slice_memory_used_bytes", "slice_memory_total_bytes", "slice_sm_active_ratio",
        "slice_idle_seconds", "slice_idle", "slice_memory_peak_bytes", "slice_sm_active_p95_ratio",
        "slice_rightsize_info",
    )
)  # fmt: skip
"""The metrics that name the pod holding a slice (left out of /metrics but on localhost with
`holders_localhost_only`)."""
_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The agent's registry; `render()` gives the text format."""

    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry()
        self.reconcile_seconds = Histogram(
            PREFIX + "reconcile_duration_seconds",
            "Time of one reconcile: select, roll out, advertise, label.",
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.apply_seconds = Histogram(
            PREFIX + "apply_duration_seconds",
            "Time of the hardware part of a change: withdraw, steps, re-observe.",
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.steps = Counter(
            PREFIX + "hardware_steps",
            "MIG steps run on the GPUs (enable/disable MIG, create, destroy, complete), by result.",
            ["kind", "result"],
            registry=self.registry,
        )
        self.changes = Counter(
            PREFIX + "config_changes",
            "Outcomes of reconciles that had something to say: applied, failed, blocked, rejected.",
            ["outcome"],
            registry=self.registry,
        )
        self.xids = Counter(
            PREFIX + "xid_errors", "Critical XID errors the driver reported, by GPU.", ["gpu", "xid"],
            registry=self.registry,
        )  # fmt: skip
        self.dra_prepared_claims = Gauge(
            PREFIX + "dra_prepared_claims",
            "ResourceClaims prepared on the node by the DRA front-end (in its checkpoint).",
            registry=self.registry,
        )
        self.dra_prepare_seconds = Histogram(
            PREFIX + "dra_prepare_duration_seconds",
            "Time of one claim's NodePrepareResources, failed or not: read the claim, CDI spec, checkpoint; "
            "by the MIG profile of its devices and whether the prepare made them.",
            ["profile", "ondemand"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.mig_operation_seconds = Histogram(
            PREFIX + "mig_operation_seconds",
            "Time of one NVML call that changes MIG (mode, GPU and compute instances), failed or not.",
            ["operation"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        for operation in MIG_OPERATIONS:  # every series from the start: an empty one reads 0, not absent
            self.mig_operation_seconds.labels(operation=operation)
        Info(PREFIX + "build", "The agent's version.", registry=self.registry).info({"version": version})
        self._state = _State()
        self.registry.register(self._state)

    def snapshot(self, status: Mapping[str, Any], plugins: Iterable[tuple[str, bool]]) -> None:
        """The node's state for the next scrape (the status document and plugin registrations)."""
        self._state.status = status
        self._state.plugins = tuple(plugins)

    def prepared_claims(self, count: int) -> None:
        """The DRA front-end's claims prepared now (a `sharing.dra.Recorder`)."""
        self.dra_prepared_claims.set(count)

    def prepare_seconds(self, seconds: float, profile: str, ondemand: bool) -> None:
        """The time of one claim's prepare, by its devices' profile (a `sharing.dra.Recorder`)."""
        self.dra_prepare_seconds.labels(profile=profile, ondemand=str(ondemand).lower()).observe(seconds)

    def mig_operation(self, operation: str, seconds: float) -> None:
        """The time of one MIG operation on the driver (the GPU backend's `MigSeconds`; any thread)."""
        self.mig_operation_seconds.labels(operation=operation).observe(seconds)

    def render(self) -> bytes:
        """The text exposition format (blocking: call it off the event loop)."""
        return bytes(generate_latest(self.registry))


class _State(Collector):
    """Gauges computed at scrape time from the latest status document."""

    def __init__(self) -> None:
        self.status: Mapping[str, Any] = {}
        self.plugins: tuple[tuple[str, bool], ...] = ()

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        status = self.status
        gpus = status.get("gpus", [])
        # The instances made for claims on dynamic GPUs are slices of `sharing status`, not devices
        # advertised to the kubelet: they count in the DRA gauges, not here.
        slices = [s for g in gpus for s in g["slices"] if not s.get("onDemand")]
        advertised, allocated = (
            Tally(s["resource"] for s in slices),
            Tally(s["resource"] for s in slices if s["pod"]),
        )
        yield _gauge(
            "slices_advertised", "Slices (devices and replicas) advertised to the kubelet.", ["resource"],
            ((([r], n) for r, n in sorted(advertised.items()))),
        )  # fmt: skip
        yield _gauge(
            "slices_allocated", "Slices a pod holds (per the kubelet's PodResources).", ["resource"],
            (([r], allocated.get(r, 0)) for r in sorted(advertised)),
        )  # fmt: skip
        yield _gauge(
            "slice_owner_info", "Which pod holds which slice (value 1).",
            ["namespace", "pod", "container", "resource", "device"],
            (
                ([s["pod"]["namespace"], s["pod"]["pod"], s["pod"]["container"], s["resource"], s["id"]], 1)
                for s in slices
                if s["pod"]
            ),
        )  # fmt: skip
        yield _gauge(
            "gpu_healthy", "1 when the GPU is healthy, 0 after a critical XID until it recovers.",
            ["gpu", "uuid", "product"],
            (([str(g["index"]), g["uuid"], g["product"]], int(g["health"] == "Healthy")) for g in gpus),
        )  # fmt: skip
        state = status.get("config", {}).get("state")
        yield _gauge(
            "config_state", "The node's reconfiguration state (mig.config.state label), 1 for the current.",
            ["state"], (([s.value], int(s.value == state)) for s in ConfigState),
        )  # fmt: skip
        config = status.get("config", {})
        yield _gauge(
            "config_info", "The config the node selects and the configs in effect on its GPUs (value 1).",
            ["selected", "in_effect"],
            [([config.get("selected") or "", ",".join(config.get("inEffect", []))], 1)] if status else [],
        )  # fmt: skip
        yield _gauge(
            "config_warnings", "Warnings of each config of the ConfigMaps (the agent's log lists them).",
            ["config"], (([c], n) for c, n in config.get("warningsPerConfig", {}).items()),
        )  # fmt: skip
        rooms = [(g, g["room"]) for g in gpus if g.get("room")]
        labels = ["gpu", "uuid"]
        yield _gauge(
            "dynamic_gpu_largest_placeable_compute_slices",
            "Compute slices of the largest MIG profile a dynamic GPU still has a free placement for.",
            labels, (([str(g["index"]), g["uuid"]], r["largestComputeSlices"]) for g, r in rooms),
        )  # fmt: skip
        yield _gauge(
            "dynamic_gpu_largest_placeable_info",
            "The largest MIG profile a dynamic GPU still has a free placement for (value 1).",
            [*labels, "profile"],
            (([str(g["index"]), g["uuid"], r["largestProfile"]], 1) for g, r in rooms if r["largestProfile"]),
        )  # fmt: skip
        yield _gauge(
            "dynamic_gpu_free_compute_slices", "Compute slices of a dynamic GPU no MIG instance uses.",
            labels, (([str(g["index"]), g["uuid"]], r["freeComputeSlices"]) for g, r in rooms),
        )  # fmt: skip
        yield _gauge(
            "dynamic_gpu_stranded_compute_slices",
            "Free compute slices of a dynamic GPU that no placement can use, given where its instances are.",
            labels, (([str(g["index"]), g["uuid"]], r["strandedComputeSlices"]) for g, r in rooms),
        )  # fmt: skip
        # One series per daemon: a GPU's (uuid: the GPU's), or an on-demand MIG device's a claim
        # shares with MPS (uuid: the MIG device's, gpu: its GPU's index).
        daemons = [(str(g["index"]), g["uuid"], g["mps"]) for g in gpus if g.get("mps")] + [
            (str(g["index"]), s["id"], s["mps"]) for g in gpus for s in g["slices"] if s.get("mps")
        ]
        labels = ["gpu", "uuid"]
        yield _gauge(
            "mps_daemon_healthy", "1 when the MPS control daemon answers with the wanted limits.",
            labels, (([i, u], int(d["healthy"])) for i, u, d in daemons),
        )  # fmt: skip
        yield _gauge(
            "mps_active_thread_percentage", "Each MPS client's default active thread percentage.",
            labels, (([i, u], d["activeThreadPercentage"]) for i, u, d in daemons),
        )  # fmt: skip
        yield _gauge(
            "mps_pinned_memory_limit_bytes",
            "Each MPS client's default pinned device memory.",
            labels, (([i, u], d["pinnedMemoryMiB"] * 2**20) for i, u, d in daemons),
        )  # fmt: skip
        restarts = CounterMetricFamily(
            PREFIX + "mps_daemon_restarts", "MPS control daemons started again after they stopped answering.",
            labels=labels,
        )  # fmt: skip
        for i, u, d in daemons:
            restarts.add_metric([i, u], d["restarts"])
        yield restarts
        yield _gauge(
            "plugin_registered", "1 when the resource's device plugin is registered with the kubelet.",
            ["resource"], (([r], int(ok)) for r, ok in self.plugins),
        )  # fmt: skip
        yield from _usage(status, gpus, slices)


USAGE_GPU = (
    ("gpu_power_watts", "powerWatts", "The GPU's power draw."),
    ("gpu_temperature_celsius", "temperatureCelsius", "The GPU's die temperature."),
    ("gpu_memory_used_bytes", "memoryUsedBytes", "Device memory allocated on the GPU."),
    ("gpu_memory_total_bytes", "memoryTotalBytes", "The GPU's device memory."),
    (
        "gpu_utilization_ratio",
        "utilization",
        "Share of the last sample period a kernel ran (GPUs without MIG).",
    ),
)
USAGE_MIG = (
    ("mig_device_memory_used_bytes", "memoryUsedBytes", "Memory used on the MIG device."),
    ("mig_device_memory_total_bytes", "memoryTotalBytes", "The MIG device's memory."),
    (
        "mig_device_sm_active_ratio",
        "smActive",
        "Share of its GPU instance's SMs busy (GPM; Hopper and newer).",
    ),
    (
        "mig_device_graphics_active_ratio",
        "graphicsActive",
        "Share of time its GPU instance's engines were busy (GPM).",
    ),
)
USAGE_SLICE = (
    ("slice_memory_used_bytes", "memoryUsedBytes",
     "Device memory its holding pod's own processes use on the slice."),
    ("slice_memory_total_bytes", "memoryTotalBytes",
     "The memory the slice offers: its MIG device's, its GPU's, or an MPS client's pinned limit."),
    ("slice_sm_active_ratio", "smActive",
     "Share of the device's SMs its pod's processes used (GPUs without MIG), or its MIG device's GPM "
     "activity (a MIG device held whole, Hopper and newer)."),
    ("slice_idle_seconds", "idleSeconds",
     "Seconds since a process of its holding pod last ran on the slice."),
    ("slice_memory_peak_bytes", "peakMemoryBytes",
     "The most memory its pod used on it over the usage window."),
    ("slice_sm_active_p95_ratio", "smActiveP95",
     "The p95 of its SM share over the usage window (5 % bins, upper edge)."),
)  # fmt: skip
"""(metric, key of the status document's usage part, help) per GPU, per MIG device, per held slice."""


def _usage(
    status: Mapping[str, Any], gpus: list[dict[str, Any]], slices: list[dict[str, Any]]
) -> Iterable[GaugeMetricFamily]:
    """The usage sampler's figures in the status document (`sharing.ops.usage`); a figure NVML
    cannot give (utilization in MIG mode, SM of a replica of a MIG device) has no series."""
    sampled = (status.get("usage") or {}).get("sampledAt")
    yield _gauge(
        "usage_last_sample_timestamp_seconds", "Unix time of the usage sampler's last sample.", [],
        [([], _timestamp(sampled))] if sampled else [],
    )  # fmt: skip
    read = [(g, g["usage"]) for g in gpus if g.get("usage")]
    per_gpu = [([str(g["index"]), g["uuid"]], u) for g, u in read]
    per_mig = [([str(g["index"]), g["uuid"], d["uuid"]], d) for g, u in read for d in u["devices"]]
    per_slice = [(_holder(s), s["usage"]) for s in slices if s.get("usage")]
    for rows, labels, metrics in (
        (per_gpu, ["gpu", "uuid"], USAGE_GPU),
        (per_mig, ["gpu", "uuid", "device"], USAGE_MIG),
        (per_slice, ["resource", "device", "namespace", "pod", "container"], USAGE_SLICE),
    ):
        for name, key, documentation in metrics:
            yield _gauge(name, documentation, labels, ((v, u[key]) for v, u in rows if u[key] is not None))
    slice_labels = ["resource", "device", "namespace", "pod", "container"]
    yield _gauge(
        "slice_idle", "1 when no process of its holding pod ran on the slice for usage.idleAfter, else 0.",
        slice_labels, ((v, int(u["idle"])) for v, u in per_slice),
    )  # fmt: skip
    sized = [(v, u["rightSize"]) for v, u in per_slice if u["rightSize"] and u["rightSize"]["profile"]]
    yield _gauge(
        "slice_rightsize_info",
        "The smallest MIG profile of its GPU that holds the slice's peak memory with 10 % headroom (and its "
        "SM p95 where known: basis memory+sm), value 1; no series where no profile does.",
        ["profile", "basis", *slice_labels], (([r["profile"], r["basis"], *v], 1) for v, r in sized),
    )  # fmt: skip
    unattributed = [([str(g["index"]), g["uuid"], x["device"]], x["memoryUsedBytes"]) for g, u in read
                    for x in u["unattributed"]]  # fmt: skip
    yield _gauge(
        "unattributed_memory_used_bytes",
        "Memory used on a device by processes no slice's holding pod accounts for.",
        ["gpu", "uuid", "device"], unattributed,
    )  # fmt: skip


def _holder(entry: Mapping[str, Any]) -> list[str]:
    """resource, device, namespace, pod, container of a held slice (a DRA claim's pods: joined)."""
    if entry["pod"]:
        pod = entry["pod"]
        return [entry["resource"], entry["id"], pod["namespace"], pod["pod"], pod["container"]]
    pods = [p.split("/", 1) for p in entry["usage"]["pods"]]
    return [entry["resource"], entry["id"], pods[0][0], ",".join(name for _, name in pods), ""]


def _timestamp(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _gauge(
    name: str, documentation: str, labels: list[str], samples: Iterable[tuple[list[str], float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, documentation, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family
