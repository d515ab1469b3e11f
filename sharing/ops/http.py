"""The agent's small HTTP server: probes (/healthz, /readyz), /metrics and /status, on one port.

asyncio, on the agent's own loop: a handler only reads what the agent already knows (and the metrics
text is rendered in a thread, one at a time: `sharing.report`), so a scrape never holds up the
reconcile loop or the gRPC servers. Each connection gets one answer and is closed; requests are
read with a deadline and a size bound, answers written with one.

The port is on the pod network and unauthenticated, so a flood must not get the agent restarted by
its own liveness probe: at most MAX_CONNECTIONS are open at once (each one a descriptor for up to
READ_TIMEOUT_S). At the cap, a new connection closes one of the address that holds the most: its
oldest that is not a probe, idle ones first (a client that connects and sends nothing). So a flood
from one address only ever closes its own connections, and the kubelet's probe, from another
address, is read and answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog

from sharing.errors import PluginError

log = structlog.get_logger(__name__)
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 5.0
MAX_REQUEST_LINE = 8192
MAX_CONNECTIONS = 64
PROBES = frozenset({"/healthz", "/readyz"})


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP response: status, content type and body."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Request:
    """What a handler knows of the request: whether it came from this host (127.0.0.1 or ::1)."""

    local: bool


Handler = Callable[[Request], Awaitable[Answer]]
_REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


class _Connection:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        self.idle = True
        """Nothing read yet."""
        self.probe = False


class HttpServer:
    """Serves GET on a fixed set of paths, to at most `max_connections` connections at once."""

    def __init__(
        self,
        port: int,
        routes: Mapping[str, Handler],
        host: str = "0.0.0.0",
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        # Every address: probes come from the kubelet, scrapes from Prometheus.
        self.port = port
        self.host = host
        self.routes = dict(routes)
        self.max_connections = max_connections
        self.shed = 0
        """Connections closed to keep under the cap."""
        self._open: dict[_Connection, None] = {}  # oldest first
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; PluginError when the port cannot be bound."""
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as err:
            raise PluginError(f"cannot serve HTTP on port {self.port}: {err.strerror}") from err
        sockets = self._server.sockets
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info(
            "http_serving", port=self.port, paths=sorted(self.routes), max_connections=self.max_connections
        )

    async def stop(self) -> None:
        """Stop listening and close open connections."""
        if self._server is not None:
            self._server.close()
            for connection in list(self._open):
                connection.writer.transport.abort()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    def _make_room(self) -> bool:
        """Close the oldest connection that is not a probe, idle ones first; False when all are probes."""
        held = Counter(c.peer for c in self._open if not c.probe)
        if not held:
            return False
        most = max(held.values())
        mine = [c for c in self._open if not c.probe and held[c.peer] == most]  # oldest first
        victim = next((c for c in mine if c.idle), mine[0])
        del self._open[victim]
        victim.writer.transport.abort()
        self.shed += 1
        if self.shed in (1, 10, 100) or self.shed % 1000 == 0:
            log.warning("http_connections_shed", total=self.shed, cap=self.max_connections)
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self.max_connections and not self._make_room():
            writer.transport.abort()
            return
        connection = _Connection(writer)
        self._open[connection] = None
        try:
            answer = await self._answer(reader, connection)
            head = (
                f"HTTP/1.1 {answer.status} {_REASONS.get(answer.status, 'Error')}\r\n"
                f"Content-Type: {answer.content_type}\r\nContent-Length: {len(answer.body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + answer.body)
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await writer.drain()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._open.pop(connection, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, connection: _Connection) -> Answer:
        async with asyncio.timeout(READ_TIMEOUT_S):
            line = await reader.readuntil(b"\r\n")
            connection.idle = False
            if len(line) > MAX_REQUEST_LINE:
                return Answer(400, b"request line too long\n")
            parts = line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) == 3 else ""
            connection.probe = path in PROBES
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # headers: not needed
                pass
        if len(parts) != 3:
            return Answer(400, b"bad request\n")
        handler = self.routes.get(path)
        if handler is None:
            return Answer(404, b"not found; try " + ", ".join(sorted(self.routes)).encode() + b"\n")
        if parts[0] != "GET":
            return Answer(405, b"only GET\n")
        try:
            return await handler(Request(_local(connection.peer)))
        except Exception as err:  # a bug in one handler must not take the server down
            log.error("http_handler_failed", path=path[:100], error=f"{type(err).__name__}: {str(err)[:300]}")
            return Answer(503, b"internal error\n")


def _local(peer: str) -> bool:
    try:
        return ipaddress.ip_address(peer).is_loopback
    except ValueError:
        return False
