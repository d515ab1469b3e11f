"""The agent: one level-triggered reconcile loop from ConfigMaps + Node label to GPUs, plugins and labels.

Triggers (Node label or ConfigMap change, GPU health event, SIGHUP, periodic resync, a retry) only
wake the loop; bursts coalesce and every reconcile starts from fresh observations: select a config
-> roll it out safely (`sharing.rollout`) -> advertise -> labels, annotations and Events. Bad input
leaves the node on its last good config with state `failed` and an Event that says why; the
plugins keep serving whatever happens to the API server. A change that devices in use block is
re-checked every few seconds (cheaply: who holds what) and applied as soon as they are free; a
change that failed for a reason that may pass is retried with a growing delay. An agent that
restarts while the API server is out of reach advertises the config it last applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from datetime import UTC, datetime

import structlog

from sharing import __version__
from sharing.catalog import Catalog
from sharing.errors import SharingError
from sharing.gpu.backend import GpuBackend
from sharing.journal import Journal
from sharing.kube import KubeClient
from sharing.labels import STATE_LABEL, ConfigState, label_patch, node_labels
from sharing.metrics import Metrics
from sharing.model import HealthEvent, NodeState
from sharing.report import Reporter
from sharing.rollout import Retry, Rollout, Verdict
from sharing.selection import MIG_CONFIG_LABEL, Failed, Selected, select_config
from sharing.serve.fleet import Fleet
from sharing.serve.http import HttpServer
from sharing.serve.podresources import PodResourcesClient
from sharing.settings import Settings
from sharing.sources import ConfigSources
from sharing.spec import SharingConfig
from sharing.status import ConfigStatus, layout
from sharing.text import bounded
from sharing.watch import watch_node
from sharing.xids import describe as describe_xid

log = structlog.get_logger(__name__)

RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
API_GRACE_S = 5.0
"""How long a starting agent waits for the API server before serving the config it last applied."""
HEALTH_RESTART_MAX_S = 30.0
CONFIG_ANNOTATION = "nvidia.com/gpu-sharing.config"
LAYOUT_ANNOTATION = "nvidia.com/gpu-sharing.layout"
_OUTCOMES = {
    "ConfigApplied": "applied",
    "ConfigApplyFailed": "failed",
    "ConfigApplyBlocked": "blocked",
    "ConfigRejected": "rejected",
}


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
        self.metrics = Metrics(__version__)
        self.rollout = Rollout(
            backend=backend,
            fleet=fleet,
            catalog=catalog,
            journal=Journal(settings.journal),
            pod_resources=pod_resources,
            injection=settings.injection(),
            cdi_spec_dir=settings.cdi_spec_dir,
            metrics=self.metrics,
        )
        self.report = Reporter(settings.node_name, self.rollout, fleet, self.metrics, self._config_status)
        self.node = watch_node(kube, settings.node_name, settings.watch_timeout_seconds)
        self.sources = ConfigSources(kube, settings, catalog)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._good: SharingConfig | None = None
        self._state: ConfigState | None = None
        self._reported: tuple[str, str] | None = None
        self._disagreement: tuple[str, str] | None = None
        self._verdict = Verdict(None)
        self._failures = 0
        self._grace_over = False
        self._selected: tuple[str | None, str] = (None, "")
        self._last_change: dict[str, str] = {}

    def trigger(self) -> None:
        """Ask for a reconcile soon (coalesces with any other pending trigger)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set."""
        log.info("agent_starting", version=__version__, **self.settings.describe())
        await self.fleet.start()
        http = HttpServer(self.settings.http_port, self.report.routes()) if self.settings.http_port else None
        if http is not None:
            try:
                await http.start()
            except SharingError as err:  # the plugins matter more than the probes: keep going
                log.error("http_not_served", error=str(err))
                http = None
        self.report.alive = self._alive
        self.node.start(self.trigger)
        self.sources.start(self.trigger)
        self._tasks = [
            asyncio.create_task(self._health(), name="health"),
            asyncio.create_task(self._loop(), name="reconcile"),
            asyncio.create_task(self._resync(), name="resync"),
            asyncio.create_task(self._grace(), name="api-grace"),
        ]
        try:
            await stop.wait()
        finally:
            self.node.stop()
            self.sources.stop()
            for task in self._tasks:
                task.cancel()
            # Whatever a task died of, the plugin servers stop and NVML is released.
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if http is not None:
                await http.stop()
            await self.fleet.stop()
            await self.backend.close()
            log.info("agent_stopped")

    def _config_status(self) -> ConfigStatus:
        in_effect: dict[str, str | None] = {
            u: c.name if c else None for u, c in self.rollout.effective.items()
        }
        state = self._state.value if self._state else None
        return ConfigStatus(self._selected[0], self._selected[1], state, in_effect, self._last_change)

    def _alive(self) -> bool:
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
            self.metrics.reconcile_seconds.observe(time.monotonic() - started)

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
        gpu = next((g for g in self.rollout.node.gpus if g.uuid == event.gpu_uuid), None)
        where = f"GPU {gpu.index} ({gpu.product})" if gpu else f"GPU {event.gpu_uuid}"
        if not event.healthy and event.xid is not None:
            self.metrics.xids.labels(gpu=str(gpu.index) if gpu else event.gpu_uuid, xid=str(event.xid)).inc()
        if not self.fleet.apply_health(event):
            return
        what = f"MIG device {event.mig_uuid} of {where}" if event.mig_uuid else where
        if event.healthy:
            log.info("device_healthy", device=what)
            await self._event("Normal", "GpuHealthy", f"{what} is healthy again and advertised as such")
        else:
            log.warning("device_unhealthy", device=what, xid=event.xid)
            await self._event(
                "Warning",
                "GpuUnhealthy",
                f"{what} reported {describe_xid(event.xid)}; its devices are advertised unhealthy until "
                "it recovers",
            )

    # --- one reconcile ------------------------------------------------------------------------

    async def reconcile(self) -> Verdict:
        """One pass: select, roll out, advertise, label. Raises SharingError when it should be retried."""
        node = self.node.current
        missing = ([] if node is not None else [self.node.what]) + self.sources.missing
        if node is None or missing:
            log.info("waiting_for_api", reason=f"not read from the API server yet: {', '.join(missing)}")
            if self._grace_over and not self.report.advertised:
                await self._serve_remembered()
            return Verdict(None)
        observed = await self.backend.observe()
        configs = await self.sources.configs(observed)
        await self._labels_disagree(node.labels)
        selection = select_config(
            node.labels, configs, label=self.settings.config_label, default=self.settings.default_config
        )
        if isinstance(selection, Failed):
            self._selected = (selection.name, "")
            verdict = Verdict(ConfigState.FAILED, "ConfigRejected", selection.reason, selection.reason)
            config = self._good
        elif isinstance(selection, Selected):
            config = selection.config
            self._selected = (config.name, selection.source)
            verdict, observed = await self.rollout.roll_out(config, observed, self._set_pending)
            if verdict.state is ConfigState.SUCCESS:
                self._good = config
                await self.sources.remember(config.name)
            else:
                config = self._good if self._good is not None else config
        else:
            config = self._good = None
            self.rollout.forget()
            verdict = Verdict(None)
            self._selected = (None, selection.reason)
            await self.sources.remember(None)
        await self._advertise(observed, config, verdict)
        return verdict

    async def _labels_disagree(self, labels: Mapping[str, str]) -> None:
        """Both selection labels set and different: say once which one is used."""
        first, second = labels.get(self.settings.config_label, ""), labels.get(MIG_CONFIG_LABEL, "")
        pair = (first, second)
        if not first or not second or first == second or pair == self._disagreement:
            return
        self._disagreement = pair
        await self._event(
            "Warning",
            "ConfigLabelsDisagree",
            f"{self.settings.config_label}={first} and {MIG_CONFIG_LABEL}={second} name different configs: "
            f"{first!r} is used ({self.settings.config_label} wins)",
        )

    async def _serve_remembered(self) -> None:
        """The API server is out of reach since start: advertise what the last applied config gives."""
        name, config = await self.sources.remembered()
        observed = await self.backend.observe()
        log.warning("serving_without_api", config=name, gpus=len(observed.gpus))
        self._good = config
        if config is not None:
            self.rollout.effective = {g.uuid: config for g in observed.gpus}
        await self.rollout.advertise(observed, config)
        self.report.advertised = True

    async def _advertise(self, observed: NodeState, config: SharingConfig | None, verdict: Verdict) -> None:
        inventory = await self.rollout.advertise(observed, config)
        self.report.advertised = True
        if verdict.state is not None:
            self._state = verdict.state
        node = self.node.current
        if node is None:
            return
        desired = node_labels(observed, config, inventory, self._state, self.catalog)
        patch = label_patch(node.labels, desired)
        in_effect: dict[str, str | None] = {
            u: c.name if c else None for u, c in self.rollout.effective.items()
        }
        notes = {
            CONFIG_ANNOTATION: self._good.name if self._good else None,
            LAYOUT_ANNOTATION: bounded(layout(self.rollout.node, inventory, in_effect), 8000) or None,
        }
        note_patch = {k: v for k, v in notes.items() if node.annotations.get(k) != v}
        if patch or note_patch:
            self.node.current = await asyncio.to_thread(
                self.kube.patch_node_labels, node.name, patch, note_patch
            )
            log.info("node_patched", labels=len(patch), annotations=len(note_patch))
        news = verdict.reason and (verdict.changed or (verdict.reason, verdict.subject) != self._reported)
        if news:
            kind = "Warning" if verdict.state is ConfigState.FAILED else "Normal"
            (log.warning if kind == "Warning" else log.info)(
                "config_" + _OUTCOMES.get(verdict.reason, "outcome"), message=bounded(verdict.message)
            )
            self.metrics.changes.labels(outcome=_OUTCOMES.get(verdict.reason, verdict.reason)).inc()
            await self._event(kind, verdict.reason, verdict.message)
            self._reported = (verdict.reason, verdict.subject)
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            self._last_change = {"time": now, "reason": verdict.reason, "message": verdict.message}

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
