"""The applier: turn the node's GPUs into what the selected config asks, with the fewest steps.

Two halves, so a caller can act between them: `plan_node` (pure) says what each GPU needs, from an
observation, the devices in use and a crashed run's journal; `execute` runs the runnable changes
through the backend, each step journaled before it runs, re-observes and verifies. The agent
withdraws the devices a plan removes from the kubelet between the two; `apply_config` chains them
for `sharing apply` and tests.

A GPU that already matches gets no NVML call that changes anything; a busy instance is never
destroyed; MIG mode changes only on idle GPUs and is never forced by a reset (the GPU is reported
"reset required"). A failure on one GPU stops that GPU only. A journal left by a crash is rolled
forward: the crashed run's GPUs are planned again from what is really there (a GPU instance left
without its compute instance is completed or destroyed, never left behind). mig-parted instead
destroys every instance of a GPU and recreates all of them on any change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass

import structlog

from sharing.config import SharingConfig, target_for
from sharing.errors import SharingError
from sharing.gpu import GpuBackend
from sharing.gpu.backend import GpuBusyError
from sharing.mig import Catalog, GpuChange, Outcome, Step, StepKind, Target, plan_change, verify
from sharing.model import GpuUuid, NodeState
from sharing.store import Journal, Unfinished
from sharing.text import bounded

log = structlog.get_logger("sharing.rollout.apply")


@dataclass(frozen=True, slots=True)
class GpuReport:
    """The result for one GPU: the steps that ran (or would run) and why it failed, if it did."""

    index: int
    uuid: GpuUuid
    product: str
    outcome: Outcome
    steps: tuple[Step, ...] = ()
    reason: str = ""
    blockers: tuple[str, ...] = ()
    """Devices in use that stand in the way, when BLOCKED."""
    failed_step: Step | None = None
    """The step that failed, when a step failed."""


@dataclass(frozen=True, slots=True)
class ApplyReport:
    """The result for the node, one entry per GPU in index order."""

    gpus: tuple[GpuReport, ...]
    resumed: bool = False
    """A crashed run's journal named GPUs of this node, and was rolled forward."""
    inherited: frozenset[GpuUuid] = frozenset()
    """GPUs changed (or not) for a crashed run's target that no rule of the config has."""
    after: NodeState | None = None
    """The node as observed to verify the result; None when nothing ran."""

    @property
    def ok(self) -> bool:
        """True when every GPU is as the config asks (or would be, for a dry run)."""
        return all(g.outcome in (Outcome.APPLIED, Outcome.UNCHANGED, Outcome.PLANNED) for g in self.gpus)


@dataclass(frozen=True, slots=True)
class NodePlan:
    """Every GPU's planned change, and what a crashed run left (pure result of `plan_node`)."""

    changes: tuple[GpuChange, ...]
    unfinished: Unfinished | None = None
    inherited: frozenset[GpuUuid] = frozenset()
    """GPUs only a crashed run's journal has a target for (no rule of the config does)."""

    @property
    def resumed(self) -> bool:
        """A crashed run's journal names GPUs of this node (an empty one, or one of GPUs gone, does not)."""
        return self.unfinished is not None and any(
            c.gpu.uuid in self.unfinished.targets for c in self.changes
        )

    @property
    def runnable(self) -> tuple[GpuChange, ...]:
        """Changes with steps to run now."""
        return tuple(c for c in self.changes if c.steps and c.failure is None)

    def removed(self) -> frozenset[str]:
        """Device UUIDs the runnable changes take away."""
        return frozenset().union(*(c.removed() for c in self.runnable))

    def reports(self) -> tuple[GpuReport, ...]:
        """What the plan says per GPU, as if nothing ran (a dry run)."""
        return tuple(_planned(c) for c in self.changes)


def plan_node(
    state: NodeState,
    config: SharingConfig,
    *,
    catalog: Catalog,
    busy_uuids: Collection[str] = frozenset(),
    unfinished: Unfinished | None = None,
) -> NodePlan:
    """The change each GPU needs (pure). A crashed run's target applies where no rule has one."""
    changes = []
    inherited: set[GpuUuid] = set()
    for gpu in state.gpus:
        target = target_for(config, gpu, catalog)
        if target is None and unfinished is not None and gpu.uuid in unfinished.targets:
            target = unfinished.targets[gpu.uuid]
            inherited.add(gpu.uuid)
        changes.append(plan_change(gpu, target, catalog, busy_uuids))
    return NodePlan(tuple(changes), unfinished, frozenset(inherited))


async def execute(backend: GpuBackend, journal: Journal, plan: NodePlan, *, config: str = "") -> ApplyReport:
    """Run the plan's runnable changes, journaled, then re-observe and verify them.

    The caller holds `journal.locked()`. An observation that fails after the steps raises
    (SharingError): the caller must not advertise what it believed before them.
    """
    bound = log.bind(config=config)
    todo = plan.runnable
    for change in plan.changes:
        if change.steps or change.failure:
            bound.info(
                "gpu_planned",
                gpu=change.gpu.index,
                steps=[str(s) for s in change.steps],
                outcome=(change.failure or Outcome.PLANNED).value,
                **({"reason": change.reason} if change.failure else {}),
            )
    results: dict[GpuUuid, GpuReport] = {}
    after = None
    if todo:
        await asyncio.to_thread(journal.begin, _pending(plan))
        for change in todo:
            results[change.gpu.uuid] = await _execute(backend, journal, change)
        after = await backend.observe()
        _verify_all(after, todo, results)
    reports = tuple(results.get(c.gpu.uuid) or _planned(c) for c in plan.changes)
    await asyncio.to_thread(_settle_journal, journal, plan, reports, bool(todo))
    if todo:
        bound.info(
            "apply_finished", **{o.value: n for o in Outcome if (n := sum(r.outcome is o for r in reports))}
        )
    return ApplyReport(reports, resumed=plan.resumed, inherited=plan.inherited, after=after)


async def apply_config(
    backend: GpuBackend,
    config: SharingConfig,
    *,
    catalog: Catalog,
    journal: Journal,
    busy_uuids: Collection[str] = frozenset(),
    dry_run: bool = False,
    observed: NodeState | None = None,
) -> ApplyReport:
    """Make the node's GPUs match `config` (or, with dry_run, say what that would take).

    For `sharing apply` and tests: plan and execute in one go under the journal's lock (the agent
    withdraws devices from the kubelet in between). `observed` saves one observation.
    """
    if dry_run:
        state = observed if observed is not None else await backend.observe()
        return ApplyReport(plan_node(state, config, catalog=catalog, busy_uuids=busy_uuids).reports())
    with journal.locked():
        unfinished = await asyncio.to_thread(journal.unfinished)
        if unfinished is not None:
            log.warning("journal_resumed", path=str(journal.path), gpus=len(unfinished.targets))
        state = observed if observed is not None else await backend.observe()
        plan = plan_node(state, config, catalog=catalog, busy_uuids=busy_uuids, unfinished=unfinished)
        return await execute(backend, journal, plan, config=config.name)


def _pending(plan: NodePlan) -> dict[GpuUuid, Target]:
    """Every target not reached yet, so a crash of this run does not forget a crashed run's."""
    return {c.gpu.uuid: c.target for c in plan.changes if c.target is not None and (c.steps or c.failure)}


def _settle_journal(journal: Journal, plan: NodePlan, reports: tuple[GpuReport, ...], ran: bool) -> None:
    """Finish the journal, or keep the crashed run's targets that may still be reached.

    A target only a crashed run had is kept while its GPU is blocked (in use), waits for a reset or
    failed a step (it may succeed next time); one that can never be reached (GPU gone, layout
    infeasible) is dropped, so it is not retried forever. Unchanged targets are not rewritten.
    """
    keep_for = (Outcome.BLOCKED, Outcome.RESET_REQUIRED)
    pending = _pending(plan)
    kept = {
        r.uuid: pending[r.uuid]
        for r in reports
        if r.uuid in plan.inherited
        and r.uuid in pending
        and (r.outcome in keep_for or (r.outcome is Outcome.FAILED and r.steps))
    }
    if not kept:
        if ran or plan.unfinished is not None:
            journal.finish()
        return
    if ran or plan.unfinished is None or plan.unfinished.targets != kept or plan.unfinished.in_flight:
        journal.begin(kept)


def _planned(change: GpuChange) -> GpuReport:
    gpu = change.gpu
    if change.failure is not None:
        return GpuReport(
            gpu.index, gpu.uuid, gpu.product, change.failure, reason=change.reason, blockers=change.blockers
        )
    outcome = Outcome.PLANNED if change.steps else Outcome.UNCHANGED
    return GpuReport(gpu.index, gpu.uuid, gpu.product, outcome, change.steps, change.reason)


async def _execute(backend: GpuBackend, journal: Journal, change: GpuChange) -> GpuReport:
    gpu = change.gpu
    done: list[Step] = []
    for step in change.steps:
        n = await asyncio.to_thread(journal.step, gpu.uuid, str(step))
        try:
            pending = await _run(backend, gpu.uuid, step)
        except GpuBusyError as err:  # in use since it was planned: the change waits, as a planned block does
            await asyncio.to_thread(journal.done, n)
            log.info("gpu_blocked", gpu=gpu.index, uuid=gpu.uuid, step=str(step), reason=bounded(str(err)))
            reason = f"{step}: {bounded(str(err))}"
            return GpuReport(
                gpu.index, gpu.uuid, gpu.product, Outcome.BLOCKED, tuple(done), reason, blockers=(gpu.uuid,)
            )
        except SharingError as err:
            await asyncio.to_thread(journal.done, n)
            reason = f"{step}: {bounded(str(err))}"
            log.error("gpu_failed", gpu=gpu.index, uuid=gpu.uuid, step=str(step), error=bounded(str(err)))
            return GpuReport(
                gpu.index, gpu.uuid, gpu.product, Outcome.FAILED, tuple(done), reason, failed_step=step
            )
        await asyncio.to_thread(journal.done, n)
        done.append(step)
        log.info("step_done", gpu=gpu.index, step=str(step))
        if pending:
            reason = (
                "the MIG mode change waits for a GPU reset; this agent never resets GPUs: drain the node and "
                f"run `nvidia-smi -r -i {gpu.index}` (or reboot), then it is applied"
            )
            log.warning("gpu_reset_required", gpu=gpu.index, uuid=gpu.uuid)
            return GpuReport(gpu.index, gpu.uuid, gpu.product, Outcome.RESET_REQUIRED, tuple(done), reason)
    return GpuReport(gpu.index, gpu.uuid, gpu.product, Outcome.APPLIED, tuple(done))


async def _run(backend: GpuBackend, gpu: GpuUuid, step: Step) -> bool:
    """Run one step; True when it left a MIG mode change pending."""
    if step.kind in (StepKind.ENABLE_MIG, StepKind.DISABLE_MIG):
        return await backend.set_mig_mode(gpu, step.kind is StepKind.ENABLE_MIG)
    if step.kind is StepKind.DESTROY:
        assert step.gi_id is not None
        await backend.destroy_instance(gpu, step.gi_id)
    else:
        await backend.create_instance(gpu, step.profile, step.start)
    return False


def _verify_all(state: NodeState, todo: tuple[GpuChange, ...], results: dict[GpuUuid, GpuReport]) -> None:
    for change in todo:
        report = results[change.gpu.uuid]
        if report.outcome is not Outcome.APPLIED:
            continue
        problem = verify(change, state.gpu(change.gpu.uuid))
        if problem is not None:
            log.error("gpu_verify_failed", gpu=report.index, uuid=report.uuid, problem=problem)
            results[change.gpu.uuid] = GpuReport(
                report.index,
                report.uuid,
                report.product,
                Outcome.FAILED,
                report.steps,
                f"applied, but on re-observing: {problem}",
            )
