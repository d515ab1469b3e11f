"""The agent's DRA kubelet plugin: the DRA socket (prepare, unprepare, health) and the registration
socket, started in that order, stopped in the other.

The DRA service serves before the registration socket appears, because the kubelet dials the
endpoint as soon as it has read GetInfo (the Go helper starts them in the same order:
k8s.io/dynamic-resource-allocation kubeletplugin/draplugin.go, Start). Sockets left by an agent
that died are removed first: a unix socket path cannot be bound twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from sharing.devices import HealthState, Inventory
from sharing.dra.names import CHECKPOINT, DRA_SOCKET, DRIVER, REGISTRATION_SOCKET
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
from sharing.model import NodeState
from sharing.store import ClaimCheckpoint

UNIX_PATH_MAX = 107
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DraPaths:
    """Where the plugin's sockets and checkpoint are, as the kubelet sees them."""

    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR

    @property
    def driver_dir(self) -> Path:
        """`<plugins dir>/gpu.nvidia.com`: the DRA socket and the checkpoint."""
        return self.plugins_dir / DRIVER

    @property
    def dra_socket(self) -> Path:
        return self.driver_dir / DRA_SOCKET

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / REGISTRATION_SOCKET

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
        paths: DraPaths = DraPaths(),
        recorder: Recorder | None = None,
        health_resend_s: float = 10.0,
        ondemand: OnDemand | None = None,
        gpu_health: Callable[[], HealthState] | None = None,
        prepared_changed: Callable[[], None] | None = None,
    ) -> None:
        self.paths = paths
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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # left by an agent that died
            server.add_insecure_port(f"unix://{path}")
            await server.start()
        except (OSError, RuntimeError, grpc.RpcError) as err:
            raise PluginError(f"DRA plugin: cannot serve on {path}: {err}") from err
        self._servers.append((server, path))

    def _registration_status(self, registered: bool, error: str) -> None:
        self.registration = Registration(registered, error)
