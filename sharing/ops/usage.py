"""The usage parts of the status document (pure): per GPU what it draws and uses, per slice what its pod uses.

From the usage sampler's latest report (`sharing.usage.UsageReport`); the document's other parts
come from `sharing.ops.status`. A slice's figures are its holder's own (joined by the slice's ID
and the pod holding it at the sample); a slice whose holder changed since is shown without them
until the next sample. Shapes (bytes, ratios 0..1, seconds; null where NVML cannot say):

    document["usage"] = {"enabled", "sampledAt", "intervalSeconds", "windowSeconds", "holdersKnown",
                         "problems"}
    gpu["usage"] = {"powerWatts", "temperatureCelsius", "memoryUsedBytes", "memoryTotalBytes",
                    "utilization", "gpm", "devices": [{"uuid", "gpuInstance", "memoryUsedBytes",
                    "memoryTotalBytes", "smActive", "graphicsActive", "processes"}],
                    "unattributed": [{"device", "memoryUsedBytes", "pids"}]}
    slice["usage"] = {"pods", "memoryUsedBytes", "memoryTotalBytes", "smActive", "pids",
                      "idleSeconds", "idle", "peakMemoryBytes", "smActiveP95", "coveredSeconds",
                      "rightSize": {"profile", "basis", "peakMemoryBytes", "smActiveP95", "headroom",
                                    "why"}}

A slice's right size (`sharing.mig.rightsize`) is sized on its GPU's MIG profiles as its driver
reports them (the catalog's where the driver lists none, as with MIG off); `profile` is null when no
profile holds it or the GPU has no MIG (`why` says which). Several pods' figures together (a shared
claim) have no window and no right size.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from sharing.mig import HEADROOM, Basis, Product, right_size
from sharing.mig.rightsize import extension
from sharing.model import Gpu
from sharing.usage import SliceReport, UsageReport


def summary(report: UsageReport | None, enabled: bool) -> dict[str, Any]:
    """The document's `usage`: whether it is sampled, when last, and what keeps it incomplete."""
    if report is None:
        return {"enabled": enabled, "sampledAt": None}
    at = datetime.datetime.fromtimestamp(report.at, datetime.UTC).isoformat(timespec="seconds")
    return {
        "enabled": enabled,
        "sampledAt": at.replace("+00:00", "Z"),
        "intervalSeconds": report.interval_s,
        "windowSeconds": report.window_s,
        "idleAfterSeconds": report.idle_after_s,
        "holdersKnown": report.holders_known,
        "problems": list(report.problems),
    }


def gpu_usage(report: UsageReport | None, uuid: str) -> dict[str, Any] | None:
    """One GPU's readings, its MIG devices' and what no pod's slice accounts for; None unread."""
    gpu = next((g for g in report.readings.gpus if g.uuid == uuid), None) if report else None
    if report is None or gpu is None:
        return None
    return {
        "powerWatts": gpu.power_watts,
        "temperatureCelsius": gpu.temperature_celsius,
        "memoryUsedBytes": gpu.memory_used_bytes,
        "memoryTotalBytes": gpu.memory_total_bytes,
        "utilization": gpu.utilization,
        "gpm": gpu.gpm,
        "devices": [
            {
                "uuid": d.uuid,
                "gpuInstance": d.gpu_instance,
                "memoryUsedBytes": d.memory_used_bytes,
                "memoryTotalBytes": d.memory_total_bytes,
                "smActive": d.sm_active,
                "graphicsActive": d.graphics_active,
                "processes": None if d.processes is None else len(d.processes),
            }
            for d in gpu.devices
            if gpu.mig
        ],
        "unattributed": [
            {"device": u.device, "memoryUsedBytes": u.memory_used_bytes, "pids": list(u.pids)}
            for u in report.unattributed
            if u.gpu == uuid
        ],
    }


def slice_usage(
    report: UsageReport | None, entry: dict[str, Any], gpu: Gpu | None = None, product: Product | None = None
) -> dict[str, Any] | None:
    """A slice entry's usage: its PodResources holder's, or (DRA) its claims' pods' together; its right
    size on `product`, the MIG geometry of its GPU `gpu` (None: no MIG, or not known)."""
    if report is None:
        return None
    if entry.get("pod"):
        holders = [(entry["pod"]["namespace"], entry["pod"]["pod"])]
    else:
        holders = sorted(
            {tuple(p.split("/", 1)) for c in entry.get("claims", ()) for p in c["pods"] if "/" in p}
        )
    found = [
        r for ns, pod in holders if (r := report.slice(entry["resource"], entry["id"], ns, pod)) is not None
    ]
    if not found:
        return None
    use = _combined(found)
    if len(found) == 1 and found[0].peak_bytes is not None:
        use["rightSize"] = _right_size(found[0], entry.get("profile"), gpu, product)
    return use


def _right_size(
    one: SliceReport, profile: str | None, gpu: Gpu | None, product: Product | None
) -> dict[str, Any]:
    assert one.peak_bytes is not None
    shown = {"peakMemoryBytes": one.peak_bytes, "smActiveP95": one.sm_p95, "headroom": HEADROOM}
    if product is None:
        name = gpu.product if gpu is not None else "its GPU"
        why = (
            f"{name} has no MIG"
            if gpu is None or not gpu.mig_capable
            else f"the MIG profiles of {name} are not known"
        )
        basis = Basis.MEMORY if one.sm_p95 is None else Basis.MEMORY_SM
        return {"profile": None, "basis": basis.value, **shown, "why": why}
    now = product.profile(profile) if profile else None
    size = right_size(
        product,
        one.peak_bytes,
        one.sm_p95,
        compute_slices=now.compute_slices if now is not None else product.compute_slices,
        family=extension(profile),
    )
    return {"profile": size.profile, "basis": size.basis.value, **shown, "why": size.why or None}


def _combined(reports: Sequence[SliceReport]) -> dict[str, Any]:
    """One holder's figures; several pods' (a shared claim) summed, their windows left out."""
    one = reports[0] if len(reports) == 1 else None
    shares = [r.use.sm for r in reports]
    return {
        "pods": [f"{r.use.held.namespace}/{r.use.held.pod}" for r in reports],
        "memoryUsedBytes": sum(r.use.memory_used_bytes for r in reports),
        "memoryTotalBytes": reports[0].use.memory_total_bytes,
        "smActive": None if None in shares else min(1.0, sum(s or 0.0 for s in shares)),
        "pids": sorted(p for r in reports for p in r.use.processes),
        "idleSeconds": min(r.idle_seconds for r in reports),
        "idle": all(r.idle for r in reports),
        "peakMemoryBytes": one.peak_bytes if one else None,
        "smActiveP95": one.sm_p95 if one else None,
        "coveredSeconds": one.covered_seconds if one else None,
        "rightSize": None,
    }
