"""The MPS control daemons as part of a change and between changes: after the hardware steps, each
GPU's daemon is started, restarted or stopped for what the GPU now has; meanwhile they are asked
every few seconds whether they still answer.

A daemon enforces the limits of its GPU's MPS replicas (`sharing.gpu.mps`), and those replicas are
offered only while it does (`sharing.rollout.advertise`). A GPU whose hardware change did not happen
keeps the daemon of the config still in effect on it. A daemon that cannot change while processes
run on its GPU makes that GPU's change wait for them (BLOCKED), one that fails to start fails it. One
that stops answering makes its replicas unhealthy at once, and the reconcile that follows starts it
again; each way is said once with an Event on the Node.

A daemon's MPS server stays after its last client, a process of its GPU for NVML
(`sharing.model.beyond`), so a GPU whose only processes are its own daemon's idle servers is planned
as idle (`idle_servers_apart`), and before its MIG mode changes that daemon is stopped
(`stop_daemons_first`): a GPU changes its MIG mode only when idle.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace

import structlog

from sharing.config import SharingConfig
from sharing.devices import MpsSettings, mps_settings
from sharing.errors import SharingError
from sharing.gpu.mps import MpsDaemons
from sharing.mig import Catalog, GpuChange, Outcome
from sharing.model import GpuUuid, NodeState
from sharing.rollout.apply import ApplyReport, NodePlan
from sharing.store import PreparedClaim
from sharing.text import bounded

log = structlog.get_logger(__name__)

Event = Callable[[str, str, str], Awaitable[None]]
"""Records an Event on the Node: (type, reason, message)."""


async def enforce_mps(
    mps: MpsDaemons,
    config: SharingConfig,
    report: ApplyReport,
    after: NodeState,
    *,
    effective: Mapping[GpuUuid, SharingConfig | None],
    catalog: Catalog,
) -> tuple[ApplyReport, bool, frozenset[GpuUuid]]:
    """Start, restart or stop the MPS daemons for what each GPU now has: the report with the GPUs whose
    daemon waits (BLOCKED) or failed (FAILED), whether one failed, and the GPUs that wait.

    `effective` is the config in effect on each GPU before this change.
    """
    done = {g.uuid for g in report.gpus if g.outcome in (Outcome.APPLIED, Outcome.UNCHANGED)}
    wanted: dict[GpuUuid, MpsSettings] = {}
    for gpu in after.gpus:
        cfg = config if gpu.uuid in done else effective.get(gpu.uuid)
        settings = mps_settings(cfg, gpu, catalog)
        if settings is not None:
            wanted[gpu.uuid] = settings
    results = await mps.enforce(wanted, after)
    blocked: set[GpuUuid] = set()
    failed = False
    gpus = []
    for g in report.gpus:
        result = results.get(g.uuid)
        if g.uuid in done and result is not None and result.outcome in (Outcome.BLOCKED, Outcome.FAILED):
            failed |= result.outcome is Outcome.FAILED
            if result.outcome is Outcome.BLOCKED:
                blocked.add(g.uuid)
            blockers = (g.uuid,) if result.outcome is Outcome.BLOCKED else ()
            gpus.append(replace(g, outcome=result.outcome, reason=result.reason, blockers=blockers))
        else:
            gpus.append(g)
    return replace(report, gpus=tuple(gpus)), failed, frozenset(blocked)


async def idle_servers_apart(mps: MpsDaemons, node: NodeState) -> NodeState:
    """The node with each whole GPU busy only when processes other than its daemon's idle MPS servers
    run there (those end with the daemon, which `stop_daemons_first` stops before a change)."""
    gpus = []
    for gpu in node.gpus:
        busy = await mps.in_use(gpu) if gpu.busy and not gpu.mig_enabled else gpu.busy
        gpus.append(replace(gpu, busy=busy))
    return replace(node, gpus=tuple(gpus))


async def stop_daemons_first(mps: MpsDaemons, plan: NodePlan) -> NodePlan:
    """Stop the daemon of every GPU about to change its hardware; a change whose daemon has clients
    now (a pod came since the plan) or could not be stopped waits (BLOCKED) or fails."""
    return replace(plan, changes=tuple([await _daemon_first(mps, c) for c in plan.changes]))


async def _daemon_first(mps: MpsDaemons, change: GpuChange) -> GpuChange:
    if not change.steps or change.failure is not None:
        return change
    result = await mps.stop_unused(change.gpu.uuid)
    if result.outcome not in (Outcome.BLOCKED, Outcome.FAILED):
        return change
    blockers = (change.gpu.uuid,) if result.outcome is Outcome.BLOCKED else ()
    return replace(change, steps=(), failure=result.outcome, reason=result.reason, blockers=blockers)


async def watch_mps(
    mps: MpsDaemons,
    *,
    every_s: float,
    republish: Callable[[], Awaitable[None]],
    trigger: Callable[[], None],
    node: Callable[[], NodeState],
    event: Event,
) -> None:
    """Ask the MPS daemons whether they answer: one that stopped makes its replicas unhealthy at
    once (`republish`), and the reconcile that follows (`trigger`) starts it again."""
    down: set[str] = set()
    while True:
        await asyncio.sleep(every_s)
        try:
            changed = await mps.check()
        except SharingError as err:
            log.warning("mps_check_failed", error=bounded(str(err)))
            continue
        if changed:
            await republish()
            trigger()

        def where(uuid: str) -> str:
            gpu = node().gpu(uuid)
            return f"GPU {gpu.index} ({gpu.product})" if gpu else f"GPU {uuid}"

        down = await _said(mps, down, event, where, "its replicas are unhealthy until it is started again")


async def watch_claim_mps(
    mps: MpsDaemons,
    *,
    every_s: float,
    observe: Callable[[], Awaitable[NodeState]],
    claims: Callable[[], Sequence[PreparedClaim]],
    event: Event,
) -> None:
    """Ask the MPS daemons of the on-demand MIG devices claims share (`sharing.dra.ondemand`) whether
    they answer, as `watch_mps` asks the GPUs': one that stopped is said (`MpsDaemonDown`) and started
    again at once (`MpsDaemons.restart`, counted in its restarts), or once the processes still on its
    device have ended; `claims` (the DRA checkpoint's) name each device's claim."""
    down: set[str] = set()
    while True:
        await asyncio.sleep(every_s)
        try:
            await mps.check()
            owners = {d.uuid: f"{c.namespace}/{c.name}" for c in claims() for d in c.devices}
            where = functools.partial(_claims_device, owners)
            gone = "the claim's pods reach no MPS server until it is started again"
            down = await _said(mps, down, event, where, gone)
            stopped = [s.gpu for s in mps.status() if not s.healthy]
            if stopped:  # what runs on their devices, read only then
                node = await observe()
                for device in stopped:
                    result = await mps.restart(device, node)
                    if result.outcome is not Outcome.UNCHANGED:
                        log.info("claim_mps_daemon_restart", mig=device, outcome=result.outcome.value,
                                 reason=result.reason)  # fmt: skip
        except SharingError as err:
            log.warning("mps_check_failed", error=bounded(str(err)))


def _claims_device(owners: Mapping[str, str], uuid: str) -> str:
    """`MIG device <uuid> (claim <namespace>/<name>)`."""
    return f"MIG device {uuid}" + (f" (claim {owners[uuid]})" if uuid in owners else "")


async def _said(
    mps: MpsDaemons, down: set[str], event: Event, where: Callable[[str], str], gone: str
) -> set[str]:
    """An Event when a daemon stops answering (`gone`: what that means), and one when it answers
    again; the devices down."""
    daemons = mps.status()
    now: set[str] = {s.gpu for s in daemons if s.enforced is None}
    healthy = {s.gpu for s in daemons if s.healthy}
    for uuid in sorted(now ^ down):
        if uuid in now:
            await event(
                "Warning", "MpsDaemonDown", f"the MPS control daemon of {where(uuid)} does not answer: {gone}"
            )
        elif uuid in healthy:
            await event(
                "Normal", "MpsDaemonHealthy", f"the MPS control daemon of {where(uuid)} answers again"
            )
    return now
