"""Idle slices: which held slices became idle since the last sample, and the Event that says so (pure).

A held slice on which no process of its pod ran for `usage.idleAfter` (30 min by default) is idle
(`SliceReport.idle`, `gpu_sharing_slice_idle`). With `usage.idleEvents` the agent records a
`SliceIdle` Event on its Node naming the pod and the slice, once per pod and slice: the slice's
window remembers that it was said (`History.idle_said`), and the windows are kept in the state
directory across restarts, so an agent that restarts does not say it again. A pod that uses its
slice again and then idles again is not told again (the metric follows it); a new pod on the slice
is a new holder, and is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from sharing.text import bounded, duration
from sharing.usage.report import SliceReport
from sharing.usage.window import History, SliceKey, key_of

REASON = "SliceIdle"
MESSAGE_LIMIT = 1000
"""Every Event message of the agent is bounded (a pod's and container's names are up to 253 chars)."""


def newly_idle(
    histories: Mapping[SliceKey, History], reports: Sequence[SliceReport]
) -> tuple[dict[SliceKey, History], tuple[SliceReport, ...]]:
    """The idle slices not said yet, and the histories with them remembered as said."""
    updated = dict(histories)
    found = []
    for report in reports:
        key = key_of(report.use.held)
        history = updated.get(key)
        if report.idle and history is not None and not history.idle_said:
            updated[key] = replace(history, idle_said=True)
            found.append(report)
    return updated, tuple(found)


def message(report: SliceReport, idle_after_s: float) -> str:
    """The `SliceIdle` Event's message: the pod, the slice, how long, and what to do."""
    held = report.use.held
    container = f" (container {held.container})" if held.container else ""
    text = (
        f"pod {held.namespace}/{held.pod}{container} has run no GPU process on its slice {held.device} "
        f"({held.resource}) for {duration(report.idle_seconds)} (usage.idleAfter {duration(idle_after_s)}): "
        "end the pod or scale it down to free the slice"
    )
    return bounded(text, MESSAGE_LIMIT)
