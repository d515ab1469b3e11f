"""The watch loop against a scripted API: resume after a disconnect, relist after 410, back off.

An in-memory fake is fine here (unit test); the e2e tests restart a real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from sharing.errors import KubeError
from sharing.kube import GoneError, NodeObject, WatchEvent
from sharing.watch import Watched


def node(version: str, **labels: str) -> NodeObject:
    return NodeObject("n1", "uid", version, labels)


class ScriptedApi:
    """Answers gets and watches from scripts; records the resource versions watches started at."""

    def __init__(
        self, gets: list[NodeObject | Exception], watches: list[list[WatchEvent] | Exception]
    ) -> None:
        self.gets = gets
        self.watches = watches
        self.watch_versions: list[str] = []
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


async def run(api: ScriptedApi, changes: int) -> tuple[Watched[NodeObject], int]:
    seen = 0
    enough = asyncio.Event()

    def changed() -> None:
        nonlocal seen
        seen += 1
        if seen >= changes:
            enough.set()

    watched = Watched("node/n1", api.get, api.watch, lambda n: n.labels, backoff_max_s=0.01)
    watched.start(changed)
    await asyncio.wait_for(enough.wait(), 10)
    await asyncio.to_thread(api.done.wait, 10)
    watched.stop()
    api.release.set()
    return watched, seen


async def test_resumes_from_the_last_version_and_triggers_only_on_label_changes() -> None:
    api = ScriptedApi(
        gets=[node("1", a="1")],
        watches=[
            [WatchEvent("MODIFIED", node("2", a="1")), WatchEvent("MODIFIED", node("3", a="2"))],
            [WatchEvent("MODIFIED", node("4", a="3"))],
        ],
    )
    watched, seen = await run(api, changes=3)
    assert ["1", "3", "4"] == api.watch_versions
    assert 3 == seen  # the first read, then a=2, a=3; the status-only change at version 2 is not news
    assert watched.current == node("4", a="3")


async def test_lists_again_after_410_gone_and_after_an_outage() -> None:
    api = ScriptedApi(
        gets=[node("1", a="1"), node("7", a="2"), KubeError("connection refused"), node("9", a="3")],
        watches=[GoneError("too old"), KubeError("stream broken")],
    )
    watched, _ = await run(api, changes=3)
    assert ["1", "7", "9"] == api.watch_versions
    assert watched.current == node("9", a="3")
