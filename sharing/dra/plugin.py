"""The agent's DRA kubelet plugin: the DRA socket (prepare, unprepare, health) and the registration
socket, started in that order, stopped in the other.

The DRA service serves before the registration socket appears, because the kubelet dials the
endpoint as soon as it has read GetInfo (the Go helper starts them in the same order:
k8s.io/dynamic-resource-allocation kubeletplugin/draplugin.go, Start). Each agent process has
sockets of its own (`DraPaths.instance`): another instance may still serve during a rolling update,
and the kubelet tracks every registered instance of a driver (the plugin watcher's "Seamless
Upgrade"). Sockets of instances that no longer answer (killed) are removed at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from sharing.devices import HealthState, Inventory
from sharing.dra.names import CHECKPOINT, DRIVER, LEGACY_SOCKETS, dra_socket, registration_socket
from sharing.dra.ondemand import OnDemand
from sharing.dra.prepare import ClaimReader, Preparer, Recorder
from sharing.dra.records import PreparedClaims
from sharing.dra.registration import RegistrationService
from sharing.dra.service import DraService, HealthFeed, HealthService, health_of
from sharing.errors import PluginError
from sharing.gpu.devfiles import DeviceFiles
from sharing.kubelet.api import dra_v1_pb2_grpc as dra_grpc
from sharing.kubelet.api import drahealth_v1alpha1_pb2_grpc as health_grpc
from sharing.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from sharing.kubelet.restarts import listening
from sharing.model import NodeState
from sharing.store import ClaimCheckpoint

UNIX_PATH_MAX = 107
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DraPaths:
    """Where the plugin's sockets and checkpoint are, as the kubelet sees them; the sockets are this
    instance's own (`sharing.dra.names.dra_socket`), the checkpoint every instance's."""

    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    instance: str = field(default_factory=lambda: secrets.token_hex(4))

    @property
    def driver_dir(self) -> Path:
        """`<plugins dir>/gpu.nvidia.com`: the DRA socket and the checkpoint."""
        return self.plugins_dir / DRIVER

    @property
    def dra_socket(self) -> Path:
        return self.driver_dir / dra_socket(self.instance)

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / registration_socket(self.instance)

    def others(self) -> list[Path]:
        """The sockets of other instances of this driver (alive or left by one that was killed)."""
        found = [
            *self.registry_dir.glob(registration_socket("*")),
            *self.driver_dir.glob(dra_socket("*")),
            *(d / name for d in (self.registry_dir, self.driver_dir) for name in LEGACY_SOCKETS),
        ]
        ours = {self.dra_socket, self.registration_socket}
        return sorted(p for p in found if p not in ours and p.is_socket())

    @property
    def checkpoint(self) -> Path:
        return self.driver_dir / CHECKPOINT


@dataclass(frozen=True, slots=True)
class Registration:
    """What the kubelet last said about our registration (None: nothing yet)."""

    registered: bool | None = None
    error: str = ""


class DraPlugin:
    """The DRA driver's kubelet side for this node (pool = node name)."""

    def __init__(
        self,
        *,
        node_name: str,
        claims: ClaimReader,
        inventory: Callable[[], Inventory],
        node: Callable[[], NodeState],
        files: DeviceFiles,
        cdi_dir: Path,
        paths: DraPaths | None = None,
        recorder: Recorder | None = None,
        health_resend_s: float = 10.0,
        ondemand: OnDemand | None = None,
        gpu_health: Callable[[], HealthState] | None = None,
        prepared_changed: Callable[[], None] | None = None,
        on_registration: Callable[[bool], None] = lambda _: None,
    ) -> None:
        self.paths = paths = paths or DraPaths()
        self._on_registration = on_registration
        """Told what the kubelet says of each registration (True: it uses the plugin from now on)."""
        self._prepared_changed = prepared_changed
        self._inventory = inventory
        self._gpu_health = gpu_health
        self.preparer = Preparer(
            pool=node_name,
            claims=claims,
            inventory=inventory,
            node=node,
            files=files,
            cdi_dir=cdi_dir,
            checkpoint=ClaimCheckpoint(paths.checkpoint),
            recorder=recorder,
            ondemand=ondemand,
            changed=self._after_prepare,
        )
        self.feed = HealthFeed()
        self.health = HealthService(node_name, self.feed, health_resend_s)
        self.registration = Registration()
        self._servers: list[tuple[grpc.aio.Server, Path]] = []

    @property
    def serving(self) -> bool:
        """True between start() and stop()."""
        return bool(self._servers)

    def prepared(self) -> PreparedClaims:
        """The claims prepared on this node (holders for the rollout; `sharing status`)."""
        return self.preparer.prepared()

    def refresh(self) -> bool:
        """The inventory, its health or the on-demand devices changed: stream the new health; True
        when it differs."""
        gpus = self._gpu_health() if self._gpu_health is not None else HealthState()
        return self.feed.publish(health_of(self._inventory(), self.prepared().ondemand(), gpus))

    def _after_prepare(self) -> None:
        """Claims were prepared or unprepared (instances of on-demand devices made or destroyed)."""
        self.refresh()
        if self._prepared_changed is not None:
            self._prepared_changed()

    async def start(self) -> None:
        """Load the checkpoint, serve the DRA socket, then the registration socket."""
        if self._servers:
            raise PluginError(f"the DRA plugin already serves {self.paths.dra_socket}")
        await asyncio.to_thread(_remove_dead, self.paths.others())
        await self.preparer.load()
        self.refresh()
        dra_server = grpc.aio.server()
        dra_grpc.add_DRAPluginServicer_to_server(DraService(self.preparer), dra_server)  # type: ignore[no-untyped-call]
        health_grpc.add_DRAResourceHealthServicer_to_server(self.health, dra_server)  # type: ignore[no-untyped-call]
        await self._serve(dra_server, self.paths.dra_socket)
        registration = RegistrationService(self.paths.dra_socket, self._registration_status)
        reg_server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(registration, reg_server)  # type: ignore[no-untyped-call]
        try:
            await self._serve(reg_server, self.paths.registration_socket)
        except PluginError:
            await self.stop()
            raise
        log.info(
            "dra_plugin_serving", driver=DRIVER, socket=str(self.paths.dra_socket),
            registration=str(self.paths.registration_socket),
        )  # fmt: skip

    async def stop(self, grace: float = 0.5) -> None:
        """Unregister (the registration socket goes first), end the health streams, stop serving."""
        self.feed.close()
        servers, self._servers = self._servers, []
        for server, path in reversed(servers):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            await server.stop(grace)
        self.feed = HealthFeed()
        self.health.feed = self.feed
        self.registration = Registration()

    async def _serve(self, server: grpc.aio.Server, path: Path) -> None:
        if len(str(path)) > UNIX_PATH_MAX:
            raise PluginError(f"DRA plugin: socket path {path} is too long for a unix socket")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            server.add_insecure_port(f"unix://{path}")
            await server.start()
        except (OSError, RuntimeError, grpc.RpcError) as err:
            raise PluginError(f"DRA plugin: cannot serve on {path}: {err}") from err
        self._servers.append((server, path))

    def _registration_status(self, registered: bool, error: str) -> None:
        self.registration = Registration(registered, error)
        self._on_registration(registered)


def others_serving(paths: DraPaths) -> list[Path]:
    """The registration sockets of other instances of the driver that answer (a rolling update's
    other pod serves the node)."""
    return [p for p in paths.others() if p.parent == paths.registry_dir and listening(p) is not False]


def _remove_dead(sockets: list[Path]) -> None:
    """Remove the sockets nothing answers on (left by an instance that was killed); one that answers
    belongs to a live instance (a rolling update's other pod) and is left alone."""
    for path in sockets:
        if listening(path) is False:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            log.info("dra_stale_socket_removed", socket=str(path))
