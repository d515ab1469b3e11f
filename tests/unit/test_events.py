"""Events about the Node across an API server outage (sharing.kube.events): kept, counted, sent later."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from sharing.errors import KubeError
from sharing.kube import ForbiddenError, UnreachableError
from sharing.kube import events as events_module
from sharing.kube.events import BACKLOG, MAX_TRIES, EventOutbox
from tests.unit.fakekube import FakeKube


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 3, 7, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube("node-1", {})


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def outbox(kube: FakeKube, clock: Clock) -> EventOutbox:
    return EventOutbox(kube, lambda: kube.node, clock=clock)


async def test_an_event_is_recorded_at_once_when_the_server_answers(
    kube: FakeKube, outbox: EventOutbox
) -> None:
    await outbox.record("Warning", "GpuUnhealthy", "GPU 1: XID 79")
    assert [("Warning", "GpuUnhealthy", "GPU 1: XID 79")] == kube.events
    assert 0 == outbox.waiting


async def test_an_event_of_an_outage_is_recorded_when_the_server_is_back_with_its_repeats_counted(
    kube: FakeKube, outbox: EventOutbox, clock: Clock
) -> None:
    """An XID during an API server outage: its Event used to be dropped with the failed request."""
    kube.events_fail = UnreachableError("connection refused")
    first = clock.now
    await outbox.record("Warning", "GpuUnhealthy", "GPU 1: XID 79")
    clock.now += timedelta(seconds=5)
    await outbox.record("Warning", "GpuUnhealthy", "GPU 1: XID 79")
    await outbox.record("Warning", "MpsDaemonDown", "GPU 0's daemon does not answer")
    assert ([], 2) == (kube.events, outbox.waiting)
    assert not await outbox.flush()  # still down: nothing lost
    kube.events_fail = None
    assert await outbox.flush()
    assert [
        ("Warning", "GpuUnhealthy", "GPU 1: XID 79"),
        ("Warning", "MpsDaemonDown", "GPU 0's daemon does not answer"),
    ] == kube.events
    assert [2, 1] == kube.event_counts
    assert (first, first + timedelta(seconds=5)) == kube.event_times[0]


async def test_an_event_the_server_rejects_is_not_sent_again(kube: FakeKube, outbox: EventOutbox) -> None:
    kube.events_fail = KubeError("HTTP 422 Unprocessable Entity: Event is invalid")
    await outbox.record("Warning", "GpuUnhealthy", "GPU 1: XID 79")
    kube.events_fail = None
    assert await outbox.flush()
    assert ([], 0, 1) == (kube.events, outbox.waiting, outbox.dropped)


async def test_a_refused_event_is_tried_as_often_as_client_go_tries_one(
    kube: FakeKube, outbox: EventOutbox
) -> None:
    """A starting API server refuses until its RBAC data has loaded: tried again, a bounded number of
    times (client-go's broadcaster: maxTriesPerEvent)."""
    kube.events_fail = ForbiddenError("HTTP 403 Forbidden")
    await outbox.record("Warning", "GpuUnhealthy", "GPU 1: XID 79")
    for _ in range(MAX_TRIES - 2):
        assert not await outbox.flush()
    assert 1 == outbox.waiting
    assert await outbox.flush()  # the last try: given up
    assert ([], 0, 1) == (kube.events, outbox.waiting, outbox.dropped)


async def test_the_backlog_is_bounded_and_the_oldest_goes_first(kube: FakeKube, outbox: EventOutbox) -> None:
    kube.events_fail = UnreachableError("connection refused")
    for n in range(BACKLOG + 3):
        await outbox.record("Normal", "ConfigApplied", f"change {n}")
    assert (BACKLOG, 3) == (outbox.waiting, outbox.dropped)
    kube.events_fail = None
    assert await outbox.flush()
    assert [f"change {n}" for n in range(3, BACKLOG + 3)] == [m for _, _, m in kube.events]


@pytest.fixture
async def running(outbox: EventOutbox, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[EventOutbox]:
    monkeypatch.setattr(events_module, "RETRY_MIN_S", 0.01)
    monkeypatch.setattr(events_module, "RETRY_MAX_S", 0.02)
    task = asyncio.create_task(outbox.run())
    yield outbox
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_agent_sends_what_waits_once_the_server_answers_without_being_asked(
    kube: FakeKube, running: EventOutbox
) -> None:
    kube.events_fail = UnreachableError("connection refused")
    await running.record("Warning", "GpuUnhealthy", "GPU 1: XID 79")
    kube.events_fail = None
    async with asyncio.timeout(10):
        while running.waiting:  # the outbox's own retries, at most RETRY_MAX_S apart
            await asyncio.sleep(0.01)  # polling the fake API server, with a deadline
    assert [("Warning", "GpuUnhealthy", "GPU 1: XID 79")] == kube.events
