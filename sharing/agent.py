"""The agent: one level-triggered reconcile loop from ConfigMaps + Node label to GPUs, plugins and labels.

Triggers (Node label or ConfigMap change, SIGHUP, periodic resync, a retry) only wake the loop
(GPU health goes straight to the plugins, `sharing.rollout.health`); bursts coalesce and every reconcile
starts from fresh observations: the front-end the node asks for (`sharing.rollout.switch`) -> select a
config -> roll it out safely (`sharing.rollout.rollout`) -> advertise -> labels, annotations and
Events; the MPS daemons are watched beside it (`sharing.rollout.mps`), and the usage sampler reads
what the slices are doing on a thread of its own (`sharing.usage`, once the node is ours). Bad input
leaves the node on its last good config with state `failed` and an Event that says why; the plugins
keep serving whatever happens to the API server. A change that devices in use block is re-checked every few
seconds (cheaply: who holds what) and applied as soon as they are free; a change that failed for a
reason that may pass is retried with a growing delay. An agent that restarts while the API server is
out of reach advertises the config it last applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence

import structlog

from sharing import __version__
from sharing.config import (
    ConfigSet,
    Failed,
    Frontend,
    MigStrategy,
    Selected,
    SharingConfig,
    choose_frontend,
    identity,
    is_dynamic,
    select_config,
)
from sharing.deviceplugin import Fleet
from sharing.devices.mps import mps_layout
from sharing.dra.names import DRIVER
from sharing.errors import SharingError
from sharing.gpu import GpuBackend
from sharing.gpu.mps import MpsDaemons
from sharing.gpu.mpscontrol import CONTROL
from sharing.kube import ConfigSources, KubeClient, NodePublisher, watch_node
from sharing.kube.features import PARTITIONABLE
from sharing.kube.podclaims import claims_of_node_pods
from sharing.kube.sources import per_config
from sharing.labels import ConfigState
from sharing.mig import Catalog
from sharing.model import ClaimAllocation, NodeState
from sharing.ops import ConfigStatus, HttpServer, Metrics, Reporter
from sharing.rollout import Drainer, PodResources, Retry, Rollout, Verdict, follow_health, held_back
from sharing.rollout.frontend import DraFrontend
from sharing.rollout.mps import watch_claim_mps, watch_mps
from sharing.rollout.switch import Frontends
from sharing.settings import Settings
from sharing.store import Journal
from sharing.text import bounded
from sharing.usage import HeldSlice, SliceReport, UsageSampler, held_slices, idle

log = structlog.get_logger(__name__)

RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
OWNER_POLL_S = 0.5
"""How often an agent that waits for the node (another agent owns it) tries the owner's lock."""
API_GRACE_S = 5.0
"""How long a starting agent waits for the API server before serving the config it last applied."""
HELD_TIMEOUT_S = 30.0
"""How long the usage sampler waits for the agent's loop to say who holds which slice."""


class Agent:
    """Wires the watches, the backend, the rollout, the fleet and the Kubernetes API together."""

    def __init__(
        self,
        settings: Settings,
        *,
        kube: KubeClient,
        backend: GpuBackend,
        fleet: Fleet,
        catalog: Catalog,
        pod_resources: PodResources | None = None,
        dra: DraFrontend | None = None,
        metrics: Metrics | None = None,
        claim_mps: MpsDaemons | None = None,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.backend = backend
        self.fleet = fleet
        self.catalog = catalog
        self.dra = dra
        self.metrics = metrics or Metrics(__version__)
        self.mps = MpsDaemons(
            settings.mps_root,
            settings.driver_root / CONTROL,
            backend.set_compute_mode,
            keeper=settings.mps_keeper_socket,
        )
        self.rollout = Rollout(
            backend=backend,
            fleet=fleet,
            catalog=catalog,
            journal=Journal(settings.journal),
            pod_resources=pod_resources,
            bound_pods=lambda: asyncio.to_thread(kube.list_node_pods, settings.node_name),
            claims=self._allocated_claims if dra is not None else None,
            dra=dra,
            injection=settings.injection(),
            cdi_spec_dir=settings.cdi_spec_dir,
            metrics=self.metrics,
            mps=self.mps,
        )
        self.usage = (
            UsageSampler(
                backend.usage_reader(),
                held=self._held_slices,
                pods=lambda: kube.list_node_pods(settings.node_name),
                proc=settings.host_proc,
                state=settings.usage_state,
                interval_s=settings.usage_interval_seconds,
                window_s=settings.usage_window,
                idle_after_s=settings.usage_idle_after,
                on_idle=self._idle if settings.usage_idle_events else None,
            )
            if settings.usage_enabled
            else None
        )
        self.report = Reporter(
            settings.node_name,
            self.rollout,
            fleet,
            self.metrics,
            self._config_status,
            holders_localhost_only=settings.holders_localhost_only,
            claim_mps=claim_mps,
            usage=self.usage,
            catalog=catalog,
        )
        self.claim_mps = claim_mps
        """The MPS daemons of on-demand MIG devices claims share: watched beside the GPUs' own."""
        self.node = watch_node(kube, settings.node_name, settings.watch_timeout_seconds)
        self.node_out = NodePublisher(kube, self.node, catalog)
        if dra is not None:
            dra.node_claims = self._allocated_claims
        self.frontends = Frontends(
            fleet=fleet,
            dra=dra,
            rollout=self.rollout,
            node_out=self.node_out,
            remembered_at=settings.journal.with_name("frontend"),
            node=self.node,
        )
        self.drain = Drainer(kube, self.node, self.node_out.event, enabled=settings.drain)
        self.sources = ConfigSources(
            kube,
            catalog,
            namespace=settings.namespace,
            names=(settings.configmap, settings.presets_configmap),
            watch_timeout_seconds=settings.watch_timeout_seconds,
            last_good=settings.journal.with_name("last-good.json"),
            default_mig_strategy=MigStrategy(settings.default_mig_strategy),
        )
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._good: SharingConfig | None = None
        self._verdict = Verdict(None)
        self._failures = 0
        self._grace_over = False
        self._selected: tuple[str | None, str] = (None, "")
        self._stated: SharingConfig | None = None
        """The config the state is about: the one rolled out last (None: a rejection, or none)."""
        self._standby = False
        self._configs = ConfigSet()
        """The ConfigMaps' configs as last read (their warnings are in `sharing status`)."""
        self._event_loop: asyncio.AbstractEventLoop | None = None

    def trigger(self) -> None:
        """Ask for a reconcile soon (coalesces with any other pending trigger)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set."""
        log.info("agent_starting", version=__version__, **self.settings.describe())
        serving = contextlib.ExitStack()  # held for the agent's life: `sharing apply` refuses meanwhile
        try:
            serving.enter_context(self.rollout.journal.serving())
        except SharingError as err:  # the journal's own fault, said by every reconcile: keep serving
            log.error("agent_lock_not_held", error=bounded(str(err)))
        await self.frontends.start()
        http = HttpServer(self.settings.http_port, self.report.routes()) if self.settings.http_port else None
        if http is not None:
            try:
                await http.start()
            except SharingError as err:  # the plugins matter more than the probes: keep going
                log.error("http_not_served", error=str(err))
                http = None
        self.report.alive = self._alive
        self.report.frontend = self.frontends.health
        await self._recall()
        if not await self._own(stop, serving):
            await self._stopped(http, serving)
            return
        if self.usage is not None:  # once the node is ours: one sampler writes its windows
            self._event_loop = asyncio.get_running_loop()
            self.usage.start()
        self.node.start(self.trigger)
        self.sources.start(self.trigger)
        self._tasks = [
            asyncio.create_task(
                follow_health(
                    self.backend,
                    self.fleet,
                    self.metrics,
                    lambda: self.rollout.node,
                    self.node_out.event,
                    changed=self._health_changed,
                ),
                name="health",
            ),
            asyncio.create_task(self._loop(), name="reconcile"),
            asyncio.create_task(self._resync(), name="resync"),
            asyncio.create_task(self._grace(), name="api-grace"),
            asyncio.create_task(
                watch_mps(
                    self.mps,
                    every_s=self.settings.mps_check_seconds,
                    republish=self.rollout.republish,
                    trigger=self.trigger,
                    node=lambda: self.rollout.node,
                    event=self.node_out.event,
                ),
                name="mps-watch",
            ),
            asyncio.create_task(self.node_out.events.run(), name="events"),
        ]
        if self.claim_mps is not None:
            dra = self.dra
            self._tasks.append(
                asyncio.create_task(
                    watch_claim_mps(
                        self.claim_mps,
                        every_s=self.settings.mps_check_seconds,
                        observe=self.backend.observe,
                        claims=lambda: dra.recorded() if dra is not None else (),
                        event=self.node_out.event,
                    ),
                    name="claim-mps-watch",
                )
            )
        try:
            await stop.wait()
        finally:
            self.node.stop()
            self.sources.stop()
            for task in self._tasks:
                task.cancel()
            # Whatever a task died of, the plugin servers stop and NVML is released.
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._stopped(http, serving)

    async def _stopped(self, http: HttpServer | None, serving: contextlib.ExitStack) -> None:
        if self.usage is not None:  # its last sample may ask this loop who holds what: it runs
            await asyncio.to_thread(self.usage.stop)
        if http is not None:
            await http.stop()
        try:
            await self.frontends.stop()
        finally:  # NVML is released and the journal's locks dropped whatever the front-end did
            await self.backend.close()
            serving.close()
            log.info("agent_stopped")

    async def _own(self, stop: asyncio.Event, held: contextlib.ExitStack) -> bool:
        """Own the node before reading the API server or changing anything; False when stopped first.

        A rolling update starts the new agent beside the old one (the chart's maxSurge), which stops
        once the new one is Ready. Until then the old one owns the node (it holds the owner's lock
        beside the journal): the new one serves what the last applied config gives, which makes it
        Ready, and changes nothing, so two agents never act on one node (a front-end switch, a new
        config, MPS daemons). Once it owns the node it sends every plugin's list again: the kubelet
        keeps the list that a resource's plugins sent last, which may be the old agent's.
        """
        waiting = False
        while not stop.is_set():
            try:
                owned = self.rollout.journal.try_own()
            except SharingError as err:  # the journal's own fault, said by every reconcile: go on
                log.error("agent_owner_lock_not_held", error=bounded(str(err)))
                return True
            if owned is not None:
                held.enter_context(owned)
                if waiting:
                    self._standby = False
                    self.fleet.resend()
                    log.info("node_taken_over")
                return True
            if not waiting:
                waiting = self._standby = True
                log.info("another_agent_owns_the_node", lock=str(self.rollout.journal.owner_path))
            if not self.report.advertised and not os.path.lexists(self.settings.journal):
                with contextlib.suppress(SharingError):  # the GPUs read again at the next look
                    await self._advertise_last_good(await self.backend.observe())
                    self.report.advertised = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(OWNER_POLL_S):
                    await stop.wait()
        return False

    async def _allocated_claims(self) -> tuple[ClaimAllocation, ...]:
        """The ResourceClaims with devices of this node's DRA pool allocated (they hold those devices),
        found from the node's pods once no scheduling cycle that read the pool before its last
        withdrawal can still write one (`sharing.kube.podclaims`)."""
        if self.dra is not None:
            await self.dra.settled()

        def through_dra(resource: str) -> bool:
            # The chart's DeviceClasses name these (extendedResourceName); only a node DRA serves
            # hands them out through claims.
            ours = resource == "nvidia.com/gpu" or resource.startswith("nvidia.com/mig-")
            return ours and self.frontends.serving is Frontend.DRA

        return await asyncio.to_thread(
            claims_of_node_pods, self.kube, self.settings.node_name, DRIVER, through_dra=through_dra
        )

    def _held_slices(self) -> tuple[HeldSlice, ...] | None:
        """Who holds which slice (None: cannot be told), asked on the agent's loop from the usage
        sampler's thread."""
        if self._event_loop is None:
            return None
        return asyncio.run_coroutine_threadsafe(self._holdings(), self._event_loop).result(HELD_TIMEOUT_S)

    async def _holdings(self) -> tuple[HeldSlice, ...] | None:
        holders = await self.rollout.holders(deciding=False)
        if holders.unknown:
            return None
        limits = {str(d.gpu): d.wanted.pinned_memory_mib << 20 for d in self.mps.status()}
        return held_slices(self.rollout.offered(), holders.pods, holders.claims, limits)

    def _idle(self, slices: Sequence[SliceReport]) -> None:
        """`SliceIdle` Events for the slices that became idle, recorded on the agent's loop (from the
        usage sampler's thread, which does not wait for them)."""
        if self._event_loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._say_idle(slices), self._event_loop)

    async def _say_idle(self, slices: Sequence[SliceReport]) -> None:
        for report in slices:
            held = report.use.held
            log.info("slice_idle", pod=f"{held.namespace}/{held.pod}", device=held.device)
            await self.node_out.event(
                "Normal", idle.REASON, idle.message(report, self.settings.usage_idle_after)
            )

    def _config_status(self) -> ConfigStatus:
        state = self.node_out.state.value if self.node_out.state else None
        name, configs = self._selected[0], self._configs
        return ConfigStatus(
            name,
            self._selected[1],
            state,
            self._in_effect(),
            self.node_out.last_change,
            warnings=configs.warnings_for(name) if name is not None else (),
            warned={c: len(found) for c, found in per_config(configs.warnings).items()},
        )

    def _alive(self) -> bool:
        if self._standby:
            return True  # waiting to own the node: nothing of ours to have stopped yet
        return bool(self._tasks) and not any(t.done() for t in self._tasks[:2])

    # --- scheduling ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._next()
            self._wake.clear()
            started = time.monotonic()
            try:
                self._verdict = await self.reconcile()
                self._failures = self._failures + 1 if self._verdict.retry is Retry.BACKOFF else 0
            except SharingError as err:
                self._failures += 1
                self._verdict = Verdict(self.node_out.state, retry=Retry.BACKOFF)
                log.warning("reconcile_failed", error=bounded(str(err)), retry_in_s=self._backoff())
            except Exception as err:  # a bug must not stop the loop: the plugins keep serving, we retry
                self._failures += 1
                self._verdict = Verdict(self.node_out.state, retry=Retry.BACKOFF)
                log.error(
                    "reconcile_crashed",
                    error=f"{type(err).__name__}: {bounded(str(err))}",
                    retry_in_s=self._backoff(),
                )
            self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    async def _next(self) -> None:
        """Wait for a trigger, a retry that is due, blocking devices that have been freed, or the
        re-check of a blocked change whose pods' eviction was refused."""
        while True:
            retry = self._verdict.retry
            timeout = None
            if retry is Retry.BACKOFF:
                timeout = self._backoff()
            elif retry is Retry.BLOCKED:
                timeout = self.settings.blocked_recheck_seconds
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
                    return
            if retry is not Retry.BLOCKED or self.drain.refused or await self._freed():
                return  # a refused eviction is tried again with the reconcile (drain mode)

    def _backoff(self) -> float:
        return float(min(RETRY_MAX_S, RETRY_MIN_S * 2 ** max(0, self._failures - 1)))

    async def _freed(self) -> bool:
        """A cheap look (who holds what, processes) at whether a blocker has gone."""
        try:
            observed = await self.backend.observe()
            holders = await self.rollout.holders(node=observed)
        except SharingError:
            return False
        mps = self.rollout.mps
        for uuid in self.rollout.mps_blocked:  # an MPS change waits for processes, not for pods
            gpu = observed.gpu(uuid)
            try:
                if gpu is None or mps is None or not await mps.in_use(gpu):
                    return True
            except SharingError:
                return False
        return bool(self._verdict.blockers - holders.busy_uuids(observed))

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            self.trigger()

    async def _health_changed(self) -> None:
        """On DRA the slices carry health as device taints: publish them again (the device plugins
        already got the change from the fleet)."""
        if self.rollout.frontend is Frontend.DRA:
            await self.rollout.republish()

    async def _grace(self) -> None:
        await asyncio.sleep(API_GRACE_S)
        self._grace_over = True
        self.trigger()

    # --- one reconcile ------------------------------------------------------------------------

    async def reconcile(self) -> Verdict:
        """One pass: select, roll out, advertise, label. Raises SharingError when it should be retried."""
        node = self.node.current
        self.node_out.events.wake()  # Events an outage held back: the server may answer again
        missing = ([] if node is not None else [self.node.what]) + self.sources.missing
        if node is None or missing:
            log.info("waiting_for_api", reason=f"not read from the API server yet: {', '.join(missing)}")
            if self._grace_over and not self.report.advertised:
                await self._serve_remembered()
            return Verdict(None)
        observed = await self.backend.observe()
        choice = choose_frontend(
            node.labels, self.settings.default_frontend(), label=self.settings.frontend_label
        )
        waits, refused = await self.frontends.serve(choice, observed)
        if waits is not None:
            return waits
        configs = await self.sources.configs(observed)
        await self.node_out.labels_disagree(
            node.labels, self.settings.config_label, self.settings.fallback_label
        )
        selection = select_config(
            node.labels,
            configs,
            label=self.settings.config_label,
            fallback=self.settings.fallback_label,
            default=self.settings.default_config,
        )
        await self.node_out.invalid_configs(configs, selection, quiet=self.sources.invalid_presets)
        self._configs = configs
        chosen = selection.config.name if isinstance(selection, Selected) else None
        await self.node_out.config_warnings(chosen, configs.warnings_for(chosen) if chosen else ())
        if isinstance(selection, Failed):
            await self._take_up(None, (selection.name, ""), ConfigState.FAILED)
            verdict = Verdict(ConfigState.FAILED, "ConfigRejected", selection.reason, selection.reason)
            config = self._good
        elif isinstance(selection, Selected) and (lacking := await self._lacking(selection.config, observed)):
            await self._take_up(None, (selection.config.name, selection.source), ConfigState.FAILED)
            verdict = Verdict(ConfigState.FAILED, "ConfigInvalid", lacking, lacking)
            config = self._good
        elif isinstance(selection, Selected):
            config = selection.config
            if config == self._stated:
                self._selected = (config.name, selection.source)
            else:
                await self._take_up(config, (config.name, selection.source), ConfigState.PENDING)
            verdict, observed = await self.rollout.roll_out(config, observed, self._set_pending)
            if verdict.state is ConfigState.SUCCESS:
                self._good = config
                await self.sources.remember(config.name)
            else:
                config = self._good if self._good is not None else config
        else:
            config = self._good = None
            self.rollout.forget()
            self.node_out.state = None  # no config manages the GPUs: the state label goes
            verdict = Verdict(None)
            self._selected, self._stated = (None, selection.reason), None
            await self.sources.remember(None)
        if refused and verdict.state is not ConfigState.FAILED:
            verdict = Verdict(
                ConfigState.FAILED, "FrontendRejected", refused, refused, verdict.changed, verdict.retry,
                verdict.blockers,
            )  # fmt: skip
        verdict = await self._advertise(observed, config, verdict)
        await self.drain.after(verdict, self.rollout.holders)
        return verdict

    async def _lacking(self, config: SharingConfig, observed: NodeState) -> str:
        """Why the cluster cannot take `config` on this node (a feature it needs is off), or "".

        `mig: dynamic` on the DRA front-end publishes partitionable devices; an API server without
        them drops their counters, and the scheduler could then allocate overlapping MIG placements.
        The config is refused as a whole, so the node stays on its last good one and nothing the
        GPUs serve changes; every other config, and the other front-end, still work.
        """
        if self.dra is None or self.rollout.frontend is not Frontend.DRA:
            return ""
        dynamic = [g for g in observed.gpus if is_dynamic(config.rule_matching(identity(g, self.catalog)), g)]
        if not dynamic or not (await self.dra.features()).lacks(PARTITIONABLE):
            return ""
        gpus = ", ".join(f"GPU {g.index}" for g in dynamic)
        return (
            f"config {config.name!r} asks for mig: dynamic ({gpus}), which needs partitionable devices: "
            f"this cluster's API server has the feature gate {PARTITIONABLE} off (off by default before "
            "Kubernetes 1.36) and drops their counters; the node stays as it is. Turn the gate on "
            "(kube-apiserver, kube-scheduler, kube-controller-manager, kubelet) and restart the agent, "
            "or give these GPUs a MIG layout"
        )

    # --- after a restart ----------------------------------------------------------------------

    async def _recall(self) -> None:
        """The config applied before a restart is in effect on the GPUs until another one is: it names
        their devices if the first change fails or the config is gone (kept on disk beside the journal).

        They are advertised at once, before the API server is asked anything: while a restarted
        agent's plugins are gone, the kubelet refuses every pod that asks for a slice. Not after a
        run that crashed (a journal on disk): the first reconcile finishes that change first.
        Readiness still waits for the first reconcile (or the API grace).
        """
        name, config = await self.sources.remembered()
        if config is None:
            return
        try:
            observed = await self.backend.observe()
        except SharingError as err:
            log.warning("last_good_not_recalled", error=bounded(str(err)))
            return
        self._good = self._stated = config
        self.rollout.effective = {g.uuid: config for g in observed.gpus}
        log.info("last_good_recalled", config=name)
        if not os.path.lexists(self.settings.journal):
            await self._advertise_last_good(observed)

    async def _advertise_last_good(self, observed: NodeState) -> None:
        """Advertise what the last applied config gives, its MPS replicas where a daemon answers with
        their limits already (the keeper kept it through a restart or beside another agent): none is
        started, stopped or withdrawn before the first reconcile."""
        if self._good is not None:
            wanted = mps_layout(observed, self._good, self.catalog, per_gpu=self.rollout.effective)
            try:
                await self.mps.adopt(wanted)
            except SharingError as err:  # their replicas wait for the first reconcile, as before
                log.warning("mps_daemons_not_read", error=bounded(str(err)))
        await self.rollout.advertise(observed, self._good)

    async def _serve_remembered(self) -> None:
        """The API server is out of reach since start: advertise what the last applied config gives."""
        observed = await self.backend.observe()
        log.warning(
            "serving_without_api", config=self._good.name if self._good else None, gpus=len(observed.gpus)
        )
        await self._advertise_last_good(observed)
        self.report.advertised = True

    async def _advertise(
        self, observed: NodeState, config: SharingConfig | None, verdict: Verdict
    ) -> Verdict:
        """Advertise and label; the verdict, waiting for pods that hold devices it could not offer."""
        inventory = await self.rollout.advertise(observed, config)
        self.report.advertised = True
        verdict = held_back(verdict, self.rollout.withheld, config.name if config else "")
        outcome = await self.node_out.publish(
            observed, config, inventory, verdict, good=self._good, in_effect=self._in_effect()
        )
        if outcome is not None:
            self.metrics.changes.labels(outcome=outcome).inc()
        return verdict

    def _in_effect(self) -> dict[str, str | None]:
        return {u: c.name if c else None for u, c in self.rollout.effective.items()}

    async def _set_pending(self) -> None:
        await self.node_out.set_state(ConfigState.PENDING)

    async def _take_up(
        self, config: SharingConfig | None, selected: tuple[str | None, str], state: ConfigState
    ) -> None:
        """Take up a new selection and the state that goes with it together, before anything else is
        asked or withdrawn: `sharing status` and the state label never pair a newly selected config
        (or a new version of it) with the last one's `success` while its change is prepared. A config
        that needs no hardware step goes from `pending` to `success` in the same reconcile."""
        self._selected, self._stated = selected, config
        await self.node_out.set_state(state)
