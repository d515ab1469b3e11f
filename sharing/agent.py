"""The agent: one level-triggered reconcile loop from ConfigMap + Node label to GPUs, plugins and labels.

Triggers (Node label or ConfigMap change, GPU health event, SIGHUP, periodic resync, a retry after a
failure) only wake the loop; bursts coalesce and every reconcile starts from fresh observations:
select config -> apply through the backend (busy instances kept, including MIG devices pods hold per
PodResources) -> inventory -> device-plugin fleet -> labels and Events. Bad input leaves the node on
its last good config with state `failed` and an Event that says why; the plugins keep serving
whatever happens to the API server. The config last applied is also kept on disk beside the journal,
so an agent that restarts while the API server is out of reach still advertises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from dataclasses import dataclass

import structlog

from sharing.apply import ApplyReport, apply_config
from sharing.catalog import Catalog
from sharing.change import Outcome
from sharing.config import ConfigSet, parse_configmap
from sharing.errors import SharingError
from sharing.gpu.backend import GpuBackend
from sharing.inventory import REPLICA_SEPARATOR, build_inventory
from sharing.journal import Journal
from sharing.kube import ConfigMapObject, KubeClient, NodeObject
from sharing.labels import STATE_LABEL, ConfigState, label_patch, node_labels
from sharing.model import Gpu, NodeState
from sharing.selection import Failed, Selected, select_config
from sharing.serve.fleet import Fleet
from sharing.serve.podresources import PodResourcesClient
from sharing.settings import Settings
from sharing.spec import SharingConfig
from sharing.watch import Watched, watch_configmap, watch_node

log = structlog.get_logger(__name__)

RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
API_GRACE_S = 5.0
"""How long a starting agent waits for the API server before serving the config it last applied."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one reconcile concluded, for the state label and the Event."""

    state: ConfigState | None
    reason: str
    message: str
    subject: str = ""
    """What the Event is about: the same subject and reason again is not news (no second Event)."""
    changed: bool = False
    """Hardware was changed: always news."""


class Agent:
    """Wires the watches, the backend, the applier, the fleet and the Kubernetes API together."""

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
        self.pod_resources = pod_resources
        self.journal = Journal(settings.journal)
        self.node: Watched[NodeObject] = watch_node(kube, settings.node_name, settings.watch_timeout_seconds)
        self.configmap = watch_configmap(
            kube, settings.namespace, settings.configmap, settings.watch_timeout_seconds
        )
        self._wake = asyncio.Event()
        self._good: SharingConfig | None = None
        self._state: ConfigState | None = None
        self._reported: tuple[str, str] | None = None
        self._retry_s = 0.0
        self._parsed: tuple[object, ConfigSet] | None = None
        self._memory = settings.journal.with_name("last-good.json")
        self._remembered: tuple[dict[str, str], str | None] | None = None
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
        self.configmap.start(self.trigger)
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
            self.configmap.stop()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.fleet.stop()
            await self.backend.close()
            log.info("agent_stopped")

    async def _loop(self) -> None:
        while True:
            if self._retry_s:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._retry_s)
            else:
                await self._wake.wait()
            self._wake.clear()
            try:
                await self.reconcile()
                self._retry_s = 0.0
            except SharingError as err:
                self._retry_s = min(RETRY_MAX_S, max(RETRY_MIN_S, self._retry_s * 2))
                log.warning("reconcile_failed", error=str(err), retry_in_s=self._retry_s)
            except Exception:  # a bug must not stop the loop: the plugins keep serving, we retry
                self._retry_s = RETRY_MAX_S
                log.exception("reconcile_crashed", retry_in_s=self._retry_s)

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            self.trigger()

    async def _grace(self) -> None:
        await asyncio.sleep(API_GRACE_S)
        self._grace_over = True
        self.trigger()

    async def _health(self) -> None:
        async for event in self.backend.health_events():
            if self.fleet.apply_health(event):
                what = (
                    f"MIG device {event.mig_uuid} on GPU {event.gpu_uuid}"
                    if event.mig_uuid
                    else f"GPU {event.gpu_uuid}"
                )
                if event.healthy:
                    log.info("device_healthy", device=what)
                    await self._event(
                        "Normal", "GpuHealthy", f"{what} is healthy again and advertised as such"
                    )
                else:
                    log.warning("device_unhealthy", device=what, xid=event.xid)
                    await self._event(
                        "Warning", "GpuUnhealthy", f"{what} reported XID {event.xid}; advertised unhealthy"
                    )

    async def reconcile(self) -> None:
        """One pass: select, apply, advertise, label. Raises SharingError when it should be retried."""
        node = self.node.current
        configmap = self.configmap.current
        if node is None or configmap is None:
            log.info("waiting_for_api", node=node is not None, configmap=configmap is not None)
            if self._grace_over and not self._advertised:
                await self._serve_remembered()
            return
        observed = await self.backend.observe()
        configs = self._parse(configmap, observed.gpus)
        selection = select_config(node.labels, configs, label=self.settings.config_label)
        if isinstance(selection, Failed):
            log.error("config_rejected", config=selection.name, reason=selection.reason)
            verdict = Verdict(ConfigState.FAILED, "ConfigRejected", selection.reason, selection.reason)
            config = self._good
        else:
            config = selection.config if isinstance(selection, Selected) else None
            verdict, observed = await self._apply(config, observed)
            if verdict.state is not ConfigState.FAILED:
                self._remember(dict(configmap.data or {}), config.name if config else None)
        await self._advertise(observed, config, verdict)

    def _remember(self, data: dict[str, str], name: str | None) -> None:
        """Keep the config last applied on disk, so a restart without the API server serves it."""
        if self._remembered == (data, name):
            return
        tmp = self._memory.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"config": name, "configmap": data}), "utf-8")
            os.replace(tmp, self._memory)
        except OSError as err:
            log.warning("last_good_not_saved", path=str(self._memory), error=str(err))
            return
        self._remembered = (data, name)

    async def _serve_remembered(self) -> None:
        """The API server is out of reach since start: advertise what the last applied config gives."""
        config = None
        try:
            memory = json.loads(self._memory.read_text("utf-8"))
            name = memory["config"]
            if name is not None:
                config = parse_configmap(memory["configmap"], catalog=self.catalog).get(name)
        except FileNotFoundError:
            name = None
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("last_good_unreadable", path=str(self._memory), error=str(err))
            name = None
        observed = await self.backend.observe()
        log.warning("serving_without_api", config=name, gpus=len(observed.gpus))
        self._good = config
        self.fleet.update(build_inventory(observed, config, catalog=self.catalog))
        self._advertised = True

    def _parse(self, configmap: ConfigMapObject, gpus: tuple[Gpu, ...]) -> ConfigSet:
        """The ConfigMap's configs, parsed again only when it or the node's GPUs changed."""
        hardware = tuple((g.index, g.product, g.pci_device_id, g.pci_subsystem_id, g.profiles) for g in gpus)
        key = (configmap.resource_version, configmap.data is None, hardware)
        if self._parsed is None or self._parsed[0] != key:
            self._parsed = (
                key,
                parse_configmap(configmap.data or {}, gpus=gpus, catalog=self.catalog),
            )
        return self._parsed[1]

    async def _apply(self, config: SharingConfig | None, observed: NodeState) -> tuple[Verdict, NodeState]:
        if config is None:
            self._good = None
            return Verdict(None, "", ""), observed
        busy = await self._busy_devices()
        apply = functools.partial(
            apply_config, self.backend, config, catalog=self.catalog, journal=self.journal, busy_uuids=busy
        )
        report = await apply(dry_run=True, observed=observed)
        if any(g.steps for g in report.gpus) or self.journal.unfinished() is not None:
            await self._set_state(ConfigState.PENDING)
            report = await apply(observed=observed)
            observed = report.after or observed
        if not report.ok:
            reason = _failure(config, report)
            log.error("apply_failed", config=config.name, reason=reason)
            return Verdict(ConfigState.FAILED, "ConfigApplyFailed", reason, reason), observed
        self._good = config
        changed = [g for g in report.gpus if g.outcome is Outcome.APPLIED]
        message = f"config {config.name!r} applied" + (
            ": " + "; ".join(f"GPU {g.index}: {', '.join(map(str, g.steps))}" for g in changed)
            if changed
            else ""
        )
        return Verdict(ConfigState.SUCCESS, "ConfigApplied", message, config.name, bool(changed)), observed

    async def _advertise(self, observed: NodeState, config: SharingConfig | None, verdict: Verdict) -> None:
        inventory = build_inventory(observed, config, catalog=self.catalog)
        self._advertised = True
        for warning in inventory.warnings:
            log.warning("inventory_warning", warning=warning)
        self.fleet.update(inventory)
        if verdict.state is not None:
            self._state = verdict.state
        node = self.node.current
        if node is None:
            return
        desired = node_labels(observed, config, inventory, self._state, self.catalog)
        patch = label_patch(node.labels, desired)
        if patch:
            self.node.current = await asyncio.to_thread(self.kube.patch_node_labels, node.name, patch)
            log.info("labels_patched", changed=len(patch))
        if verdict.reason and (verdict.changed or (verdict.reason, verdict.subject) != self._reported):
            kind = "Warning" if verdict.state is ConfigState.FAILED else "Normal"
            await self._event(kind, verdict.reason, verdict.message)
            self._reported = (verdict.reason, verdict.subject)

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
            log.warning("state_label_not_set", state=state.value, error=str(err))

    async def _event(self, kind: str, reason: str, message: str) -> None:
        node = self.node.current
        if node is None:
            return
        try:
            await asyncio.to_thread(self.kube.create_node_event, node, kind, reason, message)
        except SharingError as err:
            log.warning("event_not_recorded", reason=reason, error=str(err))

    async def _busy_devices(self) -> frozenset[str]:
        """UUIDs of GPUs and MIG devices that pods hold (replica IDs reduced to their device)."""
        if self.pod_resources is None:
            return frozenset()
        try:
            held = await self.pod_resources.in_use()
        except SharingError as err:
            log.warning("pod_resources_unavailable", error=str(err))
            return frozenset()
        return frozenset(i.partition(REPLICA_SEPARATOR)[0] for ids in held.values() for i in ids)


def _failure(config: SharingConfig, report: ApplyReport) -> str:
    failed = [g for g in report.gpus if g.outcome in (Outcome.FAILED, Outcome.RESET_REQUIRED)]
    return f"config {config.name!r} could not be applied: " + "; ".join(
        f"GPU {g.index} ({g.product}): {g.reason or g.outcome.value}" for g in failed
    )
