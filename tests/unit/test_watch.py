"""The watch loop against a scripted API: where each watch starts, resume, 410, backoff, surprises.

An in-memory fake is fine here (unit test); the e2e tests restart a real kube-apiserver. Delays are
recorded instead of slept, so "does not spin" is asserted on the delays the loop asked for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import structlog.testing

from sharing.errors import KubeError
from sharing.kube import (
    ForbiddenError,
    GoneError,
    NodeObject,
    UnreachableError,
    WatchBrokenError,
    Watched,
    WatchEvent,
)


def node(version: str, **labels: str) -> NodeObject:
    return NodeObject("n1", "uid", version, labels)


def changed(version: str, **labels: str) -> WatchEvent:
    return WatchEvent("MODIFIED", node(version, **labels), version)


class ScriptedApi:
    """Answers gets and watches from scripts; records where watches started and the pauses asked for."""

    def __init__(
        self, gets: list[NodeObject | Exception], watches: list[list[WatchEvent] | Exception]
    ) -> None:
        self.gets = gets
        self.watches = watches
        self.watch_versions: list[str] = []
        self.pauses: list[float] = []
        self.done = threading.Event()
        self.release = threading.Event()

    def get(self) -> NodeObject:
        answer = self.gets.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def watch(self, version: str) -> Iterator[WatchEvent]:
        self.watch_versions.append(version)
        if not self.watches:
            self.done.set()
            self.release.wait()  # the last script: block like an idle watch until the test ends
            return
        answer = self.watches.pop(0)
        if isinstance(answer, Exception):
            raise answer
        yield from answer

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)


async def run(api: ScriptedApi, changes: int) -> tuple[Watched[NodeObject], int]:
    seen = 0
    enough = asyncio.Event()

    def on_change() -> None:
        nonlocal seen
        seen += 1
        if seen >= changes:
            enough.set()

    watched = Watched("node/n1", api.get, api.watch, lambda n: n.labels, pause=api.pause)
    watched.start(on_change)
    await asyncio.wait_for(enough.wait(), 10)
    await asyncio.to_thread(api.done.wait, 10)
    watched.stop()
    api.release.set()
    return watched, seen


async def test_watches_from_the_newest_state_then_resumes_and_triggers_only_on_label_changes() -> None:
    api = ScriptedApi(
        gets=[node("1", a="1")],
        watches=[
            [changed("2", a="1"), changed("3", a="2")],
            [WatchEvent("BOOKMARK", None, "17")],
            [changed("18", a="3")],
        ],
    )
    watched, seen = await run(api, changes=3)
    # Never from the object's own (possibly ancient) version "1"; then from the newest seen.
    assert ["", "3", "17", "18"] == api.watch_versions
    assert 3 == seen  # the first read, then a=2, a=3; the status-only change at version 2 is not news
    assert watched.current == node("18", a="3")
    assert [] == api.pauses


async def test_a_410_starts_again_from_the_newest_state_without_a_spin() -> None:
    """After an API server restart every old version is gone: one 410, then watch from now."""
    api = ScriptedApi(
        gets=[node("1", a="1")],
        watches=[[changed("5", a="2")], GoneError("too old"), [changed("900", a="3")]],
    )
    watched, _ = await run(api, changes=3)
    assert ["", "5", "", "900"] == api.watch_versions
    assert [] == api.pauses  # a single 410 costs no wait
    assert watched.current == node("900", a="3")


async def test_a_410_after_an_outage_waits_nothing() -> None:
    """An API server restart: the watches fail while it is down (backing off), then the first answer
    is 410. That answer ends the outage: watching again from now must not wait the outage's backoff
    (it waited up to 30 s, so a label change made right after the restart was applied 34 s later)."""
    outage: list[list[WatchEvent] | Exception] = [KubeError("connection refused") for _ in range(6)]
    api = ScriptedApi(
        gets=[node("1", a="1")],
        watches=[[changed("5", a="2")], *outage, GoneError("too old"), [changed("900", a="3")]],
    )
    watched, _ = await run(api, changes=3)
    assert ["", "5", "5", "5", "5", "5", "5", "5", "", "900"] == api.watch_versions
    assert [0.2, 0.4, 0.8, 1.6, 3.2, 6.4] == api.pauses  # the outage's backoff, nothing after the 410
    assert watched.current == node("900", a="3")


async def test_while_the_api_server_does_not_answer_the_watch_tries_every_second() -> None:
    """A 10 s outage: with the backoff growing to 30 s the watch came back up to 13 s after the
    server did. Unanswered attempts cost the server nothing, so they wait at most a second; errors
    the server answers (below) still back off to the maximum."""
    outage: list[list[WatchEvent] | Exception] = [UnreachableError("connection refused") for _ in range(8)]
    api = ScriptedApi(gets=[node("1", a="1")], watches=[*outage, [changed("9", a="2")]])
    await run(api, changes=2)
    assert [0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0] == api.pauses


async def test_errors_the_server_answers_back_off_to_the_maximum() -> None:
    refused: list[list[WatchEvent] | Exception] = [KubeError("HTTP 403 Forbidden") for _ in range(10)]
    api = ScriptedApi(gets=[node("1", a="1")], watches=[*refused, [changed("9", a="2")]])
    await run(api, changes=2)
    assert [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0] == api.pauses


async def test_refusals_right_after_an_outage_are_retried_within_a_second() -> None:
    """A restarted API server answered the first watches with 403 (its authorizer had not loaded the
    RBAC objects yet), and the next try came 30 s later, the outage's backoff: a label change then
    took 28.6 s to apply. Refusals after a connection loss are retried at most a second apart, and
    the backoff starts again from its minimum."""
    outage: list[list[WatchEvent] | Exception] = [UnreachableError("connection refused") for _ in range(8)]
    refused: list[list[WatchEvent] | Exception] = [ForbiddenError("HTTP 403 Forbidden") for _ in range(5)]
    api = ScriptedApi(gets=[node("1", a="1")], watches=[*outage, *refused, [changed("9", a="2")]])
    await run(api, changes=2)
    outage_pauses, refused_pauses = [0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0], [0.2, 0.4, 0.8, 1.0, 1.0]
    assert [*outage_pauses, *refused_pauses] == api.pauses


async def test_an_answer_after_an_outage_starts_the_backoff_again() -> None:
    """Any error the server answers after an outage (a 503 while it starts) backs off from the
    minimum again, not from where the unanswered attempts left it."""
    outage: list[list[WatchEvent] | Exception] = [UnreachableError("connection refused") for _ in range(8)]
    api = ScriptedApi(
        gets=[node("1", a="1")], watches=[*outage, KubeError("HTTP 503"), [changed("9", a="2")]]
    )
    await run(api, changes=2)
    assert [0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2] == api.pauses


async def test_a_refusal_that_persists_is_said_once_and_backs_off_to_the_maximum() -> None:
    refused: list[list[WatchEvent] | Exception] = [ForbiddenError("HTTP 403 Forbidden") for _ in range(36)]
    api = ScriptedApi(gets=[node("1", a="1")], watches=[*refused, [changed("9", a="2")]])
    with structlog.testing.capture_logs() as logs:
        await run(api, changes=2)
    assert [0.2, 0.4, 0.8] + [1.0] * 27 + [30.0] * 6 == api.pauses
    forbidden = [e for e in logs if e["event"] == "watch_forbidden"]
    assert 1 == len(forbidden)
    assert "RBAC" in forbidden[0]["why"]


async def test_a_refusal_after_a_working_watch_is_about_permissions() -> None:
    """No connection loss before it: a 403 means the agent's permissions changed; said at once."""
    api = ScriptedApi(
        gets=[node("1", a="1")],
        watches=[[changed("5", a="2")], ForbiddenError("HTTP 403"), [changed("6", a="3")]],
    )
    with structlog.testing.capture_logs() as logs:
        await run(api, changes=3)
    assert ["watch_forbidden"] == [e["event"] for e in logs if e["event"].startswith("watch_")]


async def test_a_watch_that_worked_before_it_broke_starts_the_backoff_again() -> None:
    served_then_broken: list[list[WatchEvent] | Exception] = [KubeError("HTTP 500") for _ in range(4)]
    api = ScriptedApi(
        gets=[node("1", a="1")],
        watches=[*served_then_broken, [changed("5", a="2")], KubeError("HTTP 500"), [changed("6", a="3")]],
    )
    await run(api, changes=3)
    assert [0.2, 0.4, 0.8, 1.6, 0.2] == api.pauses


async def test_410s_between_failures_keep_backing_off() -> None:
    """Only the first 410 after a working watch is free: 410s and failures alternating still back off."""
    flaky: list[list[WatchEvent] | Exception] = [GoneError("too old"), KubeError("refused")] * 3
    api = ScriptedApi(gets=[node("1", a="1")], watches=[*flaky, [changed("9", a="2")]])
    await run(api, changes=2)
    assert [0.2, 0.4, 0.8, 1.6, 3.2] == api.pauses


async def test_repeated_failures_back_off_instead_of_spinning() -> None:
    gone = [GoneError("too old") for _ in range(6)]
    api = ScriptedApi(gets=[node("1", a="1")], watches=[*gone, [changed("9", a="2")]])
    await run(api, changes=2)
    assert ["", "", "", "", "", "", "", "9"] == api.watch_versions
    assert [0.2, 0.4, 0.8, 1.6, 3.2] == api.pauses  # the first 410 is normal; the rest wait longer


async def test_a_broken_stream_resumes_from_the_last_version_after_an_outage() -> None:
    api = ScriptedApi(
        gets=[node("1", a="1")],
        watches=[
            [changed("4", a="2")],
            WatchBrokenError("connection reset"),
            UnreachableError("connection refused"),
            [changed("6", a="3")],
        ],
    )
    await run(api, changes=3)
    assert ["", "4", "4", "4", "6"] == api.watch_versions
    assert [0.2, 0.4] == api.pauses


async def test_a_surprise_from_the_client_does_not_end_the_watch() -> None:
    api = ScriptedApi(
        gets=[KubeError("connection refused"), node("1", a="1"), node("2", a="2")],
        watches=[ValueError("a client bug"), [changed("3", a="3")]],  # type: ignore[list-item]
    )
    watched, _ = await run(api, changes=3)
    assert watched.current == node("3", a="3")
    assert ["", ""] == api.watch_versions[:2]
    assert 2 == len(api.pauses)


async def test_until_returns_the_first_version_that_holds_and_none_past_its_deadline() -> None:
    api = ScriptedApi(gets=[node("1", a="1")], watches=[[changed("2", a="1"), changed("3", a="2")]])
    watched = Watched("node/n1", api.get, api.watch, lambda n: n.labels, pause=api.pause)
    watched.start(lambda: None)
    try:
        got = await watched.until(lambda n: n.labels.get("a") == "2", timeout=10)
        assert node("3", a="2") == got
        assert None is await watched.until(lambda n: n.labels.get("a") == "3", timeout=0.05)
    finally:
        watched.stop()
        api.release.set()
