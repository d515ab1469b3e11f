"""The fleet of device-plugin servers: one per resource of the current inventory, kept registered.

`update(inventory)` and `apply_health(event)` only record the newest state and wake one worker, so
bursts coalesce (latest wins). The worker starts servers for new resources, stops removed ones and
pushes device changes into the open ListAndWatch streams without re-registering. It re-registers a
plugin on a fresh socket when its stream drops, its socket vanishes, or the kubelet restarts.
Registrations run in tasks of their own: a kubelet slow to answer one plugin (Register may wait
up to its timeout) never holds back device or health updates of the others.

At start, sockets of ours left in the directory by a process that was killed (kill -9 leaves them)
are removed: the kubelet would otherwise keep dialling dead endpoints of the same resources.

Kubelet restarts are seen by polling the identity (device, inode, ctime) of kubelet.sock: a stat()
needs no inotify instance (NVIDIA's plugin runs into "too many open files" there), cannot miss an
event that happened before the watch began, and also sees the socket of a plugin disappear, which
the kubelet's directory cleanup does. The poll is fast (100 ms) while a plugin waits for the
kubelet, and slow (1 s) once every plugin is registered and streaming: an idle agent then wakes
once a second instead of ten times (measured: the fast poll was half of an idle agent's CPU), and
a kubelet restart still shows at once, since it ends the streams first, which makes the poll fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from sharing.deviceplugin.allocation import AllocationPolicy
from sharing.deviceplugin.plugin import PluginServer
from sharing.deviceplugin.service import Handouts
from sharing.devices import APPLICATION_XIDS, ENVVAR_BY_UUID, HealthState, Injection, Inventory, with_health
from sharing.errors import PluginError
from sharing.kubelet.restarts import SocketId, listening, socket_identity
from sharing.model import HealthEvent

DEFAULT_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """How the fleet serves and registers its plugins."""

    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    kubelet_socket_name: str = "kubelet.sock"
    policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED
    injection: Injection = ENVVAR_BY_UUID
    ignored_xids: frozenset[int] = APPLICATION_XIDS
    register_timeout_s: float = 30.0
    stream_timeout_s: float = 10.0
    """How long the kubelet may take to open ListAndWatch once it has answered Register."""
    poll_interval_s: float = 0.1
    """How often kubelet.sock is looked at while a plugin waits for the kubelet."""
    settled_poll_interval_s: float = 1.0
    """... and while every plugin is registered and streaming."""
    retry_min_s: float = 0.1
    retry_max_s: float = 5.0
    socket_prefix: str = "gpu-sharing"

    @property
    def kubelet_socket(self) -> Path:
        """The kubelet's Registration socket."""
        return self.plugin_dir / self.kubelet_socket_name


@dataclass(slots=True)
class _Plugin:
    server: PluginServer
    kubelet: SocketId | None = None
    """Identity of the kubelet.sock it registered with; None: not registered."""
    lost: bool = False
    failures: int = 0
    retry_at: float = 0.0
    registered_at: float = 0.0
    registrations: int = 0
    task: asyncio.Task[None] | None = None
    """The registration in progress, if any."""
    removed: bool = False
    """Its resource went: a registration under way ends at its next step (`Fleet._remove`)."""


@dataclass(frozen=True, slots=True)
class PluginStatus:
    """What the fleet reports about one resource."""

    resource: str
    socket: Path | None
    registered: bool
    devices: int
    registrations: int
    """Successful registrations so far (each one on a fresh socket)."""
    streams: int
    """Open ListAndWatch streams that got their first list."""
    last_error: str | None = None


@dataclass(slots=True)
class _Wanted:
    inventory: Inventory = field(default_factory=Inventory)
    health: HealthState = field(default_factory=HealthState)
    generation: int = 0


class Fleet:
    """Device-plugin servers for an Inventory, registered with the kubelet and kept that way."""

    def __init__(self, settings: FleetSettings | None = None) -> None:
        self.settings = settings or FleetSettings()
        self._wanted = _Wanted()
        self._plugins: dict[str, _Plugin] = {}
        self._errors: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._applied = asyncio.Condition()
        self._applied_generation = -1
        self._status_changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._kubelet: SocketId | None = None
        self._unsettled = asyncio.Event()
        self._handouts = Handouts()

    # --- the API the agent uses -------------------------------------------------------------

    async def start(self) -> None:
        """Start the worker and the kubelet watcher."""
        if not self._tasks:
            _remove_stale_sockets(self.settings.plugin_dir, self.settings.socket_prefix)
            self._kubelet = socket_identity(self.settings.kubelet_socket)
            self._tasks = [
                asyncio.create_task(self._work(), name="fleet-worker"),
                asyncio.create_task(self._watch_kubelet(), name="fleet-kubelet-watch"),
            ]

    async def stop(self) -> None:
        """Stop every server and remove its socket."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        registering = [p.task for p in self._plugins.values() if p.task is not None]
        for task in registering:
            task.cancel()
        await asyncio.gather(*registering, return_exceptions=True)
        await asyncio.gather(*(p.server.stop() for p in self._plugins.values()))
        self._plugins.clear()

    def update(self, inventory: Inventory) -> None:
        """Advertise this inventory (health overlay kept); returns at once, the worker applies it."""
        self._wanted.inventory = inventory
        self._bump()

    def resend(self) -> None:
        """Send every plugin's current list to the kubelet again: its device manager keeps the list a
        resource's plugins sent last (genericDeviceUpdateCallback in
        pkg/kubelet/cm/devicemanager/manager.go, Kubernetes v1.37.2), which may be another agent's
        that has stopped since."""
        for plugin in self._plugins.values():
            plugin.server.feed.resend()

    def apply_health(self, event: HealthEvent) -> bool:
        """Apply a backend health event (application XIDs ignored); True when the health state changed."""
        health = self._wanted.health.apply(event, self.settings.ignored_xids)
        if health == self._wanted.health:
            return False
        self._wanted.health = health
        self._bump()
        return True

    @property
    def ready(self) -> bool:
        """Every resource of the newest inventory is registered with the kubelet and streaming."""
        return self._applied_generation >= self._wanted.generation and all(
            p.kubelet is not None and not p.lost for p in self._plugins.values()
        )

    @property
    def alive(self) -> bool:
        """The worker and the kubelet watcher are running."""
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    def recently_allocated(self, within_s: float) -> frozenset[str]:
        """Device IDs any plugin handed out in the last `within_s` seconds.

        The kubelet records an allocation in PodResources only after Allocate returns, so for a
        moment a device can be handed out and not yet listed there: count those as held too.
        It is the fleet's record, kept across the servers' restarts (each registration starts a
        fresh one) and their removal.
        """
        return frozenset(self._handouts.since(asyncio.get_running_loop().time() - within_s))

    def forget_allocated(self, device_ids: frozenset[str]) -> None:
        """These IDs are listed by the kubelet now: stop counting them as recently allocated (and a
        list that kept one of them for its Allocate lets it go)."""
        self._handouts.forget(device_ids)
        if any(p.server.kept_until is not None for p in self._plugins.values()):
            self._wake.set()

    @property
    def health(self) -> HealthState:
        """The current health overlay."""
        return self._wanted.health

    def status(self) -> tuple[PluginStatus, ...]:
        """One entry per served resource, sorted by name."""
        return tuple(
            PluginStatus(
                name,
                p.server.socket,
                p.kubelet is not None and not p.lost,
                len(p.server.feed.devices),
                p.registrations,
                p.server.streams,
                self._errors.get(name),
            )
            for name, p in sorted(self._plugins.items())
        )

    async def sync(self, timeout: float = 10.0) -> None:
        """Wait until the worker has applied the newest update and health (TimeoutError if not)."""
        async with asyncio.timeout(timeout), self._applied:
            await self._applied.wait_for(lambda: self._applied_generation >= self._wanted.generation)

    async def wait_until(self, predicate: Callable[[tuple[PluginStatus, ...]], bool], timeout: float) -> None:
        """Wait until predicate(status()) holds, re-checked on every change (TimeoutError if not)."""
        async with asyncio.timeout(timeout):
            while not predicate(self.status()):
                await self._status_changed.wait()

    # --- the worker -------------------------------------------------------------------------

    def _bump(self) -> None:
        self._wanted.generation += 1
        self._wake.set()

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Retries wait for their time; with no kubelet.sock there is nothing to retry until the
            # watcher sees one appear.
            retry = [
                p.retry_at for p in self._plugins.values() if (p.kubelet is None or p.lost) and p.task is None
            ]
            due = retry if self._kubelet is not None else []
            # A device a list keeps for a pod's Allocate goes at its time (PluginServer.update).
            due += [p.server.kept_until for p in self._plugins.values() if p.server.kept_until is not None]
            delay = max(0.0, min(due) - loop.time()) if due else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()
            generation = self._wanted.generation
            try:
                await self._reconcile(loop.time())
            except Exception:  # a bug must not end the worker: log it and try again on the next wake
                log.exception("fleet_reconcile_failed")
            async with self._applied:
                self._applied_generation = generation
                self._applied.notify_all()
            self._notify_status()

    async def _reconcile(self, now: float) -> None:
        wanted = with_health(self._wanted.inventory, self._wanted.health)
        resources = {name: devices for name, devices in wanted.resources if devices}
        for name in [n for n in self._plugins if n not in resources]:
            await self._remove(self._plugins.pop(name))
            self._errors.pop(name, None)
            log.info("plugin_removed", resource=name)
        kubelet = socket_identity(self.settings.kubelet_socket)
        for name, devices in resources.items():
            plugin = self._plugins.get(name)
            if plugin is None:
                plugin = self._plugins[name] = _Plugin(self._new_server(name))
            plugin.server.update(devices, wanted.fail_requests_greater_than_one)
            if (
                kubelet is not None
                and plugin.task is None
                and plugin.retry_at <= now
                and self._needs_registration(plugin, kubelet)
            ):
                plugin.task = asyncio.create_task(self._register(plugin), name=f"register-{name}")

    async def _remove(self, plugin: _Plugin) -> None:
        """Stop the plugin of a resource that went, and its registration if one is under way.

        The registration is cancelled and waited for: grpcio's server stop can swallow a cancellation
        (grpcio 1.85 `grpc.aio.Server.stop`, measured: a kubelet restart during a withdrawal), and
        the registration then went on to serve and register the withdrawn devices on a socket no
        one stopped, after the withdrawal had been confirmed (the soak, seed 1111: MIG devices
        destroyed since offered healthy). `sync` returns once it has stopped: a withdrawal is
        confirmed against the kubelet only after that.
        """
        plugin.removed = True
        if plugin.task is not None:
            plugin.task.cancel()
            await asyncio.gather(plugin.task, return_exceptions=True)
        await plugin.server.stop()

    def _needs_registration(self, plugin: _Plugin, kubelet: SocketId | None) -> bool:
        socket = plugin.server.socket
        return plugin.kubelet != kubelet or plugin.lost or socket is None or not socket.exists()

    async def _register(self, plugin: _Plugin) -> None:
        loop = asyncio.get_running_loop()
        name = plugin.server.resource
        plugin.kubelet, plugin.lost = None, False
        try:
            # Stop first so the old stream ends, then a fresh socket: the kubelet's rule for re-registering.
            # After each step: the resource may have gone meanwhile, its cancellation swallowed (_remove).
            await plugin.server.stop()
            if plugin.removed:
                return
            await plugin.server.start()
            if plugin.removed:
                return
            await plugin.server.register(self.settings.kubelet_socket, self.settings.register_timeout_s)
            if plugin.removed:
                return
            # The kubelet.sock that answered, read now: the one _reconcile read may have been replaced
            # since (a restarting kubelet ends the streams before its socket changes). Recording that
            # older one made a second registration with the same kubelet, whose first stream then
            # ended after the second Register: the kubelet dropped the second (see wait_streaming).
            # Had a kubelet replaced since answered, its start removed our socket: we register again.
            kubelet = socket_identity(self.settings.kubelet_socket)
            plugin.registered_at = loop.time()
            await plugin.server.wait_streaming(self.settings.stream_timeout_s)
        except PluginError as err:
            plugin.failures += 1
            plugin.retry_at = loop.time() + self._backoff(plugin.failures)
            self._errors[name] = str(err)
            log.warning("plugin_register_failed", resource=name, error=str(err), attempt=plugin.failures)
        else:
            plugin.kubelet, plugin.failures = kubelet, 0
            plugin.registrations += 1
            self._errors.pop(name, None)
        finally:
            plugin.task = None
            self._wake.set()  # a retry is due later, or another change came in meanwhile
            self._notify_status()

    def _new_server(self, resource: str) -> PluginServer:
        return PluginServer(
            resource,
            self.settings.plugin_dir,
            policy=self.settings.policy,
            injection=self.settings.injection,
            socket_prefix=self.settings.socket_prefix,
            on_stream_lost=self._stream_lost,
            on_stream_open=lambda _: self._notify_status(),
            handouts=self._handouts,
        )

    def _notify_status(self) -> None:
        changed, self._status_changed = self._status_changed, asyncio.Event()
        changed.set()

    def _stream_lost(self, server: PluginServer) -> None:
        plugin = self._plugins.get(server.resource)
        if plugin is None or plugin.server is not server:
            return
        now = asyncio.get_running_loop().time()
        plugin.lost = True
        # A stream that drops right after registering (e.g. another plugin owns the resource)
        # backs off instead of spinning; one that lived a while is re-registered at once.
        if now - plugin.registered_at < 1.0:
            plugin.failures += 1
            plugin.retry_at = now + self._backoff(plugin.failures)
        self._wake.set()
        self._unsettled.set()
        self._notify_status()

    def _backoff(self, failures: int) -> float:
        return float(min(self.settings.retry_max_s, self.settings.retry_min_s * 2 ** (failures - 1)))

    async def _watch_kubelet(self) -> None:
        # The path as a str, made once: building a Path per poll was most of an idle agent's CPU.
        path = str(self.settings.kubelet_socket)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_interval()):
                    await self._unsettled.wait()
            self._unsettled.clear()
            kubelet = socket_identity(path)
            if kubelet != self._kubelet:
                log.info("kubelet_socket_changed", present=kubelet is not None)
                self._kubelet = kubelet
                for plugin in self._plugins.values():
                    plugin.retry_at = 0.0
                self._wake.set()
            elif any(_vanished(p.server.socket) for p in self._plugins.values() if p.kubelet is not None):
                self._wake.set()

    def _poll_interval(self) -> float:
        settled = self._kubelet is not None and all(
            p.kubelet is not None and not p.lost for p in self._plugins.values()
        )
        return self.settings.settled_poll_interval_s if settled else self.settings.poll_interval_s


def _remove_stale_sockets(plugin_dir: Path, prefix: str) -> None:
    """Remove sockets a killed process of ours left: ours by name, and nothing listens on them. One that
    answers is another agent's (a rolling update starts the new pod beside the old one, whose plugins
    serve until it stops): removing it would leave the kubelet's next dial to that plugin nowhere."""
    try:
        names = [p for p in plugin_dir.glob(f"{prefix}-*.sock") if p.is_socket() and listening(p) is False]
    except OSError:
        return
    for path in names:
        with contextlib.suppress(OSError):
            path.unlink()
    if names:
        log.info("stale_sockets_removed", count=len(names), dir=str(plugin_dir))


def _vanished(socket: Path | None) -> bool:
    return socket is not None and not os.path.exists(socket)
