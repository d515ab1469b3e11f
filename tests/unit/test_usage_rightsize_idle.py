"""Idle and oversized slices where people read them: the status document, the metrics, `sharing status
--usage`, and the `SliceIdle` Event's message."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sharing.cli.status import describe
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.mig import default_catalog
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, Holding, MigUuid, NodeState
from sharing.ops import ConfigStatus, Metrics, status_document
from sharing.readings import DeviceReading, GpuReading, NodeReadings, ProcessReading
from sharing.usage import attribute, held_slices
from sharing.usage.attribute import Pod
from sharing.usage.cgroup import PodProcess
from sharing.usage.idle import message
from sharing.usage.report import summarise
from sharing.usage.window import History, record

GIB = 1 << 30
A100, H100, MIG = "GPU-a100", "GPU-h100", "MIG-3g"
MIG_RESOURCE, SHARED = "nvidia.com/mig-3g.20gb", "nvidia.com/gpu.shared"
T0 = 1_767_000_000.0
NODE = NodeState(
    (
        Gpu(
            0, GpuUuid(A100), "NVIDIA A100-SXM4-40GB", 40960, True, True, True,
            (GpuInstance(1, "3g.20gb", 4, 4, (ComputeInstance(0, MigUuid(MIG), True),)),),
        ),
        Gpu(1, GpuUuid(H100), "NVIDIA H100 80GB HBM3", 81559, True, False, False),
    )
)  # fmt: skip
INVENTORY = Inventory(
    (
        (
            ResourceName(MIG_RESOURCE),
            (Device(DeviceId(MIG), Health.HEALTHY, None, GpuUuid(A100), MigUuid(MIG)),),
        ),
        (
            ResourceName(SHARED),
            tuple(
                Device(DeviceId(f"{H100}::{i}"), Health.HEALTHY, None, GpuUuid(H100), None, i)
                for i in range(2)
            ),
        ),
    )
)
HOLDERS = (
    Holding("ml", "trainer", "main", MIG_RESOURCE, frozenset({MIG})),
    Holding("ml", "notebook", "main", SHARED, frozenset({f"{H100}::0"})),
    Holding("ml", "sleeper", "main", SHARED, frozenset({f"{H100}::1"})),
)
OWNERS = {10: PodProcess("uid-t", "ct"), 20: PodProcess("uid-n", "cn")}
PODS = {"uid-t": Pod("ml", "trainer", {"ct": "main"}), "uid-n": Pod("ml", "notebook", {"cn": "main"})}


def readings(at: float) -> NodeReadings:
    """The trainer uses 2 GiB of its 3g.20gb (no GPM on an A100); the notebook 6 GiB and 30 % of the
    H100's SMs; the sleeper nothing."""
    return NodeReadings(
        at,
        (
            GpuReading(
                0, GpuUuid(A100), 90.0, 50.0, 2 * GIB, 40 * GIB, None, True, False,
                (DeviceReading(MIG, 2 * GIB, 20 * GIB, (ProcessReading(10, 2 * GIB, None),), 1),),
            ),
            GpuReading(
                1, GpuUuid(H100), 300.0, 60.0, 6 * GIB, 80 * GIB, 0.3, False, True,
                (DeviceReading(H100, 6 * GIB, 80 * GIB, (ProcessReading(20, 6 * GIB, 0.3),)),),
            ),
        ),
    )  # fmt: skip


def document(idle_after_s: float = 1800.0) -> dict[str, Any]:
    """The status after two samples an hour apart."""
    held = held_slices(INVENTORY, HOLDERS)
    histories: dict[Any, History] = {}
    for at in (T0, T0 + 3600):
        uses = attribute(readings(at), held, OWNERS, PODS)
        histories = record(histories, uses.slices, at, 86400)
    report = summarise(
        readings(T0 + 3600), uses, histories, interval_s=10, window_s=86400, holders_known=True,
        idle_after_s=idle_after_s,
    )  # fmt: skip
    return status_document(
        "n1",
        NODE,
        INVENTORY,
        HOLDERS,
        ConfigStatus(),
        usage=report,
        usage_enabled=True,
        catalog=default_catalog(),
    )


def used(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["pod"]["pod"]: s["usage"] for g in doc["gpus"] for s in g["slices"] if s["pod"]}


def test_a_pod_using_2_gib_of_a_3g_20gb_fits_a_1g_5gb_by_memory_alone_without_gpm() -> None:
    trainer = used(document())["trainer"]
    assert {"profile": "1g.5gb", "basis": "memory", "peakMemoryBytes": 2 * GIB, "smActiveP95": None,
            "headroom": 0.1, "why": None} == trainer["rightSize"]  # fmt: skip


def test_a_time_sliced_replica_of_a_whole_gpu_is_told_the_mig_profile_that_would_hold_it() -> None:
    """6 GiB and 30 % of an H100's SMs (MIG off: sized on the catalog's H100 profiles): the p95 is the
    bin's upper edge, 35 %, so 2.45 of its 7 compute slices and 6.6 GiB need a 3g.40gb, where memory
    alone would take a 1g.10gb."""
    notebook = used(document())["notebook"]
    assert ("3g.40gb", "memory+sm", 0.35) == (
        notebook["rightSize"]["profile"],
        notebook["rightSize"]["basis"],
        notebook["rightSize"]["smActiveP95"],
    )
    # Held, never used: its peak is 0, and the smallest profile holds that.
    assert "1g.10gb" == used(document())["sleeper"]["rightSize"]["profile"]


def test_a_slice_with_no_process_for_idle_after_is_idle() -> None:
    doc = document(idle_after_s=3600)
    assert {"trainer": False, "notebook": False, "sleeper": True} == {
        p: u["idle"] for p, u in used(doc).items()
    }
    assert {"trainer": False, "notebook": False, "sleeper": False} == {
        p: u["idle"] for p, u in used(document(idle_after_s=3601)).items()
    }


def scrape(doc: dict[str, Any]) -> dict[str, list[tuple[dict[str, str], float]]]:
    metrics = Metrics("test")
    metrics.snapshot(doc, ())
    text = metrics.render().decode()
    return {
        f.name: [(dict(s.labels), s.value) for s in f.samples] for f in text_string_to_metric_families(text)
    }


def holder(pod: str, device: str, resource: str) -> dict[str, str]:
    return {"resource": resource, "device": device, "namespace": "ml", "pod": pod, "container": "main"}


def test_the_metrics_say_which_slice_is_idle_and_its_right_size() -> None:
    found = scrape(document(idle_after_s=3600))
    assert [
        (holder("trainer", MIG, MIG_RESOURCE), 0.0),
        (holder("notebook", f"{H100}::0", SHARED), 0.0),
        (holder("sleeper", f"{H100}::1", SHARED), 1.0),
    ] == found["gpu_sharing_slice_idle"]
    assert [
        ({"profile": "1g.5gb", "basis": "memory", **holder("trainer", MIG, MIG_RESOURCE)}, 1.0),
        ({"profile": "3g.40gb", "basis": "memory+sm", **holder("notebook", f"{H100}::0", SHARED)}, 1.0),
        ({"profile": "1g.10gb", "basis": "memory+sm", **holder("sleeper", f"{H100}::1", SHARED)}, 1.0),
    ] == found["gpu_sharing_slice_rightsize_info"]


def test_sharing_status_usage_shows_the_right_size_and_says_memory_only() -> None:
    lines = describe(document(idle_after_s=3600), usage=True).splitlines()
    rows = {line.split()[4]: line for line in lines if "ml/" in line}
    assert rows["ml/trainer/main"].rstrip().endswith("1g.5gb (memory only)")
    assert rows["ml/notebook/main"].rstrip().endswith("  3g.40gb")
    assert "1h, idle" in rows["ml/sleeper/main"]


def test_the_idle_event_names_the_pod_and_the_slice_in_bounded_words() -> None:
    held = held_slices(INVENTORY, HOLDERS)
    uses = attribute(readings(T0), held, OWNERS, PODS)
    report = summarise(
        readings(T0 + 5400), uses, record({}, uses.slices, T0, 86400), interval_s=10, window_s=86400,
        holders_known=True, idle_after_s=3600,
    )  # fmt: skip
    (sleeper,) = [s for s in report.slices if s.idle]
    assert (
        f"pod ml/sleeper (container main) has run no GPU process on its slice {H100}::1 ({SHARED}) for "
        "1h 30m (usage.idleAfter 1h): end the pod or scale it down to free the slice"
    ) == message(sleeper, 3600)
