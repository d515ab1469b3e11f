"""Who holds which device, as the agent asks it: the kubelet's PodResources (`sharing.kubelet.holders`),
the plugins' own recent Allocates, the ResourceClaims allocated from the node's DRA pool, and the claims
the DRA plugin has prepared and not yet unprepared.

Two questions, two costs. Deciding what may be destroyed believes PodResources only once it names every
pod the API server has bound here, and asks the API server for the claims the node's pods name (one
GET each, never a list of every claim): whatever cannot be read makes every device count as held.
Showing who holds what (`/status`, `/metrics`) takes the kubelet's List as it is and asks the API
server nothing, so scrapes cost it no request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

import structlog

from sharing.deviceplugin import HANDED_OUT_KEPT_S, Fleet
from sharing.devices import Inventory
from sharing.dra.holds import claim_holds
from sharing.errors import PluginError, SharingError
from sharing.kubelet import BoundPods, Holders, HoldingsSource, read_holders, recorded_allocations
from sharing.model import ClaimAllocation, NodeState
from sharing.rollout.frontend import DraFrontend
from sharing.text import bounded

log = structlog.get_logger(__name__)

LISTED_WITHIN_S = 2.0
"""How soon after Allocate returns the kubelet lists the allocation in PodResources (it does so at once:
it records it as Allocate returns). An Allocate older than that which PodResources does not list
belongs to a pod that has gone."""


AllocatedClaims = Callable[[], Awaitable[tuple[ClaimAllocation, ...]]]
"""The ResourceClaims with devices of this node's DRA pool allocated, found from the node's pods
(`sharing.kube.podclaims`)."""


class HoldersReader:
    """Reads who holds which device now, for a decision or for show."""

    def __init__(
        self,
        *,
        fleet: Fleet,
        pod_resources: HoldingsSource | None,
        bound_pods: BoundPods | None,
        claims: AllocatedClaims | None,
        dra: DraFrontend | None,
    ) -> None:
        self.fleet = fleet
        self.pod_resources = pod_resources
        self.bound_pods = bound_pods
        """The API server's pods bound to this node: what PodResources must list to be believed."""
        self.claims = claims
        """The API server's ResourceClaims allocated devices of this node's DRA pool: they hold them."""
        self.dra = dra
        self._unknown = ""
        """Why who holds what could not be told at the last look ("": it could)."""

    async def read(self, *, deciding: bool, node: NodeState) -> Holders:
        """Who holds which device right now (`deciding`: see the module); claims allocated from our DRA
        pool are asked for when deciding, resolved to devices on `node`."""
        loop = asyncio.get_running_loop()
        asked = loop.time()

        def recent() -> frozenset[str]:
            if self.pod_resources is None:  # no kubelet to list them: the whole window counts
                return self.fleet.recently_allocated(HANDED_OUT_KEPT_S)
            unlisted = loop.time() - asked + LISTED_WITHIN_S
            return self.fleet.recently_allocated(min(HANDED_OUT_KEPT_S, unlisted))

        holders = await read_holders(self.pod_resources, recent, self.bound_pods if deciding else None)
        if deciding and self.claims is not None:
            try:
                allocated = await self.claims()
            except SharingError as err:
                why = f"which ResourceClaims hold devices of this node cannot be read: {bounded(str(err))}"
                holders = replace(holders, unknown=holders.unknown or why)
            else:
                holders = replace(holders, claims=claim_holds(allocated, node))
        if self.dra is not None:
            # Prepared and not yet unprepared (its claim may be gone already): its container may run.
            # The plugin's own record, no API request: shown by `sharing status` too.
            prepared, unknown = await self.dra.prepared()
            named = {(c.namespace, c.name) for c in holders.claims}
            extra = tuple(c for c in prepared if (c.namespace, c.name) not in named)
            holders = replace(holders, claims=holders.claims + extra, unknown=holders.unknown or unknown)
        if not deciding:
            return holders
        if holders.unknown != self._unknown:  # said once per change, not on every re-check
            if holders.unknown:
                log.warning("holders_unknown", why=holders.unknown)
            else:
                log.info("holders_known_again")
            self._unknown = holders.unknown
        if not holders.unknown:
            # Listed by the kubelet: PodResources tracks them from now on (and says when they are free).
            self.fleet.forget_allocated(frozenset(i for h in holders.pods for i in h.device_ids))
        return holders

    async def reoffered_as_recorded(self, holders: Holders, inventory: Inventory) -> frozenset[str]:
        """While List cannot be believed: held devices `inventory` reoffers per the device manager's
        checkpoint (an agent that has just started remembers no form it withheld); every device of
        `inventory` when that cannot be read either (fail closed)."""
        if not holders.unknown or self.pod_resources is None:
            return frozenset()
        try:
            recorded = await asyncio.to_thread(recorded_allocations, self.fleet.settings.plugin_dir)
        except PluginError as err:
            log.warning("checkpoint_unreadable", error=bounded(str(err)))
            return frozenset(d.uuid for _, devices in inventory.resources for d in devices)
        return Holders(recorded).reoffered(inventory)
