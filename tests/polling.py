"""Waiting on state that has no change feed (the API seen through kubectl, a node's files)."""

from __future__ import annotations

import time
from collections.abc import Callable
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
