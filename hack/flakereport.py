"""A pytest plugin of the flake hunt (hack/flakes.py): each test's outcome as a JSON line, with the
report and what the test printed and logged when it failed, written by the process that collects
the reports (the controller when the run is spread over workers) to `$SHARING_FLAKES_REPORT`."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_path: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _path  # noqa: PLW0603
    worker = hasattr(config, "workerinput")  # pytest-xdist's workers send their reports to the controller
    _path = None if worker else os.environ.get("SHARING_FLAKES_REPORT")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _path is None or not (report.failed or report.when == "call"):
        return
    line: dict[str, Any] = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        last = report.longreprtext.strip().splitlines()[-1:] or [""]
        line["message"] = str(getattr(crash, "message", "") or last[0])
        line["text"] = report.longreprtext + "".join(
            f"\n\n--- {name}\n{content}" for name, content in report.sections
        )
    with open(_path, "a") as sink:
        sink.write(json.dumps(line) + "\n")
