"""Waiting on state that has no change feed (the API seen through kubectl, a node's files, /proc)."""

from __future__ import annotations

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
    value = read()
    while not ok(value):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s; last: {value}")
        time.sleep(0.1)
        value = read()
    return value


def process(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent PID (/proc/PID/stat); None once it has been waited for
    (a zombie keeps its entry until then)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[0], int(fields[1])
