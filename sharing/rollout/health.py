"""Following GPU health: XIDs make devices unhealthy, recoveries make them healthy again.

The backend's event source can fail (a raw driver error from the event wait): that is logged, and
the watch starts again after a growing pause, so health monitoring never dies silently. Each change
of health is pushed to the plugins (every replica and MIG device of the GPU), counted, and told in
an Event that names the GPU by index and product and says what the XID means.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from sharing.deviceplugin import Fleet
from sharing.devices import describe
from sharing.gpu import GpuBackend
from sharing.model import HealthEvent, NodeState
from sharing.ops import Metrics
from sharing.text import bounded

log = structlog.get_logger(__name__)
RESTART_MAX_S = 30.0

EventSink = Callable[[str, str, str], Awaitable[None]]


async def follow_health(
    backend: GpuBackend,
    fleet: Fleet,
    metrics: Metrics,
    node: Callable[[], NodeState],
    event: EventSink,
    *,
    changed: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run until cancelled: apply every health event (then `changed`, when the health state changed:
    the DRA front-end re-publishes its slices' taints); restart the event source when it fails."""
    failures = 0
    while True:
        try:
            async for change in backend.health_events():
                failures = 0
                if await _apply(change, fleet, metrics, node(), event) and changed is not None:
                    await changed()
        except Exception as err:  # never end silently: say why, then follow again
            failures += 1
            log.error("health_watch_failed", error=f"{type(err).__name__}: {bounded(str(err))}")
        await asyncio.sleep(min(RESTART_MAX_S, 0.5 * 2**failures))


async def _apply(
    change: HealthEvent, fleet: Fleet, metrics: Metrics, node: NodeState, event: EventSink
) -> bool:
    gpu = node.gpu(change.gpu_uuid)
    where = f"GPU {gpu.index} ({gpu.product})" if gpu else f"GPU {change.gpu_uuid}"
    if not change.healthy and change.xid is not None:
        metrics.xids.labels(gpu=str(gpu.index) if gpu else change.gpu_uuid, xid=str(change.xid)).inc()
    if not fleet.apply_health(change):
        return False
    what = f"MIG device {change.mig_uuid} of {where}" if change.mig_uuid else where
    if change.healthy:
        log.info("device_healthy", device=what)
        await event("Normal", "GpuHealthy", f"{what} is healthy again and advertised as such")
    else:
        log.warning("device_unhealthy", device=what, xid=change.xid)
        await event(
            "Warning",
            "GpuUnhealthy",
            f"{what} reported {describe(change.xid)}; its devices are advertised unhealthy until it recovers",
        )
    return True
