"""The verdict of a rollout: the state label, the Event and when to try again, in words people read.

Pure. One message per outcome, never cut mid-word (at most ~1,000 characters, "; and N more"),
GPUs named once ("GPU 0 (NVIDIA A100-SXM4-40GB): …"), the pods that block a change named, and a
blocked change told that it is applied as soon as they are free.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from sharing.apply import ApplyReport, GpuReport
from sharing.change import Outcome
from sharing.holders import Holders
from sharing.labels import ConfigState
from sharing.model import NodeState
from sharing.spec import SharingConfig
from sharing.text import bounded, listed, summary

EVENT_LIMIT = 1000


class Retry(enum.Enum):
    """When the agent should try again without new input."""

    NONE = "none"
    """Only when the input changes (or at the periodic resync)."""
    BACKOFF = "backoff"
    """Something failed that may pass: again after a growing delay."""
    BLOCKED = "blocked"
    """Devices in use stand in the way: re-check cheaply and apply as soon as they are free."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one reconcile concluded, for the state label, the Event and the retry."""

    state: ConfigState | None
    reason: str = ""
    message: str = ""
    subject: str = ""
    """What the Event is about: the same reason and subject again is not news (no second Event)."""
    changed: bool = False
    """Hardware was changed: always news."""
    retry: Retry = Retry.NONE
    blockers: frozenset[str] = frozenset()
    """Devices whose release should trigger a new attempt (Retry.BLOCKED)."""


def verdict(config: SharingConfig, report: ApplyReport, holders: Holders, after: NodeState) -> Verdict:
    """What a rollout of `config` concluded."""
    name = config.name
    changed = [g for g in report.gpus if g.outcome is Outcome.APPLIED and g.steps]
    failed = [g for g in report.gpus if g.outcome in (Outcome.FAILED, Outcome.RESET_REQUIRED)]
    blocked = [g for g in report.gpus if g.outcome is Outcome.BLOCKED]
    lost = [f"GPU {u.index}: cannot be read ({bounded(u.error, 160)})" for u in after.unreadable]
    done = [f"GPU {g.index}: {_steps(g)}" for g in changed]
    resumed = " (an interrupted change found in the journal was finished)" if report.resumed else ""
    if not failed and not blocked and not lost:
        message = f"config {name!r} applied{resumed}" + (
            f": {summary(done, EVENT_LIMIT - 40, unit='more GPUs')}" if done else ""
        )
        return Verdict(ConfigState.SUCCESS, "ConfigApplied", message, name, bool(changed) or report.resumed)
    problems = [_gpu_line(g) for g in failed] + lost
    if blocked:
        pods = holders.pods_holding({b for g in blocked for b in g.blockers})
        who = f"held by pods {listed(pods)}" if pods else "in use"
        if holders.unknown:
            who = (
                "in use as far as can be told"
                f" (the kubelet's PodResources cannot be read or believed: {holders.unknown})"
            )
        problems += [f"{_gpu_line(g)} ({who})" for g in blocked]
    applied = f"; applied on {', '.join(f'GPU {g.index}' for g in changed)}" if changed else ""
    if failed or lost:
        message = f"config {name!r} could not be applied: " + summary(
            problems, EVENT_LIMIT - 80 - len(applied)
        )
        return Verdict(
            ConfigState.FAILED,
            "ConfigApplyFailed",
            message + applied,
            f"{name}: " + "; ".join(problems),
            bool(changed),
            # A step that failed may pass next time; a layout that cannot be placed will not.
            Retry.BACKOFF if any(g.steps or g.failed_step for g in failed) or lost else Retry.NONE,
        )
    retry = "it is applied as soon as they are free (checked every few seconds)"
    message = f"config {name!r} waits: " + summary(problems, EVENT_LIMIT - 100 - len(applied)) + f"; {retry}"
    blockers = frozenset(b for g in blocked for b in g.blockers)
    return Verdict(
        ConfigState.FAILED,
        "ConfigApplyBlocked",
        message + applied,
        f"{name}: {sorted(blockers)}",
        bool(changed),
        Retry.BLOCKED,
        blockers,
    )


def _steps(g: GpuReport, most: int = 6) -> str:
    steps = [str(s) for s in g.steps]
    if len(steps) <= most:
        return ", ".join(steps)
    return ", ".join(steps[: most - 1]) + f" and {len(steps) - most + 1} more steps"


def _gpu_line(g: GpuReport) -> str:
    return f"GPU {g.index} ({g.product}): {g.reason or g.outcome.value}"


def held_back(verdict: Verdict, withheld: Mapping[str, tuple[str, ...]], config: str) -> Verdict:
    """The verdict once devices held in a form the config does not keep are withheld: the config waits
    for the pods holding them, and is looked at again as soon as they are free."""
    if not withheld or verdict.state is None:
        return verdict
    pods = sorted({p for holding in withheld.values() for p in holding})
    who = f"held by pods {listed(pods)}" if pods else "in use"
    wait = (
        f"{listed(sorted(withheld))} ({who}) cannot be offered as config {config!r} says while they are"
        " held: another pod would share what they hold"
    )
    blockers = verdict.blockers | frozenset(withheld)
    if verdict.state is ConfigState.SUCCESS:
        retry = "it is applied as soon as they are free (checked every few seconds)"
        return Verdict(
            ConfigState.FAILED,
            "ConfigApplyBlocked",
            bounded(f"config {config!r} waits: {wait}; {retry}", EVENT_LIMIT),
            f"{config}: {sorted(blockers)}",
            verdict.changed,
            Retry.BLOCKED,
            blockers,
        )
    return replace(
        verdict,
        message=bounded(f"{verdict.message}; {wait}", EVENT_LIMIT),
        retry=Retry.BACKOFF if verdict.retry is Retry.BACKOFF else Retry.BLOCKED,
        blockers=blockers,
    )
