"""Strict typed reads of YAML values, each reporting a path-named problem instead of raising.

Shared by the native reader and the importers of NVIDIA's formats. A boolean is never an integer,
an unknown key is an error with a "did you mean", and every problem is reported, not just the first.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

from sharing.config.document import describe, short_int
from sharing.config.problems import Report, key

_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def fields(
    report: Report, path: str, value: object, *, required: Sequence[str] = (), optional: Sequence[str] = ()
) -> dict[str, Any] | None:
    """The known keys of a mapping; unknown keys, non-string keys and missing keys are reported."""
    if not isinstance(value, dict):
        report.error(path, f"expected a mapping, got {describe(value)}")
        return None
    allowed = [*required, *optional]
    found: dict[str, Any] = {}
    for name, child in value.items():
        if not isinstance(name, str):
            report.error(path, f"key {describe(name)} is not a string; expected one of {', '.join(allowed)}")
        elif name not in allowed:
            hint = difflib.get_close_matches(name, allowed, n=1)
            did_you_mean = f"did you mean {hint[0]!r}? " if hint else ""
            report.error(key(path, name), f"unknown key; {did_you_mean}expected one of {', '.join(allowed)}")
        else:
            found[name] = child
    for name in required:
        if name not in value:
            report.error(key(path, name), "required key is missing")
    return found


def integer(report: Report, path: str, value: object, *, low: int, high: int | None = None) -> int | None:
    """An int in [low, high]; booleans, floats and strings are type errors."""
    if isinstance(value, bool) or not isinstance(value, int):
        report.error(path, f"expected an integer, got {describe(value)}")
        return None
    if value < low:
        report.error(path, f"must be at least {low}, got {short_int(value)}")
        return None
    if high is not None and value > high:
        report.error(path, f"must be at most {high}, got {short_int(value)}")
        return None
    return value


def boolean(report: Report, path: str, value: object) -> bool | None:
    """true or false; `yes`, 1 and "true" are type errors."""
    if not isinstance(value, bool):
        report.error(path, f"expected true or false, got {describe(value)}")
        return None
    return value


def string(report: Report, path: str, value: object) -> str | None:
    """A non-empty string."""
    if not isinstance(value, str):
        report.error(path, f"expected a string, got {describe(value)}")
        return None
    if not value.strip():
        report.error(path, "must not be empty")
        return None
    return value


def choice(report: Report, path: str, value: object, choices: Sequence[str]) -> str | None:
    """One of the given words."""
    if not isinstance(value, str) or value not in choices:
        report.error(path, f"expected one of {', '.join(choices)}, got {describe(value)}")
        return None
    return value


def resource_name(report: Report, path: str, value: object) -> str | None:
    """An extended resource name; `nvidia.com/` is added when there is no domain (as NVIDIA does)."""
    name = string(report, path, value)
    if name is None:
        return None
    full = name if "/" in name else f"nvidia.com/{name}"
    domain, _, short = full.partition("/")
    if len(full) > 63 or not _RESOURCE.match(domain) or not _RESOURCE.match(short):
        report.error(
            path,
            f"{name!r} is not a valid resource name "
            "(DOMAIN/NAME, lower-case DNS labels, at most 63 characters)",
        )
        return None
    return full
