"""What the agent tells people and probes: /healthz, /readyz, /status and /metrics.

Liveness means the loops are running (the reconcile loop, the health watch, the plugin fleet's
worker); readiness means every resource of the last advertisement is registered with the kubelet
and streaming. /status is the document `sharing status` prints (`sharing.ops.status`), with who holds
which slice read from the kubelet's PodResources at that moment (cached for a second, so a busy
scraper does not become a PodResources load); /metrics renders from the same document.

The probes answer from memory at once. /metrics renders at most one at a time and at most once a
second: a scrape while a rendering is in flight gets the last one (so a flood of scrapes costs one
rendering a second, not one thread each). Which pod holds which slice (/status, and the metrics that
name it: `gpu_sharing_slice_owner_info` and the slices' usage) is served to every address by default,
as kube-state-metrics shows the same; with `holders_localhost_only` only to 127.0.0.1 (`sharing
status` in the agent's container), and /metrics elsewhere leaves those metrics out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sharing.config import Frontend
from sharing.deviceplugin import Fleet
from sharing.devices import Inventory, with_health
from sharing.dra.foreign import Foreign
from sharing.dra.fragmentation import GpuRoom
from sharing.gpu.mps import MpsDaemons
from sharing.kubelet import Holders
from sharing.mig import Catalog
from sharing.model import NodeState
from sharing.ops.http import Answer, Handler, Request
from sharing.ops.metrics import POD_METRICS, Metrics
from sharing.ops.status import ConfigStatus, mps_daemon, status_document
from sharing.store import PreparedClaim
from sharing.usage import UsageSampler

HOLDERS_TTL_S = 1.0
RENDER_TTL_S = 1.0
"""A rendering younger than this is served again."""
POD_METRIC_NAMES = tuple(name.encode() for name in POD_METRICS)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_TYPE = "application/json"


class Fragments(Protocol):
    """The DRA front-end as the report reads it."""

    def room(self) -> Sequence[GpuRoom]:
        """Per dynamic GPU: the largest profile it can still take and its stranded compute."""
        ...

    def foreign(self) -> Sequence[Foreign]:
        """The MIG instances on the dynamic GPUs that the agent did not make."""
        ...

    def recorded(self) -> Sequence[PreparedClaim]:
        """The claims prepared on this node as the plugin's checkpoint records them."""
        ...


class Hardware(Protocol):
    """What the report reads of the hardware side of the agent (`sharing.rollout.Rollout`)."""

    @property
    def node(self) -> NodeState:
        """The node the advertised devices were built from."""
        ...

    @property
    def frontend(self) -> Frontend:
        """The front-end in service."""
        ...

    @property
    def mps(self) -> MpsDaemons | None:
        """The MPS control daemons (None: MPS is not offered on this node)."""
        ...

    @property
    def dra(self) -> Fragments | None:
        """The DRA front-end (None: this agent has none)."""
        ...

    def offered(self) -> Inventory:
        """What the front-end offers now."""
        ...

    async def holders(self, *, deciding: bool = True) -> Holders:
        """Who holds which device (`deciding` False: as the kubelet lists it, the API server not asked)."""
        ...


class Reporter:
    """Builds the status document and answers the HTTP routes."""

    def __init__(
        self,
        node_name: str,
        hardware: Hardware,
        fleet: Fleet,
        metrics: Metrics,
        config: Callable[[], ConfigStatus] = ConfigStatus,
        *,
        holders_localhost_only: bool = False,
        claim_mps: MpsDaemons | None = None,
        usage: UsageSampler | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        self.node_name = node_name
        self.hardware = hardware
        self.claim_mps = claim_mps
        """The MPS control daemons of on-demand MIG devices claims share (`sharing.dra.ondemand`)."""
        self.fleet = fleet
        self.metrics = metrics
        self.config = config
        """The config side of the status, from the agent."""
        self.alive: Callable[[], bool] = lambda: True
        self.frontend: Callable[[], tuple[bool, str]] | None = None
        """The front-end in service: (its servers run, why it is not ready or ""); None: the fleet."""
        self.advertised = False
        """True once the agent advertised what the hardware has (readiness needs it)."""
        self.holders_localhost_only = holders_localhost_only
        self.usage = usage
        """The usage sampler (None: usage is off)."""
        self.catalog = catalog
        """MIG geometry where the driver lists none, for the slices' right sizes."""
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._rendered: tuple[float, bytes] | None = None
        self._rendering: asyncio.Task[bytes] | None = None

    def routes(self) -> dict[str, Handler]:
        """The HTTP server's paths."""
        return {
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/status": self._status,
            "/metrics": self._metrics,
        }

    async def status(self) -> dict[str, Any]:
        """The node's status now (holders read from the kubelet, at most once a second)."""
        loop = asyncio.get_running_loop()
        if self._cached is not None and loop.time() - self._cached[0] < HOLDERS_TTL_S:
            return self._cached[1]
        holders = await self.hardware.holders(deciding=False)
        health = self.fleet.health
        daemons = self.hardware.mps.status() if self.hardware.mps is not None else ()
        if self.claim_mps is not None:  # keyed by MIG UUID: each is shown beside its claim's slice
            daemons += self.claim_mps.status()
        document = status_document(
            self.node_name,
            self.hardware.node,
            with_health(self.hardware.offered(), health),
            None if holders.unknown else holders.pods,
            self.config(),
            holders_error=holders.unknown,
            unhealthy=frozenset(health.unhealthy_gpus),
            mps={
                d.gpu: mps_daemon(
                    d.pipe_directory,
                    (d.wanted.active_thread_percentage, d.wanted.pinned_memory_mib),
                    None
                    if d.enforced is None
                    else (d.enforced.active_thread_percentage, d.enforced.pinned_memory_mib),
                    d.restarts,
                    d.error,
                )
                for d in daemons
            },
            claims=holders.claims,
            frontend=self.hardware.frontend.value,
            room=self.hardware.dra.room() if self.hardware.dra is not None else (),
            foreign=self.hardware.dra.foreign() if self.hardware.dra is not None else (),
            recorded=self.hardware.dra.recorded() if self.hardware.dra is not None else (),
            usage=self.usage.report if self.usage is not None else None,
            usage_enabled=self.usage is not None,
            catalog=self.catalog,
        )
        self.metrics.snapshot(document, ((p.resource, p.registered) for p in self.fleet.status()))
        self._cached = (loop.time(), document)
        return document

    async def _healthz(self, request: Request) -> Answer:
        serving = self.fleet.alive if self.frontend is None else self.frontend()[0]
        if self.alive() and serving:
            return Answer(200, b"ok\n")
        return Answer(503, b"a loop of the agent has stopped\n")

    async def _readyz(self, request: Request) -> Answer:
        if not self.advertised:
            return Answer(503, b"not advertised yet\n")
        if self.frontend is not None and (why := self.frontend()[1]):
            return Answer(503, f"{why}\n".encode())
        if self.frontend is None and not self.fleet.ready:
            waiting = [p.resource for p in self.fleet.status() if not p.registered]
            return Answer(
                503, f"not registered with the kubelet: {', '.join(waiting) or 'pending'}\n".encode()
            )
        return Answer(200, b"ok\n")

    async def _status(self, request: Request) -> Answer:
        if self.holders_localhost_only and not request.local:
            return Answer(403, b"/status names the pods holding each GPU: served on localhost only\n")
        document = await self.status()
        return Answer(200, json.dumps(document, indent=1).encode() + b"\n", JSON_TYPE)

    async def _metrics(self, request: Request) -> Answer:
        loop = asyncio.get_running_loop()
        rendered = self._rendered
        if rendered is None or loop.time() - rendered[0] >= RENDER_TTL_S:
            if self._rendering is None:  # this scrape renders: it gets what it rendered
                self._rendering = asyncio.create_task(self._render())
                await asyncio.shield(self._rendering)
            elif rendered is None:  # the first rendering is in flight: nothing to serve meanwhile
                await asyncio.shield(self._rendering)
        assert self._rendered is not None
        body = self._rendered[1]
        if self.holders_localhost_only and not request.local:
            body = b"".join(
                line
                for line in body.splitlines(keepends=True)
                if not any(n in line for n in POD_METRIC_NAMES)
            )
        return Answer(200, body, METRICS_TYPE)

    async def _render(self) -> bytes:
        """One rendering (the only one in flight), kept for the scrapes that come meanwhile."""
        try:
            await self.status()
            started = asyncio.get_running_loop().time()
            body = await asyncio.to_thread(self.metrics.render)
            self._rendered = (started, body)
            return body
        finally:
            self._rendering = None
