"""structlog set-up: JSON lines in a cluster, readable console output on a terminal.

Event names are short snake_case (`plan_computed`, `plugin_registered`); context goes in key/values.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog


def configure(log_format: str = "auto", level: int = logging.INFO) -> None:
    """Configure structlog once for the process; `auto` picks console on a TTY, JSON otherwise."""
    json_output = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _drop_none,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _Stderr())),
        # Not cached: a cached logger keeps the processors it was first used with, so a later
        # configure (or structlog.testing.capture_logs in a test) would not reach it.
        cache_logger_on_first_use=False,
    )


class _Stderr:
    """Whatever sys.stderr is when a line is written (sys.stderr may be replaced after configure)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _drop_none(logger: object, method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """A key whose value is None says nothing: leave it out of the line."""
    return {k: v for k, v in event.items() if v is not None}
