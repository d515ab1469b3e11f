"""The applier: turn the node's GPUs into what the selected config asks, with the fewest steps.

Observe -> plan per GPU -> run the steps through the backend, each journaled before it runs ->
re-observe -> verify. A GPU that already matches gets no NVML call that changes anything; a busy
instance is never destroyed; MIG mode changes only on idle GPUs and is never forced by a reset
(the GPU is reported "reset required"). A failure on one GPU stops that GPU only. A journal left by
a crash is rolled forward: the crashed run's GPUs are planned again from what is really there
(a GPU instance left without its compute instance is completed or destroyed, never left behind).
mig-parted instead destroys every instance of a GPU and recreates all of them on any change.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import structlog

from sharing.catalog import Catalog
from sharing.change import GpuChange, Outcome, Step, StepKind, plan_change, target_for, verify
from sharing.errors import SharingError
from sharing.gpu.backend import GpuBackend
from sharing.journal import Journal
from sharing.model import GpuUuid, NodeState
from sharing.spec import SharingConfig


@dataclass(frozen=True, slots=True)
class GpuReport:
    """The result for one GPU: the steps that ran (or would run) and why it failed, if it did."""

    index: int
    uuid: GpuUuid
    product: str
    outcome: Outcome
    steps: tuple[Step, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ApplyReport:
    """The result for the node, one entry per GPU in index order."""

    gpus: tuple[GpuReport, ...]
    resumed: bool = False
    """A crashed run's journal was found and rolled forward."""
    after: NodeState | None = None
    """The node as observed to verify the result; None when nothing ran."""

    @property
    def ok(self) -> bool:
        """True when every GPU is as the config asks (or would be, for a dry run)."""
        return all(g.outcome in (Outcome.APPLIED, Outcome.UNCHANGED, Outcome.PLANNED) for g in self.gpus)


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

    `observed` is a fresh observation the caller already made (saves one); the report's `after`
    is the observation made to verify the result, when anything ran.
    """
    log = structlog.get_logger("sharing.apply").bind(config=config.name)
    unfinished = None if dry_run else journal.unfinished()
    if unfinished is not None:
        log.warning(
            "journal_resumed",
            path=str(journal.path),
            gpus=sorted(unfinished.targets),
            in_flight=unfinished.in_flight,
        )
    state = observed if observed is not None else await backend.observe()
    changes = []
    inherited: set[GpuUuid] = set()  # GPUs only a crashed run's journal has a target for
    for gpu in state.gpus:
        target = target_for(config, gpu, catalog)
        if target is None and unfinished is not None and gpu.uuid in unfinished.targets:
            target = unfinished.targets[gpu.uuid]
            inherited.add(gpu.uuid)
        change = plan_change(gpu, target, catalog, busy_uuids)
        if change.steps or change.failure:
            log.info(
                "gpu_planned",
                gpu=gpu.index,
                uuid=gpu.uuid,
                steps=[str(s) for s in change.steps],
                failure=change.reason or None,
            )
        changes.append(change)
    if dry_run:
        return ApplyReport(tuple(_planned(c) for c in changes))
    todo = [c for c in changes if c.steps and c.failure is None]
    # Keep journaled every target not reached yet, so a crash (or a failure) of this run does not
    # forget what a crashed run's GPUs were changing to.
    pending = {c.gpu.uuid: c.target for c in changes if c.target is not None and (c.steps or c.failure)}
    results: dict[GpuUuid, GpuReport] = {}
    after = None
    if todo:
        journal.begin(pending)
        for change in todo:
            results[change.gpu.uuid] = await _execute(backend, journal, change, log)
        after = await _verify_all(backend, todo, results, log)
    reports = tuple(results.get(c.gpu.uuid) or _planned(c) for c in changes)
    unreached = {
        r.uuid: pending[r.uuid]
        for r in reports
        if r.uuid in inherited and r.uuid in pending and r.outcome not in (Outcome.APPLIED, Outcome.UNCHANGED)
    }
    if unreached:  # a crashed run's GPU still not where it was going, and no rule says otherwise
        journal.begin(unreached)
    else:
        journal.finish()
    log.info("apply_finished", **{o.value: sum(r.outcome is o for r in reports) for o in Outcome})
    return ApplyReport(reports, resumed=unfinished is not None, after=after)


def _planned(change: GpuChange) -> GpuReport:
    gpu = change.gpu
    if change.failure is not None:
        return GpuReport(gpu.index, gpu.uuid, gpu.product, change.failure, reason=change.reason)
    outcome = Outcome.PLANNED if change.steps else Outcome.UNCHANGED
    return GpuReport(gpu.index, gpu.uuid, gpu.product, outcome, change.steps, change.reason)


async def _execute(
    backend: GpuBackend, journal: Journal, change: GpuChange, log: structlog.typing.FilteringBoundLogger
) -> GpuReport:
    gpu = change.gpu
    done: list[Step] = []
    for step in change.steps:
        n = journal.step(gpu.uuid, str(step))
        try:
            pending = await _run(backend, gpu.uuid, step)
        except SharingError as err:
            journal.done(n)
            log.error("gpu_failed", gpu=gpu.index, uuid=gpu.uuid, step=str(step), error=str(err))
            return GpuReport(gpu.index, gpu.uuid, gpu.product, Outcome.FAILED, tuple(done), f"{step}: {err}")
        journal.done(n)
        done.append(step)
        log.info("step_done", gpu=gpu.index, step=str(step))
        if pending:
            reason = (
                f"MIG mode change on GPU {gpu.index} ({gpu.uuid}) is pending until the GPU is reset; "
                f"this agent never resets GPUs: drain it and run `nvidia-smi -r -i {gpu.index}` (or reboot), "
                "then apply again"
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


async def _verify_all(
    backend: GpuBackend,
    todo: list[GpuChange],
    results: dict[GpuUuid, GpuReport],
    log: structlog.typing.FilteringBoundLogger,
) -> NodeState:
    state = await backend.observe()
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
    return state
