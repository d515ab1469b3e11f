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

import enum
from collections.abc import Collection
from dataclasses import dataclass

import structlog

from sharing.catalog import Catalog
from sharing.errors import SharingError
from sharing.gpu.backend import GpuBackend
from sharing.journal import Journal, Target
from sharing.model import Gpu, GpuUuid
from sharing.plan import Existing, Infeasible, Placement, plan_gpu
from sharing.spec import MigMode, SharingConfig


class Outcome(enum.Enum):
    """What happened to one GPU."""

    APPLIED = "applied"
    UNCHANGED = "unchanged"
    PLANNED = "planned"
    """Dry run: the steps would run."""
    FAILED = "failed"
    RESET_REQUIRED = "reset-required"


class StepKind(enum.Enum):
    """One hardware step."""

    ENABLE_MIG = "enable-mig"
    DISABLE_MIG = "disable-mig"
    DESTROY = "destroy"
    CREATE = "create"
    COMPLETE = "complete"
    """Give a GPU instance left half-built by a crash its compute instance."""


@dataclass(frozen=True, slots=True)
class Step:
    """A hardware step on one GPU."""

    kind: StepKind
    profile: str = ""
    start: int = 0
    gi_id: int | None = None

    def __str__(self) -> str:
        if self.kind in (StepKind.ENABLE_MIG, StepKind.DISABLE_MIG):
            return f"{'enable' if self.kind is StepKind.ENABLE_MIG else 'disable'} MIG"
        gi = "" if self.gi_id is None else f" (GPU instance {self.gi_id})"
        return f"{self.kind.value} {self.profile}@{self.start}{gi}"


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

    @property
    def ok(self) -> bool:
        """True when every GPU is as the config asks (or would be, for a dry run)."""
        return all(g.outcome in (Outcome.APPLIED, Outcome.UNCHANGED, Outcome.PLANNED) for g in self.gpus)


@dataclass(frozen=True, slots=True)
class GpuChange:
    """The planned change of one GPU (pure result of `plan_change`)."""

    gpu: Gpu
    target: Target | None
    steps: tuple[Step, ...] = ()
    layout: tuple[Placement, ...] = ()
    """The instances expected afterwards when MIG is wanted on."""
    failure: Outcome | None = None
    reason: str = ""


def target_for(config: SharingConfig, gpu: Gpu, catalog: Catalog) -> Target | None:
    """What the config asks of this GPU; None when it is to be left as it is."""
    product = catalog.find(gpu.product)
    rule = config.rule_for(gpu.index, product.name if product else gpu.product)
    if rule is None or rule.mig is MigMode.UNCHANGED:
        return None
    if rule.mig is MigMode.DISABLED:
        return Target(mig_enabled=False)
    return Target(mig_enabled=True, instances=rule.instances)


def plan_change(
    gpu: Gpu, target: Target | None, catalog: Catalog, busy_uuids: Collection[str] = ()
) -> GpuChange:
    """The steps that take `gpu` to `target` (pure): nothing when it already matches.

    `busy_uuids` are GPUs and MIG devices in use beyond what NVML sees (pods holding them, per the
    kubelet's PodResources): they are kept exactly like devices with processes.
    """
    where = f"GPU {gpu.index} ({gpu.product}, {gpu.uuid})"
    if target is None:
        return GpuChange(gpu, target, reason="no rule asks for a change; left as it is")
    gpu_busy = gpu.busy or gpu.uuid in busy_uuids
    in_use = [
        ci.uuid for gi in gpu.instances for ci in gi.compute_instances if ci.busy or ci.uuid in busy_uuids
    ]
    idle_needed = (
        f"{where} has processes (or a pod holds it) and MIG mode only changes on an idle GPU: "
        "stop them (drain the node), then apply again"
    )
    if not target.mig_enabled:
        if not gpu.mig_capable or not (gpu.mig_enabled or gpu.mig_pending):
            return GpuChange(gpu, target)
        if not gpu.mig_enabled:  # only a pending "on": cancel it
            return GpuChange(gpu, target, (Step(StepKind.DISABLE_MIG),))
        if in_use:
            return GpuChange(
                gpu,
                target,
                failure=Outcome.FAILED,
                reason=f"MIG devices {', '.join(in_use)} on {where} are in use; MIG stays on until "
                "they are free",
            )
        if gpu_busy:
            return GpuChange(gpu, target, failure=Outcome.FAILED, reason=idle_needed)
        destroys = tuple(Step(StepKind.DESTROY, gi.profile, gi.start, gi.id) for gi in gpu.instances)
        return GpuChange(gpu, target, (*destroys, Step(StepKind.DISABLE_MIG)))
    if not gpu.mig_capable:
        return GpuChange(
            gpu,
            target,
            failure=Outcome.FAILED,
            reason=f"{where} has no MIG; give it a rule without `mig` (time-slicing only)",
        )
    product = catalog.find(gpu.product)
    if product is None:
        return GpuChange(
            gpu,
            target,
            failure=Outcome.FAILED,
            reason=f"{where} is not in the hardware catalog, so its MIG layouts are unknown",
        )
    steps: list[Step] = []
    if not gpu.mig_enabled or not gpu.mig_pending:
        if gpu_busy and not gpu.mig_enabled:
            return GpuChange(gpu, target, failure=Outcome.FAILED, reason=idle_needed)
        steps.append(Step(StepKind.ENABLE_MIG))
    instances = gpu.instances if gpu.mig_enabled else ()
    existing = [
        Existing(
            gi.profile,
            gi.start,
            busy=gi.busy or any(ci.uuid in busy_uuids for ci in gi.compute_instances),
        )
        for gi in instances
    ]
    plan = plan_gpu(product, existing, dict(target.instances))
    if isinstance(plan, Infeasible):
        return GpuChange(gpu, target, failure=Outcome.FAILED, reason=f"{where}: {plan.reason}")
    by_place = {(gi.profile, gi.start): gi for gi in instances}
    half_built = {(gi.profile, gi.start) for gi in instances if not gi.compute_instances}
    steps += [
        Step(StepKind.DESTROY, p.profile, p.start, by_place[(p.profile, p.start)].id) for p in plan.destroy
    ]
    steps += [
        Step(StepKind.COMPLETE, p.profile, p.start) for p in plan.keep if (p.profile, p.start) in half_built
    ]
    steps += [Step(StepKind.CREATE, p.profile, p.start) for p in plan.create]
    return GpuChange(gpu, target, tuple(steps), layout=plan.layout)


def verify(change: GpuChange, after: Gpu | None) -> str | None:
    """Why the re-observed GPU does not match the change's target, or None when it does."""
    if after is None:
        return "the GPU is gone after applying"
    assert change.target is not None
    if after.mig_enabled != change.target.mig_enabled:
        return f"MIG is {'on' if after.mig_enabled else 'off'} after applying"
    if not change.target.mig_enabled:
        return None
    have = sorted((gi.profile, gi.start) for gi in after.instances)
    want = sorted((p.profile, p.start) for p in change.layout)
    if have != want:
        return (
            f"the instances are {', '.join(f'{p}@{s}' for p, s in have) or 'none'}, "
            f"expected {', '.join(f'{p}@{s}' for p, s in want) or 'none'}"
        )
    empty = [f"{gi.profile}@{gi.start}" for gi in after.instances if not gi.compute_instances]
    if empty:
        return f"GPU instances without a compute instance: {', '.join(empty)}"
    return None


async def apply_config(
    backend: GpuBackend,
    config: SharingConfig,
    *,
    catalog: Catalog,
    journal: Journal,
    busy_uuids: Collection[str] = frozenset(),
    dry_run: bool = False,
) -> ApplyReport:
    """Make the node's GPUs match `config` (or, with dry_run, say what that would take)."""
    log = structlog.get_logger("sharing.apply").bind(config=config.name)
    unfinished = None if dry_run else journal.unfinished()
    if unfinished is not None:
        log.warning(
            "journal_resumed",
            path=str(journal.path),
            gpus=sorted(unfinished.targets),
            in_flight=unfinished.in_flight,
        )
    state = await backend.observe()
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
    if todo:
        journal.begin(pending)
        for change in todo:
            results[change.gpu.uuid] = await _execute(backend, journal, change, log)
        await _verify_all(backend, todo, results, log)
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
    return ApplyReport(reports, resumed=unfinished is not None)


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
) -> None:
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
