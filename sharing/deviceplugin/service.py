"""The DevicePlugin gRPC service of one resource, and the device feed its ListAndWatch streams follow.

The kubelet rules it keeps: ListAndWatch sends the full list at once and again on every change,
and stays open for the plugin's life (the kubelet marks every device unhealthy when it ends and
never dials again); Allocate and GetPreferredAllocation refuse bad requests with INVALID_ARGUMENT
and a message that says why, never with a crash.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
import structlog

from sharing.deviceplugin.allocation import AllocationError, AllocationPolicy, allocate, preferred_allocation
from sharing.devices import Device, Injection
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.text import bounded

log = structlog.get_logger(__name__)


class DeviceFeed:
    """The latest device list of one resource; each ListAndWatch stream follows it (latest wins)."""

    def __init__(self, devices: tuple[Device, ...] = ()) -> None:
        self._devices = devices
        self._changed = asyncio.Event()
        self._closed = False
        self._encoded: dict[int, tuple[Device, bytes]] = {}
        self._response: tuple[tuple[Device, ...], api.ListAndWatchResponse] | None = None

    @property
    def devices(self) -> tuple[Device, ...]:
        """The current list."""
        return self._devices

    def publish(self, devices: tuple[Device, ...]) -> bool:
        """Make `devices` the current list; True when it differs from the previous one."""
        if devices == self._devices:
            return False
        self._devices = devices
        self._wake()
        return True

    def response(self, devices: tuple[Device, ...]) -> api.ListAndWatchResponse:
        """`devices` as the kubelet gets them: built once per list for every stream.

        Each device is encoded once and kept while the lists hold the same object (a health change
        flips one GPU's devices of many; the others are the objects of the list before). The wire
        form of a repeated message field is its elements' (tag, length, bytes) one after another
        (https://protobuf.dev/programming-guides/encoding/), so the response is those joined and
        parsed once: 0.3 ms for 2,048 devices, where hashing each device and copying each message
        into a new response took 4 ms, most of the time to the kubelet.
        """
        if self._response is not None and self._response[0] is devices:
            return self._response[1]
        encoded: dict[int, tuple[Device, bytes]] = {}
        parts = []
        for d in devices:
            entry = self._encoded.get(id(d))
            if entry is None or entry[0] is not d:
                entry = (d, _as_list_element(to_proto(d)))
            encoded[id(d)] = entry
            parts.append(entry[1])
        response: api.ListAndWatchResponse = api.ListAndWatchResponse.FromString(b"".join(parts))
        if devices is self._devices:
            self._encoded, self._response = encoded, (devices, response)
        return response

    def resend(self) -> None:
        """Send the current list again on every stream."""
        self._wake()

    def close(self) -> None:
        """End every stream after it has sent the current list."""
        self._closed = True
        self._wake()

    async def watch(self) -> AsyncIterator[tuple[Device, ...]]:
        """The current list now, then the newest list after each change, until closed."""
        while True:
            changed = self._changed
            yield self._devices
            if self._closed:
                return
            await changed.wait()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


# The tag of ListAndWatchResponse.devices: its field number, wire type 2 (length-delimited).
_DEVICES_FIELD = (api.ListAndWatchResponse.DESCRIPTOR.fields_by_name["devices"].number << 3) | 2


def _as_list_element(device: api.Device) -> bytes:
    """The device as one element of ListAndWatchResponse.devices on the wire."""
    body: bytes = device.SerializeToString()
    size, prefix = len(body), bytearray([_DEVICES_FIELD])
    while size > 0x7F:  # the length as a base-128 varint, low groups first
        prefix.append(0x80 | (size & 0x7F))
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + body


def to_proto(device: Device) -> api.Device:
    """The kubelet's view of a device: ID, health and NUMA node when known."""
    topology = (
        api.TopologyInfo(nodes=[api.NUMANode(ID=device.numa_node)]) if device.numa_node is not None else None
    )
    return api.Device(ID=device.id, health=device.health.value, topology=topology)


HANDED_OUT_KEPT_S = 30.0
"""How long after Allocate handed a device out it counts as held (`sharing.rollout.holding`) and, dropped
from its list, stays in it unhealthy (`PluginServer.update`), at most: the kubelet records the
allocation as Allocate returns, and PodResources lists it from then on."""


class Handouts:
    """Device ID -> loop time of the last Allocate that handed it out, across every plugin server.

    The fleet owns it, not a server: a kubelet restart makes each plugin register again on a fresh
    server, and the kubelet may not list a device handed out just before in PodResources yet.
    """

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def record(self, device_ids: Iterable[str]) -> None:
        """These IDs were handed out now."""
        self._at.update(dict.fromkeys(device_ids, asyncio.get_running_loop().time()))

    def since(self, since: float) -> dict[str, float]:
        """{ID: loop time} of the IDs handed out at or after loop time `since`; records older than
        `HANDED_OUT_KEPT_S` are dropped (younger ones are kept: a list may keep their devices for the
        kubelet to read)."""
        kept = asyncio.get_running_loop().time() - HANDED_OUT_KEPT_S
        self._at = {device: at for device, at in self._at.items() if at >= kept}
        return {device: at for device, at in self._at.items() if at >= since}

    def forget(self, device_ids: frozenset[str]) -> None:
        """Drop the records of these IDs (the kubelet lists their pods now)."""
        for device in device_ids & self._at.keys():
            del self._at[device]


class DevicePluginService:
    """The DevicePlugin gRPC service of one resource.

    Duck-typed to the generated servicer (its methods keep the gRPC names), since subclassing the
    untyped generated class would hide these signatures from mypy.
    """

    def __init__(
        self,
        resource: str,
        feed: DeviceFeed,
        *,
        policy: AllocationPolicy,
        injection: Injection,
        fail_requests_greater_than_one: Callable[[], bool],
        on_stream_change: Callable[[bool], None],
        handouts: Handouts,
    ) -> None:
        self.resource = resource
        self.feed = feed
        self.policy = policy
        self.injection = injection
        self.fail_requests_greater_than_one = fail_requests_greater_than_one
        self.on_stream_change = on_stream_change
        self.streams = 0
        """Open ListAndWatch streams that have sent their first list."""
        self.handouts = handouts

    async def GetDevicePluginOptions(
        self, request: api.Empty, context: grpc.aio.ServicerContext
    ) -> api.DevicePluginOptions:
        """Preferred allocation on, no PreStartContainer."""
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(
        self, request: api.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.ListAndWatchResponse]:
        """The full list at once, then a new full list on every change."""
        sent = False
        try:
            async for devices in self.feed.watch():
                yield self.feed.response(devices)
                if not sent:
                    sent = True
                    self.streams += 1
                    log.debug("list_and_watch_opened", resource=self.resource)
                    self.on_stream_change(True)
        finally:
            if sent:
                self.streams -= 1
            log.debug("list_and_watch_closed", resource=self.resource)
            self.on_stream_change(False)

    async def GetPreferredAllocation(
        self, request: api.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> api.PreferredAllocationResponse:
        """A hint: which devices the container should get."""
        if not request.container_requests:
            await _invalid(context, f"{self.resource}: GetPreferredAllocation without container requests")
        responses = []
        for r in request.container_requests:
            try:
                ids = preferred_allocation(
                    self.resource,
                    self.feed.devices,
                    available=r.available_deviceIDs,
                    must_include=r.must_include_deviceIDs,
                    size=r.allocation_size,
                    policy=self.policy,
                )
            except AllocationError as err:
                await _invalid(context, str(err))
            responses.append(api.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(
        self, request: api.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> api.AllocateResponse:
        """What each container gets: variables, mounts, annotations, CDI devices (per the strategies)."""
        if not request.container_requests:
            await _invalid(context, f"{self.resource}: Allocate without container requests")
        responses = []
        for r in request.container_requests:
            try:
                got = allocate(
                    self.resource,
                    self.feed.devices,
                    r.devices_ids,
                    fail_requests_greater_than_one=self.fail_requests_greater_than_one(),
                    injection=self.injection,
                )
            except AllocationError as err:
                log.warning("allocate_refused", resource=self.resource, reason=bounded(str(err)))
                await _invalid(context, str(err))
            self.handouts.record(r.devices_ids)
            responses.append(
                api.ContainerAllocateResponse(
                    envs=dict(got.envs),
                    annotations=dict(got.annotations),
                    mounts=[
                        api.Mount(
                            container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
                        )
                        for m in got.mounts
                    ],
                    cdi_devices=[api.CDIDevice(name=n) for n in got.cdi_devices],
                )
            )
        return api.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: api.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> api.PreStartContainerResponse:
        """Nothing to do before a container starts (never called: pre_start_required is false)."""
        return api.PreStartContainerResponse()


async def _invalid(context: grpc.aio.ServicerContext, message: str) -> None:
    # Bounded: gRPC sends the message in trailing metadata (8 KiB by default); a longer one would
    # reach the kubelet as RESOURCE_EXHAUSTED instead of this answer.
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(message, 1000))
