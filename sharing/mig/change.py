"""The change one GPU needs: from what it is to what its rule asks, as hardware steps (pure).

The GPU's MIG profiles and placements are the ones its driver reported (the catalog only fills in
for observations without them). Busy instances are kept where they are (the exact planner decides
which free ones stay), MIG mode changes only on idle GPUs, and a GPU instance left without its
compute instance by a crash is completed or destroyed. `sharing.rollout.apply` runs these steps; `verify`
checks the result.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from sharing.mig.catalog import Catalog
from sharing.mig.observed import device_profile, geometry
from sharing.mig.plan import Existing, Infeasibility, Infeasible, Placement, plan_gpu
from sharing.model import Gpu, GpuInstance


@dataclass(frozen=True, slots=True)
class Target:
    """What one GPU is being changed to: MIG mode and the wanted instances (profile, count)."""

    mig_enabled: bool
    instances: tuple[tuple[str, int], ...] = ()
    dynamic: bool = False
    """MIG on and the instances left alone: they are made and destroyed per claim (DRA front-end)."""


class Outcome(enum.Enum):
    """What happened to one GPU."""

    APPLIED = "applied"
    UNCHANGED = "unchanged"
    PLANNED = "planned"
    """Dry run: the steps would run."""
    FAILED = "failed"
    BLOCKED = "blocked"
    """Devices in use (processes, or pods per PodResources) stand in the way; retried when they are free."""
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
class GpuChange:
    """The planned change of one GPU (pure result of `plan_change`)."""

    gpu: Gpu
    target: Target | None
    steps: tuple[Step, ...] = ()
    layout: tuple[Placement, ...] = ()
    """The instances expected afterwards when MIG is wanted on."""
    failure: Outcome | None = None
    reason: str = ""
    blockers: tuple[str, ...] = ()
    """UUIDs of the GPU or MIG devices in use that stand in the way (when BLOCKED)."""

    def removed(self) -> frozenset[str]:
        """UUIDs of the devices (whole GPU, MIG devices) that running the steps takes away.

        These are withdrawn from the kubelet before the steps run, so no pod is admitted to a
        device that is about to disappear.
        """
        gone: set[str] = set()
        for step in self.steps:
            if step.kind is StepKind.ENABLE_MIG:
                gone.add(self.gpu.uuid)
            elif step.kind is StepKind.DISABLE_MIG:
                gone.update(ci.uuid for _, ci in self.gpu.mig_devices)
            elif step.kind is StepKind.DESTROY:
                gone.update(
                    ci.uuid for gi in self.gpu.instances if gi.id == step.gi_id for ci in gi.compute_instances
                )
        return frozenset(gone)


def plan_change(
    gpu: Gpu, target: Target | None, catalog: Catalog, busy_uuids: Collection[str] = ()
) -> GpuChange:
    """The steps that take `gpu` to `target` (pure): nothing when it already matches.

    `busy_uuids` are GPUs and MIG devices in use beyond what NVML sees (pods holding them, per the
    kubelet's PodResources): they are kept exactly like devices with processes.
    """
    if target is None:
        return GpuChange(gpu, target, reason="no rule asks for a change; left as it is")
    busy_migs = tuple(
        ci.uuid for gi in gpu.instances for ci in gi.compute_instances if ci.busy or ci.uuid in busy_uuids
    )
    gpu_busy = gpu.busy or gpu.uuid in busy_uuids
    holders = busy_migs or ((gpu.uuid,) if gpu_busy else ())
    if gpu.mig_capable and gpu.mig_pending != gpu.mig_enabled and gpu.mig_pending == target.mig_enabled:
        # Asked for already; only a reset makes it happen. Asking again would change nothing.
        return GpuChange(gpu, target, failure=Outcome.RESET_REQUIRED, reason=_reset_reason(gpu))
    if not target.mig_enabled:
        if not gpu.mig_capable or not (gpu.mig_enabled or gpu.mig_pending):
            return GpuChange(gpu, target)
        if not gpu.mig_enabled:  # only a pending "on": cancel it
            return GpuChange(gpu, target, (Step(StepKind.DISABLE_MIG),))
        if holders:
            return GpuChange(
                gpu,
                target,
                failure=Outcome.BLOCKED,
                reason=f"MIG devices {', '.join(holders)} are in use; MIG stays on until they are free",
                blockers=holders,
            )
        destroys = tuple(Step(StepKind.DESTROY, gi.profile, gi.start, gi.id) for gi in gpu.instances)
        return GpuChange(gpu, target, (*destroys, Step(StepKind.DISABLE_MIG)))
    if not gpu.mig_capable:
        return GpuChange(
            gpu,
            target,
            failure=Outcome.FAILED,
            reason="this GPU has no MIG; give it a rule without `mig` (time-slicing only)",
        )
    product = geometry(gpu, catalog)
    if product is None:
        return GpuChange(
            gpu,
            target,
            failure=Outcome.FAILED,
            reason="the driver reported no MIG profiles and the hardware catalog does not know the GPU, "
            "so its MIG layouts are unknown",
        )
    steps: list[Step] = []
    if not gpu.mig_enabled:
        if gpu_busy:
            return GpuChange(
                gpu,
                target,
                failure=Outcome.BLOCKED,
                reason="the GPU is in use (processes, or a pod holds it) and MIG mode only changes on an "
                "idle GPU",
                blockers=(gpu.uuid,),
            )
        steps.append(Step(StepKind.ENABLE_MIG))
    elif not gpu.mig_pending:  # on now, but set to go off at the next reset: keep it on
        steps.append(Step(StepKind.ENABLE_MIG))
    instances = gpu.instances if gpu.mig_enabled else ()
    if target.dynamic:  # every instance on it belongs to a claim, or waits for the operator
        layout = tuple(Placement(gi.profile, gi.start, gi.size) for gi in instances)
        return GpuChange(gpu, target, tuple(steps), layout=layout)
    if gpu.mig_enabled and gpu.uuid in busy_uuids:
        # Held as a whole while MIG is on: a claim is allocated a device of it that is not made yet
        # (an on-demand MIG device of a dynamic GPU), so nothing may be made or destroyed around it.
        return GpuChange(
            gpu,
            target,
            failure=Outcome.BLOCKED,
            reason="the GPU is held (a claim is allocated a MIG device on it that is not made yet, or "
            "which devices pods hold cannot be read); its MIG layout changes once it is free",
            blockers=(gpu.uuid,),
        )
    existing = [
        Existing(
            gi.profile,
            gi.start,
            busy=gi.busy or any(ci.uuid in busy_uuids for ci in gi.compute_instances),
            whole=not split(gi),
        )
        for gi in instances
    ]
    plan = plan_gpu(product, existing, dict(target.instances))
    if isinstance(plan, Infeasible):
        if plan.kind in (Infeasibility.BUSY_NOT_WANTED, Infeasibility.FRAGMENTED_BY_BUSY):
            return GpuChange(gpu, target, failure=Outcome.BLOCKED, reason=plan.reason, blockers=busy_migs)
        return GpuChange(gpu, target, failure=Outcome.FAILED, reason=plan.reason)
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
    if not change.target.mig_enabled or change.target.dynamic:
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
    parts = [f"{gi.profile}@{gi.start}" for gi in after.instances if split(gi)]
    if parts:
        return f"GPU instances split into smaller compute instances: {', '.join(parts)}"
    return None


def split(gi: GpuInstance) -> bool:
    """Whether a GPU instance holds compute instances smaller than it (`1c.3g.20gb`), or several: then
    it is not one MIG device of its profile."""
    cis = gi.compute_instances
    return len(cis) > 1 or any(device_profile(gi, ci) != gi.profile for ci in cis)


def _reset_reason(gpu: Gpu) -> str:
    return (
        f"MIG mode is set to {'on' if gpu.mig_pending else 'off'} and takes effect when the GPU is reset; "
        f"this agent never resets GPUs: drain the node and run `nvidia-smi -r -i {gpu.index}` (or reboot)"
    )
