"""Rolling a config out to the GPUs without ever handing out, destroying or advertising a slice wrongly.

Per GPU, for every change that destroys or alters a device:
1. plan from a fresh observation and the devices in use (`sharing.rollout.holding`: pods per
   PodResources, the plugins' own recent Allocates, claims of the DRA pool, NVML processes; all
   counted as held when PodResources cannot be read, or does not list every pod the API server has
   bound to this node);
2. withdraw the devices the plan removes from what the plugins advertise, push that to the
   kubelet, and wait until the kubelet's PodResources no longer lists them as allocatable
   (`sharing.rollout.withdraw`): from then on no pod can be admitted to them (an Allocate already in
   flight is refused: the plugin no longer knows the ID, or lists it unhealthy). If the kubelet
   cannot confirm, nothing is destroyed (fail closed);
3. observe and read the holders again, and plan again: a plan that now removes more is withdrawn
   again first;
4. run the steps (journaled) under the journal's lock, re-observe and verify; the MPS daemons follow
   (`sharing.rollout.mps`);
5. advertise only what the hardware has (`sharing.rollout.advertise`): a GPU whose change did not
   happen keeps its devices under the names of the config last applied to it, and a GPU in MIG mode
   is never a whole GPU.
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

import structlog

from sharing.config import Frontend, SharingConfig
from sharing.deviceplugin import Fleet
from sharing.devices import ENVVAR_BY_UUID, Injection, Inventory, reformed, withdraw
from sharing.gpu import GpuBackend
from sharing.gpu.mps import MpsDaemons
from sharing.kubelet import BoundPods, Holders
from sharing.labels import ConfigState
from sharing.mig import Catalog, Outcome
from sharing.model import GpuUuid, NodeState
from sharing.ops import Metrics
from sharing.rollout.advertise import Advertiser
from sharing.rollout.apply import ApplyReport, execute, plan_node
from sharing.rollout.frontend import DraFrontend
from sharing.rollout.holding import AllocatedClaims, HoldersReader
from sharing.rollout.mps import enforce_mps, idle_servers_apart, stop_daemons_first
from sharing.rollout.verdict import Retry, Verdict, verdict
from sharing.rollout.withdraw import WITHDRAW_ROUNDS, PodResources, hold, withdraw_and_confirm
from sharing.store import Journal, JournalCorruptError, JournalError
from sharing.text import bounded

log = structlog.get_logger(__name__)


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
        claims: AllocatedClaims | None = None,
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
        self.backend = backend
        self.fleet = fleet
        self.catalog = catalog
        self.journal = journal
        self.pod_resources = pod_resources
        self.dra = dra
        self._holders = HoldersReader(
            fleet=fleet, pod_resources=pod_resources, bound_pods=bound_pods, claims=claims, dra=dra
        )
        self._advertiser = Advertiser(
            backend=backend, fleet=fleet, catalog=catalog, dra=dra, injection=injection,
            cdi_spec_dir=cdi_spec_dir, mps=mps,
        )  # fmt: skip
        self.effective: dict[GpuUuid, SharingConfig | None] = {}
        """The config last applied to each GPU (absent: none yet, advertised as it is)."""
        self.advertised = Inventory()
        """What the fleet was last told to advertise (health aside)."""
        self.withheld: dict[str, tuple[str, ...]] = {}
        """Devices held in a form the config in effect does not keep -> `namespace/pod` holding each."""

    @property
    def frontend(self) -> Frontend:
        """Where `advertise` sends the devices (`sharing.rollout.switch` switches it)."""
        return self._advertiser.frontend

    @frontend.setter
    def frontend(self, frontend: Frontend) -> None:
        self._advertiser.frontend = frontend

    @property
    def node(self) -> NodeState:
        """The node the advertised inventory was built from."""
        return self._advertiser.node

    async def holders(self, *, deciding: bool = True, node: NodeState | None = None) -> Holders:
        """Who holds which device right now (`sharing.rollout.holding`): for a decision, or for show
        (`deciding` False); claims resolved to devices on `node` (default: the advertised one)."""
        return await self._holders.read(deciding=deciding, node=node or self.node)

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
                planned = observed if self.mps is None else await idle_servers_apart(self.mps, observed)
                plan = plan_node(
                    planned, config, catalog=self.catalog, busy_uuids=holders.busy_uuids(observed),
                    unfinished=unfinished,
                )  # fmt: skip
                removed = plan.removed()
                if removed <= withdrawn:
                    break
                if round_ == WITHDRAW_ROUNDS:
                    plan = hold(plan, "the devices in use kept changing while their withdrawal was confirmed")
                    break
                withdrawn |= removed
                problem = await self._withdraw(withdrawn)
                if problem:
                    plan = hold(plan, problem)
                    break
            if plan.runnable and self.mps is not None:
                plan = await stop_daemons_first(self.mps, plan)
            if plan.runnable:
                await on_pending()
            # Also with nothing to run: a crashed run's journal is cleared once nothing is left of it.
            report = await execute(self.backend, self.journal, plan, config=config.name)
            if plan.runnable:
                self._count(report, time.monotonic() - started)
        after = report.after or observed
        mps_failed = False
        if self.mps is not None:
            report, mps_failed, self.mps_blocked = await enforce_mps(
                self.mps, config, report, after, effective=self.effective, catalog=self.catalog
            )
        for gpu in report.gpus:
            if gpu.outcome in (Outcome.APPLIED, Outcome.UNCHANGED):
                self.effective[gpu.uuid] = config
            if gpu.steps and after.gpu(gpu.uuid) is None:
                # Changed, then unreadable: what it had before is no longer known to exist.
                self._advertiser.forget(gpu.uuid)
        result = verdict(config, report, holders, after)
        if mps_failed and result.retry is Retry.NONE:
            result = replace(result, retry=Retry.BACKOFF)  # a daemon that did not start may next time
        return result, after

    def offered(self) -> Inventory:
        """What the plugins offer: the advertised devices less MPS replicas whose daemon does not
        enforce their limits yet, unhealthy where it stopped answering (health events aside)."""
        return self._advertiser.ready(self.advertised)

    async def republish(self) -> None:
        """Advertise the same devices again with what the MPS daemons answer now (a daemon gone: its
        replicas unhealthy), or with new health on DRA. The devices last shown, not `advertised`: in
        the middle of a change that would offer again what it withdrew before destroying it."""
        await self._advertiser.republish()

    async def advertise(self, observed: NodeState, config: SharingConfig | None) -> Inventory:
        """Tell the fleet what the hardware has, each GPU under the config in effect on it.

        `config` names the node's config (allocation rules); GPUs it was not applied to keep theirs.
        A GPU that cannot be read keeps its last known devices, advertised unhealthy. A device offered
        in a new form (replicas, names) is withdrawn first; one held in a form it loses is withheld.
        """
        inventory = self._advertiser.build(observed, config, self.effective)
        changed = reformed(self.advertised, inventory)
        unconfirmed = ""
        if changed:
            # Never in between: neither their old form nor (for what is still withheld) the new one.
            unconfirmed = await self._withdraw(changed, showing=withdraw(inventory, set(self.withheld)))
        holders = await self.holders()
        recorded = await self._holders.reoffered_as_recorded(holders, inventory)
        withheld = holders.reoffered(inventory) | recorded
        if (unconfirmed or holders.unknown) and (changed or self.withheld):
            # Nobody can tell who holds them: what changes form (or was withheld) stays out (fail closed).
            withheld |= changed | frozenset(self.withheld)
            log.warning(
                "reformed_devices_withheld", devices=len(withheld), why=unconfirmed or holders.unknown
            )
        self.withheld = {uuid: holders.pods_holding({uuid}) for uuid in sorted(withheld)}
        inventory = withdraw(inventory, withheld)
        self.advertised = inventory
        await self._advertiser.publish(inventory)
        return inventory

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
        """
        shown = self.advertised if showing is None else showing
        return await withdraw_and_confirm(self._advertiser, self.pod_resources, uuids, shown)
