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
                      "idleSeconds", "peakMemoryBytes", "smActiveP95", "coveredSeconds", "rightSize"}
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

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


def slice_usage(report: UsageReport | None, entry: dict[str, Any]) -> dict[str, Any] | None:
    """A slice entry's usage: its PodResources holder's, or (DRA) its claims' pods' together."""
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
    return _combined(found) if found else None


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
        "peakMemoryBytes": one.peak_bytes if one else None,
        "smActiveP95": one.sm_p95 if one else None,
        "coveredSeconds": one.covered_seconds if one else None,
        "rightSize": None,
    }
