"""The gRPC services on the DRA socket: DRAPlugin v1 (prepare, unprepare) and DRAResourceHealth
v1alpha1 (device health for the pods' status, KEP-4680).

Every claim of a request gets an entry in the answer, with its error when it failed; a gRPC-level
error would make the kubelet drop the whole answer (dra/v1 api.proto, NodePrepareResources).

Health is streamed as the complete list of the pool's devices, again whenever it changes and at
least every `resend_s`: the kubelet stamps each device with the time it heard of it and reads a
device it has not heard of within its timeout (30 s by default) as Unknown
(k8s.io/kubernetes pkg/kubelet/cm/dra/healthinfo.go, getHealthInfo and updateHealthInfo).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc
import structlog

from sharing.devices import Health, HealthState, Inventory
from sharing.dra.claims import ClaimKey
from sharing.dra.names import pool_device_name
from sharing.dra.prepare import Preparer
from sharing.kubelet.api import dra_v1_pb2 as dra
from sharing.kubelet.api import drahealth_v1alpha1_pb2 as health
from sharing.model import GpuUuid, MigUuid
from sharing.store import PreparedDevice

log = structlog.get_logger(__name__)

UNHEALTHY_MESSAGE = (
    "the GPU driver reported a critical error (XID) on this device or its GPU, or lost the GPU"
)


class DraService:
    """The DRAPlugin service (duck-typed to the generated servicer, like the device plugins')."""

    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: grpc.aio.ServicerContext
    ) -> dra.NodePrepareResourcesResponse:
        """Prepare each claim; its CDI device IDs per device, or its error."""
        answers = await self.preparer.prepare(_keys(request.claims))
        return dra.NodePrepareResourcesResponse(
            claims={
                uid: dra.NodePrepareResourceResponse(
                    devices=[
                        dra.Device(
                            request_names=list(d.requests),
                            pool_name=d.pool,
                            device_name=d.device,
                            cdi_device_ids=list(d.cdi_ids),
                            share_id=d.share_id,
                        )
                        for d in answer.devices
                    ],
                    error=answer.error,
                )
                for uid, answer in answers.items()
            }
        )

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: grpc.aio.ServicerContext
    ) -> dra.NodeUnprepareResourcesResponse:
        """Unprepare each claim; its error when that failed."""
        answers = await self.preparer.unprepare(_keys(request.claims))
        return dra.NodeUnprepareResourcesResponse(
            claims={uid: dra.NodeUnprepareResourceResponse(error=e) for uid, e in answers.items()}
        )


def _keys(claims: Iterable[dra.Claim]) -> list[ClaimKey]:
    return [ClaimKey(c.namespace, c.name, c.uid) for c in claims]


@dataclass(frozen=True, slots=True)
class DeviceHealthState:
    """One device's health as the stream reports it."""

    device: str
    healthy: bool


def health_of(
    inventory: Inventory,
    ondemand: Iterable[PreparedDevice] = (),
    gpus: HealthState | None = None,
) -> tuple[DeviceHealthState, ...]:
    """Every device of the pool with its health (the inventory's health overlay), sorted by name; a
    replicated device is one device, unhealthy when any of its replicas is. The on-demand MIG devices
    made for claims are unhealthy when the backend reported an XID on their GPU or on them."""
    found: dict[str, bool] = {}
    for _, devices in inventory.resources:
        for d in devices:
            name = pool_device_name(d)
            found[name] = found.get(name, True) and d.health is Health.HEALTHY
    gpus = gpus if gpus is not None else HealthState()
    for p in ondemand:
        gpu, mig = GpuUuid(p.gpu_uuid), MigUuid(p.uuid)
        found[p.device] = gpu not in gpus.unhealthy_gpus and (gpu, mig) not in gpus.unhealthy_migs
    return tuple(DeviceHealthState(n, found[n]) for n in sorted(found))


class HealthFeed:
    """The latest device health list; each NodeWatchResources stream follows it (latest wins)."""

    def __init__(self) -> None:
        self.devices: tuple[DeviceHealthState, ...] = ()
        self.changed_at = int(time.time())
        self._changed = asyncio.Event()
        self._closed = False

    def publish(self, devices: tuple[DeviceHealthState, ...]) -> bool:
        """Make `devices` the current list; True when it differs from the one before."""
        if devices == self.devices:
            return False
        self.devices, self.changed_at = devices, int(time.time())
        self._wake()
        return True

    def close(self) -> None:
        """End every stream."""
        self._closed = True
        self._wake()

    async def watch(self, resend_s: float) -> AsyncIterator[tuple[DeviceHealthState, ...]]:
        """The current list now, then after each change or `resend_s` without one, until closed."""
        while not self._closed:
            changed = self._changed
            yield self.devices
            try:
                async with asyncio.timeout(resend_s):
                    await changed.wait()
            except TimeoutError:
                pass

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


class HealthService:
    """The DRAResourceHealth service: the pool's device health, streamed."""

    def __init__(self, pool: str, feed: HealthFeed, resend_s: float) -> None:
        self.pool = pool
        self.feed = feed
        self.resend_s = resend_s
        self.streams = 0

    async def NodeWatchResources(
        self, request: health.NodeWatchResourcesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health.NodeWatchResourcesResponse]:
        """The complete list of the pool's devices and their health, again on every change."""
        self.streams += 1
        log.info("dra_health_stream_opened")
        try:
            async for devices in self.feed.watch(self.resend_s):
                yield health.NodeWatchResourcesResponse(
                    devices=[
                        health.DeviceHealth(
                            device=health.DeviceIdentifier(pool_name=self.pool, device_name=d.device),
                            health=health.HEALTHY if d.healthy else health.UNHEALTHY,
                            last_updated_time=self.feed.changed_at,
                            message="" if d.healthy else UNHEALTHY_MESSAGE,
                        )
                        for d in devices
                    ]
                )
        finally:
            self.streams -= 1
            log.info("dra_health_stream_closed")
