"""A fake kubelet device manager in Python, for fast tests of sharing.deviceplugin.

It mirrors the kubelet rules the plugins must satisfy (the device manager of k8s.io/kubernetes
pkg/kubelet/cm/devicemanager, which the Go harness runs for real): Register
checks the version and the resource name, dials the plugin back at <dir>/<endpoint> (10 s), asks
GetDevicePluginOptions before it acknowledges, then consumes ListAndWatch; a stream that ends marks
the resource's devices unhealthy (capacity stays, allocatable 0) and is never re-dialled. restart()
deletes every socket in the directory and serves a new kubelet.sock, as a kubelet restart does.
The real device-manager code runs in the Go harness (tests/integration); this is only for speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from lab.deadlines import scaled

from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.kubelet.api import deviceplugin_v1beta1_pb2_grpc as api_grpc

SUPPORTED_VERSIONS = ("v1beta1",)
_QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's IsExtendedResourceName: domain/name, not kubernetes.io, valid as requests.<name>."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, short = f"requests.{name}".rpartition("/")
    return len(short) <= 63 and len(prefix) <= 253 and _QUALIFIED.match(f"requests.{name}") is not None


@dataclass
class Endpoint:
    """One registered plugin, as the kubelet's endpointImpl holds it."""

    resource: str
    socket: Path
    channel: grpc.aio.Channel
    stub: api_grpc.DevicePluginStub
    options: api.DevicePluginOptions
    devices: dict[str, str] = field(default_factory=dict)
    """{device ID: health} from the last ListAndWatch message."""
    updates: int = 0
    stopped: bool = False
    task: asyncio.Task[None] | None = None
    call: object | None = None


class FakeKubelet:
    """Registration server on <plugin_dir>/kubelet.sock plus the device manager's plugin side."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / "kubelet.sock"
        self.endpoints: dict[str, Endpoint] = {}
        self.registrations: list[tuple[str, str]] = []
        """(resource, endpoint) of every successful Register, in order."""
        self.refusals: list[str] = []
        self.hold: dict[str, asyncio.Event] = {}
        """Register of these resources waits until the event is set (a kubelet slow to answer)."""
        self.drop_before_watch: set[str] = set()
        """The next Register of these resources is answered, then its client is disconnected before
        ListAndWatch: the kubelet's server.runClient does that to a new client when the previous
        endpoint's stream ends after the new Register (plugin/v1beta1/handler.go; kubernetes#121994)."""
        self._server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> FakeKubelet:
        server = grpc.aio.server()
        api_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
        for ep in self.endpoints.values():
            await self._close(ep)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    async def restart(self) -> None:
        """Like a kubelet restart: old connections die, every socket in the directory is deleted,
        registered resources come back with no devices until their plugin registers again."""
        await self.stop()
        for path in self.plugin_dir.iterdir():
            if path.is_socket():
                path.unlink()
        for ep in self.endpoints.values():
            ep.devices = {}
        await self.start()
        await self._notify()

    # --- what tests look at ---------------------------------------------------------------

    def capacity(self) -> dict[str, int]:
        return {r: len(ep.devices) for r, ep in self.endpoints.items()}

    def allocatable(self) -> dict[str, int]:
        return {r: sum(h == "Healthy" for h in ep.devices.values()) for r, ep in self.endpoints.items()}

    def devices(self, resource: str) -> dict[str, str]:
        ep = self.endpoints.get(resource)
        return dict(ep.devices) if ep else {}

    def registered(self, resource: str) -> int:
        return sum(r == resource for r, _ in self.registrations)

    async def wait(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until predicate() holds after some change (TimeoutError with the state if not)."""
        timeout = scaled(timeout)
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(predicate)
        except TimeoutError:
            raise TimeoutError(
                f"fake kubelet: condition not met in {timeout}s; capacity {self.capacity()},"
                f" allocatable {self.allocatable()}, registrations {self.registrations},"
                f" refusals {self.refusals}"
            ) from None

    def plugin(self, resource: str) -> api_grpc.DevicePluginStub:
        """The stub the kubelet uses to call the registered plugin of `resource`."""
        return self.endpoints[resource].stub

    async def end_stream(self, resource: str) -> None:
        """Cancel the ListAndWatch stream of `resource`, as a broken connection would."""
        ep = self.endpoints[resource]
        if ep.task is not None:
            ep.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ep.task

    # --- the device manager ---------------------------------------------------------------

    async def register(self, request: api.RegisterRequest) -> str | None:
        """The checks of the kubelet's Register; an error string when refused."""
        if request.version not in SUPPORTED_VERSIONS:
            return (
                f'requested API version "{request.version}" is not supported by kubelet.'
                f" Supported version is {list(SUPPORTED_VERSIONS)}"
            )
        if not is_extended_resource_name(request.resource_name):
            return f'the ResourceName "{request.resource_name}" is invalid'
        if request.resource_name in self.hold:
            await self.hold[request.resource_name].wait()
        socket = self.plugin_dir / request.endpoint
        channel = grpc.aio.insecure_channel(f"unix://{socket}")
        try:
            await asyncio.wait_for(channel.channel_ready(), 10)
            stub = api_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(api.Empty())
        except (TimeoutError, grpc.aio.AioRpcError) as err:
            await channel.close()
            return f"failed to dial device plugin: {err!r}"
        old = self.endpoints.get(request.resource_name)
        ep = Endpoint(request.resource_name, socket, channel, stub, options)
        self.endpoints[request.resource_name] = ep
        if old is not None:
            ep.devices = dict.fromkeys(old.devices, "Unhealthy")
            await self._close(old)
        if request.resource_name in self.drop_before_watch:
            self.drop_before_watch.discard(request.resource_name)
            await self._close(ep)
        else:
            ep.task = asyncio.create_task(self._list_and_watch(ep))
        self.registrations.append((request.resource_name, request.endpoint))
        await self._notify()
        return None

    async def _list_and_watch(self, ep: Endpoint) -> None:
        try:
            call = ep.stub.ListAndWatch(api.Empty())
            ep.call = call
            async for response in call:
                ep.devices = {d.ID: d.health for d in response.devices}
                ep.updates += 1
                await self._notify()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            if self.endpoints.get(ep.resource) is ep and not ep.stopped:
                # The kubelet's PluginDisconnected: every device unhealthy, capacity kept.
                ep.stopped = True
                ep.devices = dict.fromkeys(ep.devices, "Unhealthy")
                await self._notify()

    async def _close(self, ep: Endpoint) -> None:
        ep.stopped = True
        if ep.task is not None and not ep.task.done():
            ep.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ep.task
        await ep.channel.close()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class _Registration:
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    async def Register(self, request: api.RegisterRequest, context: grpc.aio.ServicerContext) -> api.Empty:
        error = await self.kubelet.register(request)
        if error is not None:
            self.kubelet.refusals.append(error)
            await self.kubelet._notify()
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return api.Empty()
