"""Events about the Node that outlive an API server outage: recorded at once when the server answers,
kept (bounded, deduplicated) and sent when it is back when it does not.

An XID during an outage turns its devices unhealthy at once; its `GpuUnhealthy` Event used to be
dropped with the failed request, so nobody reading the Node's Events ever learnt why. The rules are
client-go's event broadcaster's (k8s.io/client-go tools/record/event.go, recordToSink and
recordEvent): an Event the server could not be reached for is tried again, one it rejected is not;
a refusal (401, 403, which a starting API server answers until its RBAC data has loaded) is tried
`MAX_TRIES` times, as that broadcaster tries each Event (`maxTriesPerEvent`). The same Event again
while one waits is counted into it (`count`, `lastTimestamp`), as that broadcaster's correlator
does; at most `BACKLOG` wait, the oldest dropped first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog

from sharing.errors import SharingError
from sharing.kube.api import ForbiddenError, KubeClient, NodeObject, UnreachableError
from sharing.text import bounded

log = structlog.get_logger(__name__)

BACKLOG = 64
MAX_TRIES = 12
RETRY_MIN_S = 1.0
RETRY_MAX_S = 5.0
"""client-go's broadcaster sleeps 10 s between tries; ours are closer (an unanswered try costs the
server nothing), so an Event is recorded within seconds of the server's return."""


@dataclass(slots=True)
class _Waiting:
    kind: str
    reason: str
    message: str
    first: datetime
    last: datetime
    count: int = 1
    refusals: int = 0


class EventOutbox:
    """Records Events about the Node through `kube`; those that cannot be sent yet wait in order."""

    def __init__(
        self,
        kube: KubeClient,
        node: Callable[[], NodeObject | None],
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self._node = node
        self._clock = clock
        self._waiting: dict[tuple[str, str, str], _Waiting] = {}
        self._wake = asyncio.Event()
        self._sending = asyncio.Lock()
        self.dropped = 0
        """Events given up (the backlog was full, or refused `MAX_TRIES` times)."""

    @property
    def waiting(self) -> int:
        """Events not recorded yet."""
        return len(self._waiting)

    async def record(self, kind: str, reason: str, message: str) -> None:
        """Record an Event now, or keep it for when the API server answers (never raises)."""
        now = self._clock()
        key = (kind, reason, bounded(message, 1000))
        if key in self._waiting:
            waiting = self._waiting[key]
            waiting.count += 1
            waiting.last = now
            return
        self._waiting[key] = _Waiting(*key, first=now, last=now)
        if len(self._waiting) > BACKLOG:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            self.dropped += 1
            log.warning("event_dropped", reason=oldest[1], why=f"more than {BACKLOG} Events wait")
        if len(self._waiting) == 1:
            await self.flush()
        self._wake.set()

    async def flush(self) -> bool:
        """Send what waits, oldest first; True when nothing is left."""
        async with self._sending:
            return await self._send()

    async def _send(self) -> bool:
        node = self._node()
        while self._waiting and node is not None:
            key, waiting = next(iter(self._waiting.items()))
            try:
                await asyncio.to_thread(
                    self.kube.create_node_event,
                    node,
                    waiting.kind,
                    waiting.reason,
                    waiting.message,
                    first=waiting.first,
                    last=waiting.last,
                    count=waiting.count,
                )
            except UnreachableError as err:
                log.warning("event_deferred", reason=waiting.reason, error=bounded(str(err)))
                return False
            except ForbiddenError as err:
                waiting.refusals += 1
                if waiting.refusals < MAX_TRIES:
                    log.warning("event_deferred", reason=waiting.reason, error=bounded(str(err)))
                    return False
                self._give_up(key, err)
            except SharingError as err:  # rejected: sending it again would be rejected again
                self._give_up(key, err)
            else:
                if waiting.count > 1 or waiting.first != waiting.last:
                    log.info("event_recorded_late", reason=waiting.reason, count=waiting.count)
                self._waiting.pop(key, None)
        return not self._waiting

    def _give_up(self, key: tuple[str, str, str], err: SharingError) -> None:
        self._waiting.pop(key, None)
        self.dropped += 1
        log.warning("event_not_recorded", reason=key[1], error=bounded(str(err)))

    async def run(self) -> None:
        """Send waiting Events again until they are recorded (1 s, then up to 10 s apart)."""
        delay = RETRY_MIN_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not await self.flush():
                await asyncio.sleep(delay)  # the retry interval of a server that did not answer
                delay = min(RETRY_MAX_S, delay * 2)
            delay = RETRY_MIN_S

    def wake(self) -> None:
        """Try the waiting Events now (the API server answered something)."""
        if self._waiting:
            self._wake.set()
