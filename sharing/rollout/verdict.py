"""The verdict of a rollout: the state label, the Event and when to try again, in words people read.

Pure. One message per outcome, never cut mid-word (at most ~1,000 characters, "; and N more"),
GPUs named once ("GPU 0 (NVIDIA A100-SXM4-40GB): …"), the pods that block a change named, and a
blocked change told that it is applied as soon as they are free.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from sharing.config import SharingConfig
from sharing.kubelet import Holders
from sharing.labels import ConfigState
from sharing.mig import Outcome
from sharing.model import NodeState
from sharing.rollout.apply import ApplyReport, GpuReport
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
    # A crashed run's target that can never be reached is dropped from the journal: not the config's fault.
    dropped = [
        g for g in failed if g.uuid in report.inherited and g.outcome is Outcome.FAILED and not g.steps
    ]
    failed = [g for g in failed if g not in dropped]
    blocked = [g for g in report.gpus if g.outcome is Outcome.BLOCKED]
    lost = [f"GPU {u.index}: cannot be read ({bounded(u.error, 160)})" for u in after.unreadable]
    done = [f"GPU {g.index}: {_steps(g)}" for g in changed]
    resumed = " (an interrupted change found in the journal was finished)" if report.resumed else ""
    if dropped:
        resumed = "; " + summary([f"{_gpu_line(g, report)}; it was dropped" for g in dropped], 400)
    if not failed and not blocked and not lost:
        message = f"config {name!r} applied" + (
            f": {summary(done, EVENT_LIMIT - 440, unit='more GPUs')}" if done else ""
        )
        message += resumed
        return Verdict(ConfigState.SUCCESS, "ConfigApplied", message, name, bool(changed) or report.resumed)
    problems = [_gpu_line(g, report) for g in failed] + lost
    if blocked:
        pods = holders.pods_holding({b for g in blocked for b in g.blockers})
        who = f"held by pods {listed(pods)}" if pods else "in use"
        if holders.unknown:
            who = f"in use as far as can be told ({holders.unknown})"
        problems += [f"{_gpu_line(g, report)} ({who})" for g in blocked]
    problems += [f"{_gpu_line(g, report)}; it was dropped" for g in dropped]
    applied = f"; applied on {', '.join(f'GPU {g.index}' for g in changed)}" if changed else ""
    if failed or lost:
        journal_only = not lost and all(g.uuid in report.inherited for g in failed)
        what = "an interrupted change found in the journal" if journal_only else f"config {name!r}"
        message = f"{what} could not be applied: " + summary(problems, EVENT_LIMIT - 80 - len(applied))
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


def _gpu_line(g: GpuReport, report: ApplyReport) -> str:
    why = g.reason or g.outcome.value
    if g.uuid in report.inherited:  # the target is a crashed run's, not the config's
        why = f"the interrupted change found in the journal cannot be finished ({why})"
    return f"GPU {g.index} ({g.product}): {why}"


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
