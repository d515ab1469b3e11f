"""One device-plugin gRPC server: one resource, one unix socket, registered with the kubelet.

The kubelet's device manager's rules shape it: serve before Register, because the
kubelet dials back and calls GetDevicePluginOptions before it answers; a fresh socket name on every
start, because re-registering on the same path is unsupported (the old server is stopped first, so
its stream ends before the new one registers). A stream the kubelet closes is reported, so the
fleet can register again: the kubelet never dials a plugin twice. Nor is a Register the kubelet
answered proof of a stream: the kubelet can drop the new client before its ListAndWatch, so the
fleet waits for the stream too (`wait_streaming`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import structlog

from sharing.deviceplugin.allocation import AllocationPolicy
from sharing.deviceplugin.service import HANDED_OUT_KEPT_S, DeviceFeed, DevicePluginService, Handouts
from sharing.devices import ENVVAR_BY_UUID, Device, Health, Injection
from sharing.errors import PluginError
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.kubelet.api import deviceplugin_v1beta1_pb2_grpc as api_grpc

API_VERSION = "v1beta1"
UNIX_PATH_MAX = 107
log = structlog.get_logger(__name__)


class PluginServer:
    """The gRPC server of one resource on a fresh socket in the device-plugin directory."""

    def __init__(
        self,
        resource: str,
        plugin_dir: Path,
        *,
        policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED,
        injection: Injection = ENVVAR_BY_UUID,
        socket_prefix: str = "gpu-sharing",
        on_stream_lost: Callable[[PluginServer], None] = lambda _: None,
        on_stream_open: Callable[[PluginServer], None] = lambda _: None,
        handouts: Handouts | None = None,
    ) -> None:
        self.resource = resource
        self.plugin_dir = plugin_dir
        self.feed = DeviceFeed()
        self.fail_requests_greater_than_one = False
        self._policy = policy
        self._injection = injection
        self._socket_prefix = socket_prefix
        self._on_stream_lost = on_stream_lost
        self._on_stream_open = on_stream_open
        self.handouts = handouts or Handouts()
        """What Allocate handed out (the fleet's, shared by every server it starts)."""
        self.kept_until: float | None = None
        """Loop time at which the first device the list keeps only for a pod's Allocate may go."""
        self._server: grpc.aio.Server | None = None
        self._service: DevicePluginService | None = None
        self.socket: Path | None = None
        self._streaming = asyncio.Event()

    @property
    def serving(self) -> bool:
        """True between start() and stop()."""
        return self._server is not None

    @property
    def streams(self) -> int:
        """Open ListAndWatch streams."""
        return self._service.streams if self._service else 0

    def update(self, devices: tuple[Device, ...], fail_requests_greater_than_one: bool) -> bool:
        """New devices for the open streams (no re-registration); True when they changed.

        A device the new list drops that Allocate handed out in the last `HANDED_OUT_KEPT_S` stays in
        it, unhealthy, until the kubelet lists the pod that got it (`Handouts.forget`): the kubelet
        reads each device it allocated from the plugin's last list once Allocate has answered
        (`allocateContainerResources`, pkg/kubelet/cm/devicemanager/manager.go, Kubernetes v1.37.2:
        `m.allDevices[resource][dev].Topology`), and a device gone from that list by then is a nil
        pointer there: the kubelet panics in pod admission. Unhealthy, the kubelet keeps it, allocates
        it to no other pod and leaves it out of GetAllocatableResources (what a withdrawal confirms);
        Allocate refuses it. Read and published with no await in between: an Allocate cannot hand a
        device out between the two.
        """
        self.fail_requests_greater_than_one = fail_requests_greater_than_one
        kept: tuple[Device, ...] = ()
        handed = self.handouts.since(asyncio.get_running_loop().time() - HANDED_OUT_KEPT_S)
        # Most updates come with no recent handout: no look at the devices then.
        listed = [d for d in self.feed.devices if d.id in handed] if handed else []
        if listed:
            ids = {d.id for d in devices}
            kept = tuple(
                d if d.health is Health.UNHEALTHY else replace(d, health=Health.UNHEALTHY)
                for d in listed
                if d.id not in ids
            )
        self.kept_until = min(handed[d.id] for d in kept) + HANDED_OUT_KEPT_S if kept else None
        return self.feed.publish(devices + kept if kept else devices)

    async def start(self) -> Path:
        """Serve on a new socket; returns its path."""
        if self._server is not None:
            raise PluginError(f"{self.resource}: the plugin server is already running on {self.socket}")
        short = self.resource.rpartition("/")[2]
        path = self.plugin_dir / f"{self._socket_prefix}-{short}-{secrets.token_hex(4)}.sock"
        if len(str(path)) > UNIX_PATH_MAX:
            raise PluginError(f"{self.resource}: socket path {path} is too long for a unix socket")
        feed = DeviceFeed(self.feed.devices)
        service = DevicePluginService(
            self.resource,
            feed,
            policy=self._policy,
            injection=self._injection,
            fail_requests_greater_than_one=lambda: self.fail_requests_greater_than_one,
            on_stream_change=lambda opened: self._stream_changed(service, opened),
            handouts=self.handouts,
        )
        server = grpc.aio.server()
        api_grpc.add_DevicePluginServicer_to_server(service, server)  # type: ignore[no-untyped-call]
        try:
            server.add_insecure_port(f"unix://{path}")
            starting = asyncio.ensure_future(server.start())
            # Shielded: grpc's start cancelled midway leaves a server that cannot even be stopped.
            await asyncio.shield(starting)
        except (RuntimeError, grpc.RpcError) as err:
            raise PluginError(f"{self.resource}: cannot serve on {path}: {err}") from err
        except asyncio.CancelledError:  # the fleet dropped the resource meanwhile: leave nothing serving
            with contextlib.suppress(Exception):
                await starting
            await server.stop(None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        # What `update` published while the server started went to the feed before this one: a
        # withdrawal lost here would reach the kubelet with this registration's first list.
        feed.publish(self.feed.devices)
        self.feed, self._service, self._server, self.socket = feed, service, server, path
        self._streaming = asyncio.Event()
        log.debug("plugin_serving", resource=self.resource, socket=str(path))
        return path

    async def register(self, kubelet_socket: Path, timeout: float) -> None:
        """Register with the kubelet (which dials back before it answers); PluginError on refusal."""
        if self.socket is None:
            raise PluginError(f"{self.resource}: start the plugin server before registering it")
        request = api.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket.name,
            resource_name=self.resource,
            options=api.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        try:
            async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
                stub = api_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
                await stub.Register(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise PluginError(
                f"{self.resource}: the kubelet at {kubelet_socket} refused the registration:"
                f" {err.code().name}: {err.details()}"
            ) from err
        log.info("plugin_registered", resource=self.resource, socket=self.socket.name)

    async def wait_streaming(self, timeout: float) -> None:
        """Wait until the kubelet has opened ListAndWatch on this server; PluginError if not in time.

        The kubelet answers Register before it opens the stream (connectClient, then runClient in
        a goroutine: k8s.io/kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go), and
        when the stream of the resource's previous endpoint ends after that, its runClient looks the
        client up by resource name, finds the new one and disconnects it: the resource is marked
        unhealthy and the new endpoint never streams (kubernetes/kubernetes#121994). Only a
        registration that streams has delivered the devices.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._streaming.wait()
        except TimeoutError:
            raise PluginError(
                f"{self.resource}: the kubelet accepted the registration but opened no ListAndWatch"
                f" within {timeout:g}s"
            ) from None

    async def stop(self, grace: float = 0.5) -> None:
        """End the streams, stop serving and remove the socket."""
        server, self._server, self._service = self._server, None, None
        self.feed.close()
        if server is not None:
            await server.stop(grace)
        if self.socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)
            self.socket = None

    def _stream_changed(self, service: DevicePluginService, opened: bool) -> None:
        if service is not self._service:
            return  # a stream of a server we stopped
        if opened:
            self._streaming.set()
            self._on_stream_open(self)
        elif service.streams == 0:
            # The kubelet closed the last stream: it marks our devices unhealthy and never dials again.
            log.warning("list_and_watch_lost", resource=self.resource)
            self._on_stream_lost(self)
