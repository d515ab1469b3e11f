"""The agent: one level-triggered reconcile loop from ConfigMaps + Node label to GPUs, plugins and labels.

Triggers (Node label or ConfigMap change, GPU health event, SIGHUP, periodic resync, a retry) only
wake the loop; bursts coalesce and every reconcile starts from fresh observations: select a config
-> roll it out safely (`sharing.rollout`) -> advertise -> labels and Events. Bad input leaves the
node on its last good config with state `failed` and an Event that says why; the plugins keep
serving whatever happens to the API server. A change that devices in use block is re-checked every
few seconds (cheaply: who holds what) and applied as soon as they are free; a change that failed
for a reason that may pass is retried with a growing delay. The config last applied is also kept
on disk beside the journal, so an agent that restarts while the API server is out of reach still
advertises it.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from sharing.catalog import Catalog
from sharing.config import ConfigSet, parse_configmap
from sharing.errors import SharingError
from sharing.gpu.backend import GpuBackend
from sharing.journal import Journal
from sharing.kube import ConfigMapObject, KubeClient
from sharing.labels import STATE_LABEL, ConfigState, label_patch, node_labels
from sharing.memory import LastGood, LastGoodError, Remembered
from sharing.model import Gpu, HealthEvent, NodeState
from sharing.rollout import Retry, Rollout, Verdict, held_back
from sharing.selection import Failed, Selected, select_config
from sharing.serve.fleet import Fleet
from sharing.serve.podresources import PodResourcesClient
from sharing.settings import Settings
from sharing.sources import merge
from sharing.spec import MigStrategy, SharingConfig
from sharing.text import bounded
from sharing.watch import Watched, watch_configmap, watch_node

log = structlog.get_logger(__name__)

RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
API_GRACE_S = 5.0
"""How long a starting agent waits for the API server before serving the config it last applied."""
HEALTH_RESTART_MAX_S = 30.0


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
        pod_resources: PodResourcesClient | None = None,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.backend = backend
        self.fleet = fleet
        self.catalog = catalog
        self.rollout = Rollout(
            backend=backend,
            fleet=fleet,
            catalog=catalog,
            journal=Journal(settings.journal),
            pod_resources=pod_resources,
        )
        timeout = settings.watch_timeout_seconds
        self.node = watch_node(kube, settings.node_name, timeout)
        self.configmaps: list[Watched[ConfigMapObject]] = [
            watch_configmap(kube, settings.namespace, name, timeout)
            for name in (settings.configmap, settings.presets_configmap)
            if name
        ]
        self.memory = LastGood(settings.journal.with_name("last-good.json"))
        self._wake = asyncio.Event()
        self._good: SharingConfig | None = None
        self._state: ConfigState | None = None
        self._reported: tuple[str, str] | None = None
        self._verdict = Verdict(None)
        self._failures = 0
        self._parsed: tuple[object, ConfigSet] | None = None
        self._advertised = False
        self._grace_over = False

    def trigger(self) -> None:
        """Ask for a reconcile soon (coalesces with any other pending trigger)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set."""
        log.info("agent_starting", **self.settings.describe())
        await self.fleet.start()
        self.node.start(self.trigger)
        for watched in self.configmaps:
            watched.start(self.trigger)
        tasks = [
            asyncio.create_task(self._health(), name="health"),
            asyncio.create_task(self._loop(), name="reconcile"),
            asyncio.create_task(self._resync(), name="resync"),
            asyncio.create_task(self._grace(), name="api-grace"),
        ]
        try:
            await stop.wait()
        finally:
            self.node.stop()
            for watched in self.configmaps:
                watched.stop()
            for task in tasks:
                task.cancel()
            # Whatever a task died of, the plugin servers stop and NVML is released.
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.fleet.stop()
            await self.backend.close()
            log.info("agent_stopped")

    # --- scheduling ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._next()
            self._wake.clear()
            try:
                self._verdict = await self.reconcile()
                self._failures = self._failures + 1 if self._verdict.retry is Retry.BACKOFF else 0
            except SharingError as err:
                self._failures += 1
                self._verdict = Verdict(self._state, retry=Retry.BACKOFF)
                log.warning("reconcile_failed", error=bounded(str(err)), retry_in_s=self._backoff())
            except Exception as err:  # a bug must not stop the loop: the plugins keep serving, we retry
                self._failures += 1
                self._verdict = Verdict(self._state, retry=Retry.BACKOFF)
                log.error(
                    "reconcile_crashed",
                    error=f"{type(err).__name__}: {bounded(str(err))}",
                    retry_in_s=self._backoff(),
                )

    async def _next(self) -> None:
        """Wait for a trigger, a retry that is due, or blocking devices that have been freed."""
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
            if retry is not Retry.BLOCKED or await self._freed():
                return

    def _backoff(self) -> float:
        return float(min(RETRY_MAX_S, RETRY_MIN_S * 2 ** max(0, self._failures - 1)))

    async def _freed(self) -> bool:
        """A cheap look (who holds what, processes) at whether a blocker has gone."""
        try:
            observed = await self.backend.observe()
            holders = await self.rollout.holders()
        except SharingError:
            return False
        return bool(self._verdict.blockers - holders.busy_uuids(observed))

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            self.trigger()

    async def _grace(self) -> None:
        await asyncio.sleep(API_GRACE_S)
        self._grace_over = True
        self.trigger()

    async def _health(self) -> None:
        """Follow the backend's health events; a failure of the event source restarts it."""
        failures = 0
        while True:
            try:
                async for event in self.backend.health_events():
                    failures = 0
                    await self._health_event(event)
            except Exception as err:  # never end silently: say why, then follow again
                failures += 1
                log.error("health_watch_failed", error=f"{type(err).__name__}: {bounded(str(err))}")
            await asyncio.sleep(min(HEALTH_RESTART_MAX_S, 0.5 * 2**failures))

    async def _health_event(self, event: HealthEvent) -> None:
        if not self.fleet.apply_health(event):
            return
        what = (
            f"MIG device {event.mig_uuid} on GPU {event.gpu_uuid}"
            if event.mig_uuid
            else f"GPU {event.gpu_uuid}"
        )
        if event.healthy:
            log.info("device_healthy", device=what)
            await self._event("Normal", "GpuHealthy", f"{what} is healthy again and advertised as such")
        else:
            log.warning("device_unhealthy", device=what, xid=event.xid)
            await self._event(
                "Warning", "GpuUnhealthy", f"{what} reported XID {event.xid}; advertised unhealthy"
            )

    # --- one reconcile ------------------------------------------------------------------------

    async def reconcile(self) -> Verdict:
        """One pass: select, roll out, advertise, label. Raises SharingError when it should be retried."""
        node = self.node.current
        maps = [w.current for w in self.configmaps]
        if node is None or any(m is None for m in maps):
            missing = [w.what for w in self.configmaps if w.current is None]
            if node is None:
                missing.insert(0, self.node.what)
            log.info("waiting_for_api", missing=missing)
            if self._grace_over and not self._advertised:
                await self._serve_remembered()
            return Verdict(None)
        observed = await self.backend.observe()
        configs = await self._configs(maps, observed)
        selection = select_config(
            node.labels, configs, label=self.settings.config_label, default=self.settings.default_config
        )
        if isinstance(selection, Failed):
            log.error("config_rejected", config=bounded(selection.name, 80), reason=bounded(selection.reason))
            verdict = Verdict(ConfigState.FAILED, "ConfigRejected", selection.reason, selection.reason)
            config = self._good
        elif isinstance(selection, Selected):
            config = selection.config
            verdict, observed = await self.rollout.roll_out(config, observed, self._set_pending)
            if verdict.state is ConfigState.SUCCESS:
                self._good = config
                await self._remember(maps, config.name)
        else:
            config = self._good = None
            self.rollout.forget()
            verdict = Verdict(None)
            await self._remember(maps, None)
        return await self._advertise(observed, config, verdict)

    async def _configs(self, maps: list[ConfigMapObject | None], observed: NodeState) -> ConfigSet:
        """The configs of the ConfigMaps (the user's over the presets), parsed again only on change.

        Parsing a large ConfigMap takes a while: it runs in a thread, off the loop that serves gRPC.
        """
        hardware = tuple(
            (g.index, g.product, g.pci_device_id, g.pci_subsystem_id, g.profiles) for g in observed.gpus
        )
        key = (tuple((m.resource_version, m.data is None) if m else None for m in maps), hardware)
        if self._parsed is None or self._parsed[0] != key:
            texts = [dict(m.data or {}) if m else {} for m in maps]
            self._parsed = (key, await asyncio.to_thread(self._parse, texts, observed.gpus))
        return self._parsed[1]

    def _parse(self, texts: list[dict[str, str]], gpus: tuple[Gpu, ...] | None) -> ConfigSet:
        """Each ConfigMap on its own (the node's GPUs add placement checks), the user's over the presets."""
        sets = [
            parse_configmap(
                t,
                gpus=gpus,
                catalog=self.catalog,
                default_mig_strategy=MigStrategy(self.settings.default_mig_strategy),
            )
            for t in texts
        ]
        return merge(sets[0], sets[1]) if len(sets) > 1 else sets[0]

    async def _remember(self, maps: list[ConfigMapObject | None], name: str | None) -> None:
        """Keep the config last applied on disk, so a restart without the API server serves it."""
        texts = [dict(m.data or {}) if m else {} for m in maps] + [{}]
        try:
            await asyncio.to_thread(self.memory.save, Remembered(name, texts[0], texts[1]))
        except OSError as err:
            log.warning("last_good_not_saved", path=str(self.memory.path), error=err.strerror)

    async def _serve_remembered(self) -> None:
        """The API server is out of reach since start: advertise what the last applied config gives."""
        config = None
        try:
            memory = await asyncio.to_thread(self.memory.load)
        except LastGoodError as err:
            log.warning("last_good_unreadable", error=bounded(str(err)))
            memory = None
        if memory is not None and memory.config is not None:
            configs = await asyncio.to_thread(self._parse, [dict(memory.configs), dict(memory.presets)], None)
            config = configs.get(memory.config)
        observed = await self.backend.observe()
        log.warning("serving_without_api", config=memory.config if memory else None, gpus=len(observed.gpus))
        self._good = config
        if config is not None:
            self.rollout.effective = {g.uuid: config for g in observed.gpus}
        await self.rollout.advertise(observed, config)
        self._advertised = True

    async def _advertise(
        self, observed: NodeState, config: SharingConfig | None, verdict: Verdict
    ) -> Verdict:
        """Advertise and label; the verdict, waiting for pods that hold devices it could not offer."""
        inventory = await self.rollout.advertise(observed, config)
        self._advertised = True
        verdict = held_back(verdict, self.rollout.withheld, config.name if config else "")
        if verdict.state is not None:
            self._state = verdict.state
        node = self.node.current
        if node is None:
            return verdict
        desired = node_labels(observed, config, inventory, self._state, self.catalog)
        patch = label_patch(node.labels, desired)
        if patch:
            self.node.current = await asyncio.to_thread(self.kube.patch_node_labels, node.name, patch)
            log.info("labels_patched", changed=len(patch))
        if verdict.reason and (verdict.changed or (verdict.reason, verdict.subject) != self._reported):
            kind = "Warning" if verdict.state is ConfigState.FAILED else "Normal"
            await self._event(kind, verdict.reason, verdict.message)
            self._reported = (verdict.reason, verdict.subject)
        return verdict

    async def _set_pending(self) -> None:
        await self._set_state(ConfigState.PENDING)

    async def _set_state(self, state: ConfigState) -> None:
        node = self.node.current
        if node is None or self._state is state:
            return
        self._state = state
        try:
            self.node.current = await asyncio.to_thread(
                self.kube.patch_node_labels, node.name, {STATE_LABEL: state.value}
            )
        except SharingError as err:
            log.warning("state_label_not_set", state=state.value, error=bounded(str(err)))

    async def _event(self, kind: str, reason: str, message: str) -> None:
        node = self.node.current
        if node is None:
            return
        try:
            await asyncio.to_thread(self.kube.create_node_event, node, kind, reason, message)
        except SharingError as err:
            log.warning("event_not_recorded", reason=reason, error=bounded(str(err)))
