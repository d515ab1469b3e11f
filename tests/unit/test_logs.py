"""The agent's structlog set-up, as a process that configures it more than once sees it."""

from __future__ import annotations

import structlog
import structlog.testing

from sharing import logs


def test_a_later_configure_reaches_a_logger_used_before() -> None:
    log = structlog.get_logger("test_logs")
    logs.configure("json")
    log.info("before")
    logs.configure("json")  # the CLI configures on every command; tests run several in one process
    with structlog.testing.capture_logs() as captured:
        log.warning("after", gpu=0)
    assert [{"event": "after", "gpu": 0, "log_level": "warning"}] == captured
