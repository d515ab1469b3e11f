"""Where people read what the slices do: the status document, the metrics and `sharing status --usage`."""

from __future__ import annotations

from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families

from sharing.cli.status import describe
from sharing.deviceplugin.fleet import Fleet
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.mig import default_catalog
from sharing.model import Gpu, GpuUuid, Holding, MigUuid, NodeState
from sharing.ops import ConfigStatus, Metrics, status_document
from sharing.ops.http import Request
from sharing.ops.report import Reporter
from sharing.readings import DeviceReading, GpuReading, NodeReadings, ProcessReading
from sharing.rollout import Rollout
from sharing.usage import attribute, held_slices
from sharing.usage.attribute import Pod
from sharing.usage.cgroup import PodProcess
from sharing.usage.report import summarise
from sharing.usage.window import History, record

GIB = 1 << 30
GPU, MIG_GPU, MIG = "GPU-t4", "GPU-a100", "MIG-1g"
SHARED, MIG_RESOURCE = "nvidia.com/gpu.shared", "nvidia.com/mig-1g.5gb"
T0 = 1_767_000_000.0
NODE = NodeState(
    (
        Gpu(0, GpuUuid(GPU), "Tesla T4", 15360, False, False, False),
        Gpu(1, GpuUuid(MIG_GPU), "NVIDIA A100-SXM4-40GB", 40960, True, True, True),
    )
)
INVENTORY = Inventory(
    (
        (
            ResourceName(MIG_RESOURCE),
            (Device(DeviceId(MIG), Health.HEALTHY, None, GpuUuid(MIG_GPU), MigUuid(MIG)),),
        ),
        (
            ResourceName(SHARED),
            tuple(
                Device(DeviceId(f"{GPU}::{i}"), Health.HEALTHY, None, GpuUuid(GPU), None, i) for i in range(3)
            ),
        ),
    )
)
HOLDERS = (
    Holding("ml", "a", "main", SHARED, frozenset({f"{GPU}::0"})),
    Holding("ml", "b", "main", SHARED, frozenset({f"{GPU}::1"})),
    Holding("ml", "c", "main", MIG_RESOURCE, frozenset({MIG})),
)
T4_PROCESSES = (
    ProcessReading(10, 4 * GIB, 0.6),
    ProcessReading(20, 2 * GIB, 0.2),
    ProcessReading(99, GIB, 0.0),
)
READINGS = NodeReadings(
    T0,
    (
        GpuReading(
            0, GpuUuid(GPU), 61.5, 44.0, 7 * GIB, 15 * GIB, 0.8, False, False,
            (DeviceReading(GPU, 7 * GIB, 15 * GIB, T4_PROCESSES),),
        ),
        GpuReading(
            1, GpuUuid(MIG_GPU), 90.0, 50.0, GIB, 40 * GIB, None, True, False,
            (DeviceReading(MIG, GIB, 5 * GIB, (ProcessReading(30, GIB, None),), 3, None, None),),
        ),
    ),
)  # fmt: skip
OWNERS = {10: PodProcess("uid-a", "ca"), 20: PodProcess("uid-b", "cb"), 30: PodProcess("uid-c", "cc")}
PODS = {
    "uid-a": Pod("ml", "a", {"ca": "main"}),
    "uid-b": Pod("ml", "b", {"cb": "main"}),
    "uid-c": Pod("ml", "c", {"cc": "main"}),
}


def document(holders: tuple[Holding, ...] = HOLDERS) -> dict[str, Any]:
    held = held_slices(INVENTORY, HOLDERS)
    uses = attribute(READINGS, held, OWNERS, PODS)
    histories: dict[Any, History] = record({}, uses.slices, T0, 86400)
    report = summarise(READINGS, uses, histories, interval_s=10, window_s=86400, holders_known=True)
    return status_document(
        "n1",
        NODE,
        INVENTORY,
        holders,
        ConfigStatus(),
        usage=report,
        usage_enabled=True,
        catalog=default_catalog(),
    )


def slices(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for g in doc["gpus"] for s in g["slices"]}


def test_each_pod_sharing_a_gpu_shows_its_own_use_and_the_gpu_their_sum() -> None:
    doc = document()
    by_id = slices(doc)
    a, b, free = (by_id[f"{GPU}::{i}"]["usage"] for i in range(3))
    assert (4 * GIB, 15 * GIB, 0.6, [10]) == (
        a["memoryUsedBytes"],
        a["memoryTotalBytes"],
        a["smActive"],
        a["pids"],
    )
    assert (2 * GIB, 0.2, [20]) == (b["memoryUsedBytes"], b["smActive"], b["pids"])
    assert free is None  # held by no pod
    gpu = doc["gpus"][0]["usage"]
    assert (61.5, 44.0, 7 * GIB, 0.8) == (
        gpu["powerWatts"], gpu["temperatureCelsius"], gpu["memoryUsedBytes"], gpu["utilization"]
    )  # fmt: skip
    # The GPU's memory is its pods' and what no pod accounts for.
    assert [{"device": GPU, "memoryUsedBytes": GIB, "pids": [99]}] == gpu["unattributed"]
    assert gpu["memoryUsedBytes"] == a["memoryUsedBytes"] + b["memoryUsedBytes"] + GIB
    assert {
        "enabled": True, "sampledAt": "2025-12-29T09:20:00Z", "intervalSeconds": 10, "windowSeconds": 86400,
        "idleAfterSeconds": 1800.0, "holdersKnown": True, "problems": [],
    } == doc["usage"]  # fmt: skip


def test_a_mig_slice_shows_its_devices_memory_and_no_sm_without_gpm() -> None:
    doc = document()
    mig = slices(doc)[MIG]["usage"]
    assert (GIB, 5 * GIB, None, 0.0, GIB, None) == (
        mig["memoryUsedBytes"], mig["memoryTotalBytes"], mig["smActive"], mig["idleSeconds"],
        mig["peakMemoryBytes"], mig["smActiveP95"],
    )  # fmt: skip
    # Sized by memory alone, and said so: an A100 has no GPM.
    assert {"profile": "1g.5gb", "basis": "memory", "peakMemoryBytes": GIB, "smActiveP95": None,
            "headroom": 0.1, "why": None} == mig["rightSize"]  # fmt: skip
    devices = doc["gpus"][1]["usage"]["devices"]
    assert [(MIG, 3, GIB, 5 * GIB, None, 1)] == [
        (
            d["uuid"],
            d["gpuInstance"],
            d["memoryUsedBytes"],
            d["memoryTotalBytes"],
            d["smActive"],
            d["processes"],
        )
        for d in devices
    ]


def test_a_slice_held_by_another_pod_since_the_sample_shows_no_use() -> None:
    other = (Holding("ml", "z", "main", SHARED, frozenset({f"{GPU}::0"})),)
    assert slices(document(other))[f"{GPU}::0"]["usage"] is None


def test_without_usage_the_document_says_so() -> None:
    doc = status_document("n1", NODE, INVENTORY, HOLDERS, ConfigStatus())
    assert {"enabled": False, "sampledAt": None} == doc["usage"]
    assert [None, None] == [g["usage"] for g in doc["gpus"]]
    assert {None} == {s["usage"] for s in slices(doc).values()}


def scrape(doc: dict[str, Any]) -> dict[str, list[tuple[dict[str, str], float]]]:
    metrics = Metrics("test")
    metrics.snapshot(doc, ())
    text = metrics.render().decode()
    return {
        f.name: [(dict(s.labels), s.value) for s in f.samples] for f in text_string_to_metric_families(text)
    }


def test_the_metrics_carry_each_slices_own_use() -> None:
    found = scrape(document())
    assert [({"gpu": "0", "uuid": GPU}, 61.5), ({"gpu": "1", "uuid": MIG_GPU}, 90.0)] == found[
        "gpu_sharing_gpu_power_watts"
    ]
    assert [({"gpu": "0", "uuid": GPU}, 0.8)] == found[
        "gpu_sharing_gpu_utilization_ratio"
    ]  # none in MIG mode
    for name in ("gpu_temperature_celsius", "gpu_memory_used_bytes", "gpu_memory_total_bytes"):
        assert 2 == len(found[f"gpu_sharing_{name}"]), name

    def holder(pod: str, device: str, resource: str = SHARED) -> dict[str, str]:
        return {"resource": resource, "device": device, "namespace": "ml", "pod": pod, "container": "main"}

    assert [
        (holder("a", f"{GPU}::0"), 4 * GIB),
        (holder("b", f"{GPU}::1"), 2 * GIB),
        (holder("c", MIG, MIG_RESOURCE), GIB),
    ] == found["gpu_sharing_slice_memory_used_bytes"]
    assert [(holder("a", f"{GPU}::0"), 0.6), (holder("b", f"{GPU}::1"), 0.2)] == found[
        "gpu_sharing_slice_sm_active_ratio"
    ]
    assert {5 * GIB, 15 * GIB} == {v for _, v in found["gpu_sharing_slice_memory_total_bytes"]}
    assert {0.0} == {v for _, v in found["gpu_sharing_slice_idle_seconds"]}
    assert 3 == len(found["gpu_sharing_slice_memory_peak_bytes"])
    assert [({"gpu": "0", "uuid": GPU, "device": GPU}, GIB)] == found[
        "gpu_sharing_unattributed_memory_used_bytes"
    ]
    assert [({"gpu": "1", "uuid": MIG_GPU, "device": MIG}, 5 * GIB)] == found[
        "gpu_sharing_mig_device_memory_total_bytes"
    ]
    assert [({}, T0)] == found["gpu_sharing_usage_last_sample_timestamp_seconds"]


async def test_the_slices_use_names_pods_so_localhost_only_keeps_it_local() -> None:
    metrics = Metrics("test")
    report = Reporter("n1", cast(Rollout, None), cast(Fleet, None), metrics, holders_localhost_only=True)
    doc = document()

    async def status() -> dict[str, Any]:
        metrics.snapshot(doc, ())
        return doc

    report.status = status  # type: ignore[method-assign]
    far = (await report.routes()["/metrics"](Request(local=False))).body
    near = (await report.routes()["/metrics"](Request(local=True))).body
    assert b"gpu_sharing_slice_memory_used_bytes" not in far
    assert b"gpu_sharing_slice_idle_seconds" not in far
    assert b"gpu_sharing_gpu_power_watts" in far
    assert b'gpu_sharing_slice_memory_used_bytes{container="main",device="GPU-t4::0"' in near


def test_sharing_status_usage_shows_each_slices_use_of_its_size() -> None:
    lines = [line.rstrip() for line in describe(document(), usage=True).splitlines()]
    assert (
        "usage sampled 2025-12-29T09:20:00Z, every 10 s; peak and SM p95 over 1d; idle after 30m; "
        "right size: the smallest MIG profile holding the peak memory + 10 % (and the SM p95 if known)"
    ) in lines
    assert "  62 W, 44 °C, memory 7.0 GiB of 15.0 GiB, utilization 80 %" in lines
    assert f"  unattributed: 1.0 GiB on {GPU} (PID 99)" in lines
    assert "  90 W, 50 °C, memory 1.0 GiB of 40.0 GiB, no GPM (SM of MIG devices unknown)" in lines
    rows = [line.split("  ") for line in lines if line.startswith("  nvidia.com/") or "RESOURCE" in line]
    cells = [[c.strip() for c in row if c.strip()] for row in rows]
    assert cells[0][-6:] == ["MEMORY USED", "SM", "IDLE FOR", "PEAK", "SM P95", "RIGHT SIZE"]
    assert cells[1][-6:] == ["4.0 GiB of 15.0 GiB", "60 %", "in use", "4.0 GiB", "65 %", "none"]
    assert cells[2][-6:] == ["2.0 GiB of 15.0 GiB", "20 %", "in use", "2.0 GiB", "25 %", "none"]
    assert cells[3][-6:] == ["-"] * 6  # held by no pod
    assert f"  right size of {GPU}::0: none, Tesla T4 has no MIG" in lines
    # No GPM on an A100: its right size is by memory alone, and says so.
    assert cells[5][-6:] == ["1.0 GiB of 5.0 GiB", "-", "in use", "1.0 GiB", "-", "1g.5gb (memory only)"]
    assert "MEMORY USED" not in describe(document())  # without --usage, the table as before
