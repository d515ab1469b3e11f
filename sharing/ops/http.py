"""The agent's small HTTP server: probes (/healthz, /readyz), /metrics and /status, on one port.

asyncio, on the agent's own loop: a handler only reads what the agent already knows (and the metrics
text is rendered in a thread), so a scrape never holds up the reconcile loop or the gRPC servers.
Each connection gets one answer and is closed; requests are read with a deadline and a size bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import structlog

from sharing.errors import PluginError

log = structlog.get_logger(__name__)
READ_TIMEOUT_S = 5.0
MAX_REQUEST_LINE = 8192


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP response: status, content type and body."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Handler = Callable[[], Awaitable[Answer]]
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


class HttpServer:
    """Serves GET on a fixed set of paths."""

    def __init__(self, port: int, routes: Mapping[str, Handler], host: str = "0.0.0.0") -> None:
        # Every address: probes come from the kubelet, scrapes from Prometheus.
        self.port = port
        self.host = host
        self.routes = dict(routes)
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
        log.info("http_serving", port=self.port, paths=sorted(self.routes))

    async def stop(self) -> None:
        """Stop listening and close open connections."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            answer = await self._answer(reader)
            head = (
                f"HTTP/1.1 {answer.status} {_REASONS.get(answer.status, 'Error')}\r\n"
                f"Content-Type: {answer.content_type}\r\nContent-Length: {len(answer.body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + answer.body)
            await writer.drain()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> Answer:
        async with asyncio.timeout(READ_TIMEOUT_S):
            line = await reader.readuntil(b"\r\n")
            if len(line) > MAX_REQUEST_LINE:
                return Answer(400, b"request line too long\n")
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # headers: not needed
                pass
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            return Answer(400, b"bad request\n")
        method, target, _ = parts
        handler = self.routes.get(target.split("?", 1)[0])
        if handler is None:
            return Answer(404, b"not found; try " + ", ".join(sorted(self.routes)).encode() + b"\n")
        if method != "GET":
            return Answer(405, b"only GET\n")
        try:
            return await handler()
        except Exception as err:  # a bug in one handler must not take the server down
            log.error(
                "http_handler_failed", path=target[:100], error=f"{type(err).__name__}: {str(err)[:300]}"
            )
            return Answer(503, b"internal error\n")
