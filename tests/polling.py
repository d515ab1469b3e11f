"""Waiting on state that has no change feed (the API seen through kubectl, a node's files, /proc)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.deadlines import scaled


def poll(what: str, read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float = 60) -> Any:
    """Read until `ok(value)` and return that value; a deadline, not a sleep, bounds it (`timeout`
    is for an idle machine, stretched by `lab.deadlines`)."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while True:
        began = time.monotonic()
        value = read()
        took = time.monotonic() - began
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s; last: {value}")
        # Between reads, twice what the last read took: a read through kubectl costs about 0.1 CPU-s,
        # and reading back to back would keep a core busy that the processes under test need.
        time.sleep(max(0.1, 2 * took))


async def until(what: str, ok: Callable[[], bool], timeout: float = 10) -> None:
    """Look until `ok()` on the event loop (state without a change feed, polled between the loop's other
    work); a deadline stretched by `lab.deadlines`, never a fixed sleep, bounds it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout)
    while not ok():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not reached within {scaled(timeout)} s")
        await asyncio.sleep(0.02)  # yielding to the agent's loop


def process(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent PID (/proc/PID/stat); None once it has been waited for
    (a zombie keeps its entry until then)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[0], int(fields[1])


def live_parent(pid: int) -> int | None:
    """The parent PID of a live process (running or asleep: which, depends on the scheduler, most of
    all on a busy machine); None when it is a zombie or gone."""
    found = process(pid)
    return None if found is None or found[0] in ("Z", "X") else found[1]
