"""Withdrawing devices before they change: offer them no more, and wait until the kubelet agrees.

The devices go from what the front-end in service offers; on the device plugins the new list is
pushed to the kubelet, and the kubelet's PodResources `GetAllocatableResources` is polled until it
offers none of them in any form (`X` or its replicas `X::n`): from then on no pod can be admitted to
them, and an Allocate already in flight is refused (the plugin no longer knows the ID; one it
handed out a moment before stays listed, unhealthy, for the kubelet to read: `PluginServer.update`).
It is confirmed against what the kubelet offers, not against what this process advertised: after an
agent restart that is nothing, while the kubelet may still offer what the agent before it advertised. On
DRA the withdrawal holds once the API server has the slices: no scheduler allocates what they lack.
If the kubelet cannot confirm, the change waits (fail closed): `hold` keeps its steps from running.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Protocol

import structlog

from sharing.config import Frontend
from sharing.devices import Inventory, withdraw
from sharing.kubelet import HoldingsSource, device_of
from sharing.mig import Outcome
from sharing.rollout.advertise import Advertiser
from sharing.rollout.apply import NodePlan
from sharing.text import bounded, listed

log = structlog.get_logger(__name__)

CONFIRM_TIMEOUT_S = 10.0
"""How long the kubelet gets to stop offering withdrawn devices."""
WITHDRAW_ROUNDS = 3
"""How many withdrawals one change makes at most (what it removes may grow as its holders change) before
it waits."""


class PodResources(HoldingsSource, Protocol):
    """The kubelet's PodResources (sharing.kubelet.podresources.PodResourcesClient)."""

    async def allocatable(self) -> dict[str, frozenset[str]]:
        """{resource: healthy device IDs the kubelet can hand out}."""
        ...


async def withdraw_and_confirm(
    advertiser: Advertiser, pod_resources: PodResources | None, uuids: frozenset[str], showing: Inventory
) -> str:
    """Offer `showing` less these devices, and wait until the kubelet stops offering them; why not, or ""."""
    await advertiser.publish(withdraw(showing, uuids))
    if advertiser.frontend is Frontend.DRA:
        # Written once the API server has the slices: no scheduler allocates what they lack.
        return advertiser.dra_problem or (
            "" if advertiser.dra is not None else "no DRA front-end in this agent"
        )
    await advertiser.fleet.sync()
    if pod_resources is None:
        return ""
    log.info("devices_withdrawn", devices=len(uuids))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONFIRM_TIMEOUT_S
    delay = 0.01
    while True:
        try:
            offered = await pod_resources.allocatable()
        except Exception as err:  # any failure to confirm means: do not destroy
            why = bounded(str(err))
            return f"the kubelet could not confirm that the devices to change are withdrawn ({why})"
        still = {i for devices in offered.values() for i in devices if device_of(i) in uuids}
        if not still:
            return ""
        if loop.time() >= deadline:
            late = listed(sorted(still))
            return f"the kubelet still offers {late} {CONFIRM_TIMEOUT_S:.0f} s after their withdrawal"
        await asyncio.sleep(delay)  # polling the kubelet's own answer, with a deadline
        delay = min(delay * 2, 0.2)


def hold(plan: NodePlan, why: str) -> NodePlan:
    """The plan with every runnable change held back (blocked) for `why`."""
    held = tuple(
        replace(c, steps=(), failure=Outcome.BLOCKED, reason=why, blockers=tuple(sorted(c.removed())))
        if c.steps and c.failure is None
        else c
        for c in plan.changes
    )
    return replace(plan, changes=held)
