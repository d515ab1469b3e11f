"""What the agent tells people and probes: /healthz, /readyz, /status and /metrics.

Liveness means the loops are running (the reconcile loop, the health watch, the plugin fleet's
worker); readiness means every resource of the last advertisement is registered with the kubelet
and streaming. /status is the document `sharing status` prints (`sharing.ops.status`), with who holds
which slice read from the kubelet's PodResources at that moment (cached for a second, so a busy
scraper does not become a PodResources load); /metrics renders from the same document.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sharing.deviceplugin import Fleet
from sharing.devices import with_health
from sharing.ops.http import Answer, Handler
from sharing.ops.metrics import Metrics
from sharing.ops.status import ConfigStatus, status_document

if TYPE_CHECKING:  # the rollout imports the metrics of this package
    from sharing.rollout import Rollout

HOLDERS_TTL_S = 1.0
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_TYPE = "application/json"


class Reporter:
    """Builds the status document and answers the HTTP routes."""

    def __init__(
        self,
        node_name: str,
        rollout: Rollout,
        fleet: Fleet,
        metrics: Metrics,
        config: Callable[[], ConfigStatus] = ConfigStatus,
    ) -> None:
        self.node_name = node_name
        self.rollout = rollout
        self.fleet = fleet
        self.metrics = metrics
        self.config = config
        """The config side of the status, from the agent."""
        self.alive: Callable[[], bool] = lambda: True
        self.advertised = False
        """True once the agent advertised what the hardware has (readiness needs it)."""
        self._cached: tuple[float, dict[str, Any]] | None = None

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
        holders = await self.rollout.holders()
        health = self.fleet.health
        document = status_document(
            self.node_name,
            self.rollout.node,
            with_health(self.rollout.advertised, health),
            None if holders.unknown else holders.pods,
            self.config(),
            holders_error=holders.unknown,
            unhealthy=frozenset(health.unhealthy_gpus),
        )
        self.metrics.snapshot(document, ((p.resource, p.registered) for p in self.fleet.status()))
        self._cached = (loop.time(), document)
        return document

    async def _healthz(self) -> Answer:
        if self.alive() and self.fleet.alive:
            return Answer(200, b"ok\n")
        return Answer(503, b"a loop of the agent has stopped\n")

    async def _readyz(self) -> Answer:
        if not self.advertised:
            return Answer(503, b"not advertised yet\n")
        if not self.fleet.ready:
            waiting = [p.resource for p in self.fleet.status() if not p.registered]
            return Answer(
                503, f"not registered with the kubelet: {', '.join(waiting) or 'pending'}\n".encode()
            )
        return Answer(200, b"ok\n")

    async def _status(self) -> Answer:
        document = await self.status()
        return Answer(200, json.dumps(document, indent=1).encode() + b"\n", JSON_TYPE)

    async def _metrics(self) -> Answer:
        await self.status()
        return Answer(200, await asyncio.to_thread(self.metrics.render), METRICS_TYPE)
