"""The agent's HTTP port under a flood, on real sockets on 127.0.0.1: the probes are always answered.

The port is unauthenticated on the pod network; idle connections, scrapes in a loop or slow readers
must not starve /healthz (the kubelet would restart the agent), nor hold a descriptor each.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest

from sharing.deviceplugin.fleet import Fleet
from sharing.ops.http import Answer, HttpServer, Request
from sharing.ops.metrics import Metrics
from sharing.ops.report import Reporter
from sharing.rollout import Rollout

CAP = 8


async def _ok(request: Request) -> Answer:
    return Answer(200, b"ok\n")


@pytest.fixture
async def stuck() -> AsyncIterator[asyncio.Event]:
    release = asyncio.Event()
    yield release
    release.set()


@pytest.fixture
async def server(stuck: asyncio.Event) -> AsyncIterator[HttpServer]:
    async def never(request: Request) -> Answer:
        await stuck.wait()
        return Answer(200, b"late\n")

    http = HttpServer(0, {"/healthz": _ok, "/metrics": never}, host="127.0.0.1", max_connections=CAP)
    await http.start()
    yield http
    await http.stop()


async def get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def closed_by_the_server(reader: asyncio.StreamReader) -> bool:
    return b"" == await asyncio.wait_for(reader.read(), 10)


async def test_idle_connections_past_the_cap_are_closed_oldest_first_and_a_probe_is_answered(
    server: HttpServer,
) -> None:
    idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(CAP + 4)]
    answer = await get(server.port, "/healthz")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\nok\n")
    # The 4 beyond the cap and 1 for the probe: the oldest idle ones, each a descriptor freed.
    assert [True] * 5 == [await closed_by_the_server(r) for r, _ in idle[:5]]
    for _, writer in idle:
        writer.close()


async def test_a_flood_from_one_address_closes_only_its_own_connections(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)  # the oldest: the kubelet's
    flood = [
        await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
        for _ in range(CAP * 3)
    ]
    assert await closed_by_the_server(flood[0][0])
    writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")  # still open: answered
    assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"\r\n\r\nok\n")
    for _, w in [*flood, (reader, writer)]:
        w.close()


async def test_a_probe_is_answered_while_every_slot_holds_a_request_being_answered(
    server: HttpServer,
) -> None:
    busy = []
    for _ in range(CAP):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
        await writer.drain()
        busy.append((reader, writer))
    answer = await get(server.port, "/healthz")
    assert answer.endswith(b"\r\n\r\nok\n")
    assert await closed_by_the_server(busy[0][0])
    for _, writer in busy:
        writer.close()


def reporter(render: Callable[[], bytes], *, localhost_only: bool = False) -> Reporter:
    metrics = Metrics("test")
    report = Reporter(
        "n1", cast(Rollout, None), cast(Fleet, None), metrics, holders_localhost_only=localhost_only
    )
    document: dict[str, Any] = {
        "gpus": [
            {
                "index": 0, "uuid": "GPU-0", "product": "Tesla T4", "health": "Healthy",
                "slices": [{"resource": "nvidia.com/gpu", "id": "GPU-0::0",
                            "pod": {"namespace": "team-a", "pod": "trainer", "container": "main"}}],
            }
        ]
    }  # fmt: skip

    async def status() -> dict[str, Any]:
        metrics.snapshot(document, ())
        return document

    report.status = status  # type: ignore[method-assign]
    metrics.render = render  # type: ignore[method-assign]
    return report


async def test_a_flood_of_scrapes_renders_the_metrics_once_and_each_gets_that_rendering() -> None:
    started, release = threading.Event(), threading.Event()
    renders: list[int] = []

    def render() -> bytes:
        renders.append(1)
        started.set()
        release.wait(20)
        return b"gpu_sharing_up 1\n"

    metrics = reporter(render).routes()["/metrics"]
    first = asyncio.create_task(metrics(Request(local=False)))
    await asyncio.to_thread(started.wait, 10)
    flood = [asyncio.create_task(metrics(Request(local=False))) for _ in range(50)]
    release.set()
    answers = await asyncio.gather(first, *flood)
    assert [1] == renders
    assert {b"gpu_sharing_up 1\n"} == {a.body for a in answers}


async def test_the_pods_holding_gpus_can_be_kept_to_localhost() -> None:
    report = reporter(lambda: Metrics.render(cast(Any, report).metrics), localhost_only=True)
    routes = report.routes()
    assert 403 == (await routes["/status"](Request(local=False))).status
    assert b"team-a" in (await routes["/status"](Request(local=True))).body
    far = (await routes["/metrics"](Request(local=False))).body
    near = (await routes["/metrics"](Request(local=True))).body
    assert b"gpu_sharing_slice_owner_info" not in far
    assert b"gpu_sharing_slices_allocated" in far
    assert b'gpu_sharing_slice_owner_info{container="main",device="GPU-0::0"' in near


async def test_by_default_everyone_sees_the_pods_holding_gpus() -> None:
    report = reporter(lambda: Metrics.render(cast(Any, report).metrics))
    routes = report.routes()
    assert 200 == (await routes["/status"](Request(local=False))).status
    assert b"gpu_sharing_slice_owner_info{" in (await routes["/metrics"](Request(local=False))).body
