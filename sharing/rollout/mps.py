"""The MPS control daemons as part of a change: after the hardware steps, each GPU's daemon is started,
restarted or stopped for what the GPU now has.

A daemon enforces the limits of its GPU's MPS replicas (`sharing.gpu.mps`), and those replicas are
offered only while it does (`sharing.rollout.advertise`). A GPU whose hardware change did not happen
keeps the daemon of the config still in effect on it. A daemon that cannot change while processes
run on its GPU makes that GPU's change wait for them (BLOCKED), one that fails to start fails it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from sharing.config import SharingConfig
from sharing.devices import MpsSettings, mps_settings
from sharing.gpu.mps import MpsDaemons
from sharing.mig import Catalog, Outcome
from sharing.model import GpuUuid, NodeState
from sharing.rollout.apply import ApplyReport


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
