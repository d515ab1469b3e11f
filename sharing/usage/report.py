"""The sampler's latest word: readings, each held slice's use and window, what no pod accounts for (pure).

`sharing status --usage`, `/status` and the metrics read one report, so they never disagree; the
status document joins each slice's figures to the slice it shows by its ID and holder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sharing.readings import NodeReadings
from sharing.usage.attribute import Attribution, SliceUse, Unattributed
from sharing.usage.window import History, SliceKey, key_of


@dataclass(frozen=True, slots=True)
class SliceReport:
    """One held slice: what its holder uses now, and over the window."""

    use: SliceUse
    idle_seconds: float
    """Since a process of its holder last ran on it (0 while one runs)."""
    idle: bool
    """No process of its holder ran on it for `usage.idleAfter` or longer."""
    peak_bytes: int | None
    sm_p95: float | None
    covered_seconds: float
    """How much of the window its history spans (less than the window while it is young)."""


@dataclass(frozen=True, slots=True)
class UsageReport:
    at: float
    """Unix time of the readings."""
    interval_s: float
    window_s: float
    readings: NodeReadings
    idle_after_s: float = 1800.0
    slices: tuple[SliceReport, ...] = ()
    unattributed: tuple[Unattributed, ...] = ()
    holders_known: bool = True
    """False when who holds which slice could not be read: no slice is shown, every process is
    unattributed, and no window changes."""
    problems: tuple[str, ...] = ()
    """What keeps the figures from being complete (the host's /proc unreadable, pods unknown)."""

    def slice(self, resource: str, device: str, namespace: str, pod: str) -> SliceReport | None:
        """The report of one slice as its holder holds it (None: not held by that pod at the sample)."""
        for report in self.slices:
            held = report.use.held
            if (held.resource, held.device, held.namespace, held.pod) == (resource, device, namespace, pod):
                return report
        return None


def summarise(
    readings: NodeReadings,
    attribution: Attribution,
    histories: Mapping[SliceKey, History],
    *,
    interval_s: float,
    window_s: float,
    holders_known: bool,
    idle_after_s: float = 1800.0,
    problems: tuple[str, ...] = (),
) -> UsageReport:
    """The report of one sample, each slice's window from `histories` (by `window.key_of`)."""
    now = readings.at
    slices = []
    for use in attribution.slices:
        history = histories.get(key_of(use.held)) or History(first_held=now)
        idle_s = 0.0 if use.processes else history.idle_seconds(now)
        slices.append(
            SliceReport(
                use,
                idle_s,
                idle_s >= idle_after_s,
                history.peak_bytes(now, window_s),
                history.sm_p95(now, window_s),
                min(window_s, max(0.0, now - history.first_held)),
            )
        )
    return UsageReport(
        now,
        interval_s,
        window_s,
        readings,
        idle_after_s,
        tuple(slices),
        attribution.unattributed,
        holders_known,
        problems,
    )
