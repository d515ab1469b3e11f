"""Rolling a config out to the GPUs without ever handing out, destroying or advertising a slice wrongly.

Per GPU, for every change that destroys or alters a device:
1. plan from a fresh observation and the devices in use (`sharing.kubelet.holders`: pods per PodResources,
   the plugins' own recent Allocates, NVML processes; all counted as held when PodResources
   cannot be read, or does not list every pod the API server has bound to this node);
2. withdraw the devices the plan removes from what the plugins advertise, push that to the
   kubelet, and wait until the kubelet's PodResources no longer lists them as allocatable: from
   then on no pod can be admitted to them (an Allocate already in flight is refused: the plugin no
   longer knows the ID). If the kubelet cannot confirm, nothing is destroyed (fail closed);
3. observe and read the holders again, and plan again: a plan that now removes more is withdrawn
   again first;
4. run the steps (journaled) under the journal's lock, re-observe and verify;
5. advertise only what the hardware has: a GPU whose change did not happen keeps its devices under
   the names of the config last applied to it, and a GPU in MIG mode is never a whole GPU.
Devices withdrawn but not destroyed come back with the next advertisement.

A config can also change how a device is offered without touching the hardware (replicas, names).
The kubelet tracks allocations by resource and device ID, so such a device is withdrawn and
confirmed gone first; then a device a pod holds in a form the new one does not keep (held as `X`,
now `X::0`...; held as `X::0`, now `X`, or under another name) stays withheld until it is free,
and the verdict says it waits for those pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import structlog

from sharing.config import Frontend, SharingConfig
from sharing.deviceplugin import Fleet
from sharing.devices import (
    ENVVAR_BY_UUID,
    Health,
    Injection,
    Inventory,
    MpsSettings,
    build_inventory,
    mps_layout,
    mps_settings,
    reformed,
    with_health,
    withdraw,
)
from sharing.dra.holds import claim_holds
from sharing.errors import PluginError, SharingError
from sharing.gpu import GpuBackend, build_spec, write_spec
from sharing.gpu.mps import MpsDaemons, Readiness
from sharing.kubelet import BoundPods, Holders, HoldingsSource, device_of, read_holders, recorded_allocations
from sharing.labels import ConfigState
from sharing.mig import Catalog, Outcome
from sharing.model import ClaimAllocation, Gpu, GpuUuid, NodeState
from sharing.ops import Metrics
from sharing.rollout.apply import ApplyReport, NodePlan, execute, plan_node
from sharing.rollout.frontend import DraFrontend
from sharing.rollout.verdict import Retry, Verdict, verdict
from sharing.store import Journal, JournalCorruptError, JournalError
from sharing.text import bounded, listed

log = structlog.get_logger(__name__)

RECENT_ALLOCATE_S = 30.0
"""How long a device counts as held after Allocate handed it out (PodResources catches up long before)."""
LISTED_WITHIN_S = 2.0
"""How soon after Allocate returns the kubelet lists the allocation in PodResources (it does so at once:
it records it as Allocate returns). An Allocate older than that which PodResources does not list
belongs to a pod that has gone."""
CONFIRM_TIMEOUT_S = 10.0
"""How long the kubelet gets to stop offering withdrawn devices."""
WITHDRAW_ROUNDS = 3


PoolClaims = Callable[[], Awaitable[tuple[ClaimAllocation, ...]]]
"""The ResourceClaims with devices of this node's DRA pool allocated (what `list_claims_of_pool` of
sharing.kube calls `allocated`)."""


class PodResources(HoldingsSource, Protocol):
    """The kubelet's PodResources (sharing.kubelet.podresources.PodResourcesClient)."""

    async def allocatable(self) -> dict[str, frozenset[str]]:
        """{resource: healthy device IDs the kubelet can hand out}."""
        ...


class Rollout:
    """The hardware side of the agent: applies configs safely and keeps the fleet's devices true."""

    def __init__(
        self,
        *,
        backend: GpuBackend,
        fleet: Fleet,
        catalog: Catalog,
        journal: Journal,
        pod_resources: PodResources | None,
        bound_pods: BoundPods | None = None,
        claims: PoolClaims | None = None,
        dra: DraFrontend | None = None,
        injection: Injection = ENVVAR_BY_UUID,
        cdi_spec_dir: Path | None = None,
        metrics: Metrics | None = None,
        mps: MpsDaemons | None = None,
    ) -> None:
        self.metrics = metrics
        self.mps = mps
        """The MPS control daemons (None: MPS is not offered on this node)."""
        self.mps_blocked: frozenset[GpuUuid] = frozenset()
        """GPUs whose MPS change waits for the processes on them to end (at the last rollout)."""
        self._mps_wanted: dict[GpuUuid, MpsSettings] = {}
        """What each GPU's daemon must enforce for the devices advertised (their config in effect)."""
        self.backend = backend
        self.injection = injection
        self.cdi_spec_dir = cdi_spec_dir
        self.fleet = fleet
        self.catalog = catalog
        self.journal = journal
        self.pod_resources = pod_resources
        self.bound_pods = bound_pods
        """The API server's pods bound to this node: what PodResources must list to be believed."""
        self.claims = claims
        self.dra = dra
        self.frontend = Frontend.DEVICE_PLUGIN
        """Where `advertise` sends the devices (`sharing.rollout.frontend` switches it)."""
        self.dra_problem = ""
        """Why the DRA front-end could not publish the last inventory ("": it did)."""
        """The API server's ResourceClaims allocated devices of this node's DRA pool: they hold them."""
        self.effective: dict[GpuUuid, SharingConfig | None] = {}
        """The config last applied to each GPU (absent: none yet, advertised as it is)."""
        self.advertised = Inventory()
        """What the fleet was last told to advertise (health aside)."""
        self._shown = Inventory()
        """What the front-end was last given: `advertised`, less what a change under way withdrew."""
        self.withheld: dict[str, tuple[str, ...]] = {}
        """Devices held in a form the config in effect does not keep -> `namespace/pod` holding each."""
        self._seen: dict[GpuUuid, Gpu] = {}
        self._unknown = ""
        """Why who holds what could not be told at the last look ("": it could)."""
        self.node = NodeState(())
        """The node the advertised inventory was built from (for the CDI spec)."""

    async def holders(self, *, deciding: bool = True, node: NodeState | None = None) -> Holders:
        """Who holds which device right now.

        `deciding`: the answer decides what may be destroyed, so a List that may be short (it does not
        name every pod the API server bound here) makes every device count as held. Showing who holds
        what (`/status`, `/metrics`) is no decision: it takes the kubelet's List as it is and asks the
        API server nothing, so scrapes cost the API server no request. Claims allocated from our DRA
        pool are asked for when deciding (resolved to devices on `node`, default the advertised one).
        """
        loop = asyncio.get_running_loop()
        asked = loop.time()

        def recent() -> frozenset[str]:
            if self.pod_resources is None:  # no kubelet to list them: the whole window counts
                return self.fleet.recently_allocated(RECENT_ALLOCATE_S)
            unlisted = loop.time() - asked + LISTED_WITHIN_S
            return self.fleet.recently_allocated(min(RECENT_ALLOCATE_S, unlisted))

        holders = await read_holders(self.pod_resources, recent, self.bound_pods if deciding else None)
        if deciding and self.claims is not None:
            try:
                allocated = await self.claims()
            except SharingError as err:
                why = f"which ResourceClaims hold devices of this node cannot be read: {bounded(str(err))}"
                holders = replace(holders, unknown=holders.unknown or why)
            else:
                holders = replace(holders, claims=claim_holds(allocated, node or self.node))
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

    async def roll_out(
        self, config: SharingConfig, observed: NodeState, on_pending: Callable[[], Awaitable[None]]
    ) -> tuple[Verdict, NodeState]:
        """Make the GPUs match `config` as far as is safe; the verdict and the node afterwards.

        `on_pending` runs just before the first hardware step (the agent sets the state label).
        """
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.journal.locked())
                unfinished = await asyncio.to_thread(self.journal.unfinished)
            except JournalError as err:  # no step runs without its journal; the devices stay as they are
                corrupt = isinstance(err, JournalCorruptError)
                log.error("journal_corrupt" if corrupt else "journal_unusable", error=bounded(str(err)))
                reason = "JournalCorrupt" if corrupt else "JournalUnusable"
                return Verdict(ConfigState.FAILED, reason, str(err), "journal", retry=Retry.BACKOFF), observed
            withdrawn: frozenset[str] = frozenset()
            started = time.monotonic()
            for round_ in range(WITHDRAW_ROUNDS + 1):
                if round_:  # after a withdrawal: what is there and who holds it, again
                    observed = await self.backend.observe()
                holders = await self.holders(node=observed)
                plan = plan_node(
                    observed, config, catalog=self.catalog, busy_uuids=holders.busy_uuids(observed),
                    unfinished=unfinished,
                )  # fmt: skip
                removed = plan.removed()
                if removed <= withdrawn:
                    break
                if round_ == WITHDRAW_ROUNDS:
                    plan = _hold(
                        plan, "the devices in use kept changing while their withdrawal was confirmed"
                    )
                    break
                withdrawn |= removed
                problem = await self._withdraw(withdrawn)
                if problem:
                    plan = _hold(plan, problem)
                    break
            if plan.runnable:
                await on_pending()
            # Also with nothing to run: a crashed run's journal is cleared once nothing is left of it.
            report = await execute(self.backend, self.journal, plan, config=config.name)
            if plan.runnable:
                self._count(report, time.monotonic() - started)
        after = report.after or observed
        report, mps_failed = await self._enforce_mps(config, report, after)
        for gpu in report.gpus:
            if gpu.outcome in (Outcome.APPLIED, Outcome.UNCHANGED):
                self.effective[gpu.uuid] = config
            if gpu.steps and after.gpu(gpu.uuid) is None:
                # Changed, then unreadable: what it had before is no longer known to exist.
                self._seen.pop(gpu.uuid, None)
        result = verdict(config, report, holders, after)
        if mps_failed and result.retry is Retry.NONE:
            result = replace(result, retry=Retry.BACKOFF)  # a daemon that did not start may next time
        return result, after

    async def _enforce_mps(
        self, config: SharingConfig, report: ApplyReport, after: NodeState
    ) -> tuple[ApplyReport, bool]:
        """Start, restart or stop the MPS daemons for what each GPU now has; the report with the GPUs
        whose daemon waits (BLOCKED) or failed (FAILED), and whether one failed.

        A GPU whose hardware change did not happen keeps the daemon of the config still in effect on it.
        """
        if self.mps is None:
            return report, False
        done = {g.uuid for g in report.gpus if g.outcome in (Outcome.APPLIED, Outcome.UNCHANGED)}
        wanted: dict[GpuUuid, MpsSettings] = {}
        for gpu in after.gpus:
            cfg = config if gpu.uuid in done else self.effective.get(gpu.uuid)
            settings = mps_settings(cfg, gpu, self.catalog)
            if settings is not None:
                wanted[gpu.uuid] = settings
        results = await self.mps.enforce(wanted, after)
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
        self.mps_blocked = frozenset(blocked)
        return replace(report, gpus=tuple(gpus)), failed

    def offered(self) -> Inventory:
        """What the plugins offer: the advertised devices less MPS replicas whose daemon does not
        enforce their limits yet, unhealthy where it stopped answering (health events aside)."""
        return self._mps_ready(self.advertised)

    async def republish(self) -> None:
        """Advertise the same devices again with what the MPS daemons answer now (a daemon gone: its
        replicas unhealthy), or with new health on DRA. The devices last shown, not `advertised`: in
        the middle of a change that would offer again what it withdrew before destroying it."""
        await self._publish(self._shown)

    async def advertise(self, observed: NodeState, config: SharingConfig | None) -> Inventory:
        """Tell the fleet what the hardware has, each GPU under the config in effect on it.

        `config` names the node's config (allocation rules); GPUs it was not applied to keep theirs.
        A GPU that cannot be read keeps its last known devices, advertised unhealthy. A device offered
        in a new form (replicas, names) is withdrawn first; one held in a form it loses is withheld.
        """
        self._seen.update((g.uuid, g) for g in observed.gpus)
        lost = [
            self._seen[u.uuid]
            for u in observed.unreadable
            if u.uuid is not None and u.uuid in self._seen and observed.gpu(u.uuid) is None
        ]
        gpus = tuple(sorted((*observed.gpus, *lost), key=lambda g: g.index))
        inventory = build_inventory(
            replace(observed, gpus=gpus), config, catalog=self.catalog, per_gpu=self.effective
        )
        if lost:
            inventory = _unhealthy(inventory, frozenset(g.uuid for g in lost))
        for warning in inventory.warnings:
            log.warning("inventory_warning", warning=bounded(warning))
        self.node = replace(observed, gpus=gpus)
        self._mps_wanted = mps_layout(self.node, config, self.catalog, per_gpu=self.effective)
        changed = reformed(self.advertised, inventory)
        unconfirmed = ""
        if changed:
            # Never in between: neither their old form nor (for what is still withheld) the new one.
            unconfirmed = await self._withdraw(changed, showing=withdraw(inventory, set(self.withheld)))
        holders = await self.holders()
        withheld = holders.reoffered(inventory) | await self._reoffered_as_recorded(holders, inventory)
        if (unconfirmed or holders.unknown) and (changed or self.withheld):
            # Nobody can tell who holds them: what changes form (or was withheld) stays out (fail closed).
            withheld |= changed | frozenset(self.withheld)
            log.warning(
                "reformed_devices_withheld", devices=len(withheld), why=unconfirmed or holders.unknown
            )
        self.withheld = {uuid: holders.pods_holding({uuid}) for uuid in sorted(withheld)}
        inventory = withdraw(inventory, withheld)
        self.advertised = inventory
        await self._publish(inventory)
        return inventory

    async def _reoffered_as_recorded(self, holders: Holders, inventory: Inventory) -> frozenset[str]:
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

    def _mps_ready(self, inventory: Inventory) -> Inventory:
        """MPS replicas only where their GPU's daemon enforces their limits: unhealthy where the daemon
        started for them no longer answers, absent where none enforces them yet (fail closed)."""
        if self.mps is None:
            return inventory
        state = {u: self.mps.readiness(u, s) for u, s in self._mps_wanted.items()}
        gpus = {d.gpu_uuid for _, devices in inventory.resources for d in devices if d.mps}
        pending = {u for u in gpus if state.get(u, Readiness.PENDING) is Readiness.PENDING}
        down = frozenset(u for u in gpus if state.get(u) is Readiness.DOWN)
        resources = tuple(
            (name, kept)
            for name, devices in inventory.resources
            if (kept := tuple(d for d in devices if not (d.mps and d.gpu_uuid in pending)))
        )
        return _unhealthy(replace(inventory, resources=resources), down)

    async def _publish(self, inventory: Inventory) -> None:
        """The CDI spec first (every name Allocate can hand out resolves), then the plugins; on the DRA
        front-end the node's ResourceSlices (the DRA plugin writes a CDI spec per claim itself)."""
        self._shown = inventory
        inventory = self._mps_ready(inventory)
        if self.frontend is Frontend.DRA:
            if self.dra is None:
                return
            # Health events reach the device plugins through the fleet; the slices carry them as taints.
            self.dra_problem = await self.dra.publish(with_health(inventory, self.fleet.health), self.node)
            if self.dra_problem:
                log.error("slices_not_published", error=bounded(self.dra_problem))
            return
        if self.cdi_spec_dir is not None:
            spec = (
                build_spec(
                    inventory,
                    self.node,
                    self.backend.device_files,
                    self.injection.ids,
                    mps_root=self.injection.mps_root,
                )
                if self.injection.cdi
                else None
            )
            try:
                if await asyncio.to_thread(write_spec, self.cdi_spec_dir, spec):
                    log.info(
                        "cdi_spec_written",
                        dir=str(self.cdi_spec_dir),
                        devices=len(spec["devices"]) if spec else 0,
                    )
            except OSError as err:
                # The plugins still advertise: a container using CDI names would fail to start,
                # and the kubelet says so on the pod; the log says why here.
                log.error("cdi_spec_not_written", dir=str(self.cdi_spec_dir), error=bounded(str(err)))
        self.fleet.update(inventory)

    def _count(self, report: ApplyReport, seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics.apply_seconds.observe(seconds)
        for gpu in report.gpus:
            for step in gpu.steps:
                self.metrics.steps.labels(kind=step.kind.value, result="done").inc()
            if gpu.failed_step is not None:
                self.metrics.steps.labels(kind=gpu.failed_step.kind.value, result="failed").inc()

    async def withdraw_all(self, uuids: frozenset[str]) -> str:
        """Offer none of these devices through the front-end in service and confirm it; why not, or ""."""
        self.withheld = {}
        problem = await self._withdraw(uuids, showing=Inventory())
        self.advertised = Inventory()
        return problem

    def forget(self) -> None:
        """No config manages the GPUs any more: advertise each as it is."""
        self.effective.clear()

    async def _withdraw(self, uuids: frozenset[str], showing: Inventory | None = None) -> str:
        """Stop advertising these devices and wait until the kubelet stops offering them; why not, or "".

        `showing`: what to advertise meanwhile (default: what is advertised now), less these devices.
        Confirmed against what the kubelet offers (GetAllocatableResources: every healthy device of
        every resource, in any form: `X` or its replicas `X::n`), not against what this process
        advertised: after an agent restart that is nothing, while the kubelet may still offer what
        the agent before it advertised.
        """
        await self._publish(withdraw(self.advertised if showing is None else showing, uuids))
        if self.frontend is Frontend.DRA:
            # Written once the API server has the slices: no scheduler allocates what they lack.
            return self.dra_problem or ("" if self.dra is not None else "no DRA front-end in this agent")
        await self.fleet.sync()
        if self.pod_resources is None:
            return ""
        log.info("devices_withdrawn", devices=len(uuids))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONFIRM_TIMEOUT_S
        delay = 0.01
        while True:
            try:
                offered = await self.pod_resources.allocatable()
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


def _hold(plan: NodePlan, why: str) -> NodePlan:
    """The plan with every runnable change held back (blocked) for `why`."""
    held = tuple(
        replace(c, steps=(), failure=Outcome.BLOCKED, reason=why, blockers=tuple(sorted(c.removed())))
        if c.steps and c.failure is None
        else c
        for c in plan.changes
    )
    return replace(plan, changes=held)


def _unhealthy(inventory: Inventory, gpus: frozenset[GpuUuid]) -> Inventory:
    resources = tuple(
        (name, tuple(replace(d, health=Health.UNHEALTHY) if d.gpu_uuid in gpus else d for d in devices))
        for name, devices in inventory.resources
    )
    return replace(inventory, resources=resources)
