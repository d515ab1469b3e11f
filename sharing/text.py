"""Bounded text: what comes from outside (files, requests, the API) is cut before it is logged or sent.

A 200 MB journal line or 10,000 device IDs in one request must not become a 200 MB log line or a
gRPC error larger than the metadata limit. Cuts are marked, and lists say how many were left out.
Durations are written for people the same way everywhere (`duration`). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_LIMIT = 500


def bounded(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def listed(items: Iterable[str], *, most: int = 5, each: int = 80) -> str:
    """A comma-separated list of at most `most` items, each bounded, then "and N more"."""
    shown: list[str] = []
    rest = 0
    for item in items:
        if len(shown) < most:
            shown.append(bounded(item, each))
        else:
            rest += 1
    return ", ".join(shown) + (f" and {rest} more" if rest else "")


def summary(parts: Iterable[str], limit: int, *, unit: str = "more") -> str:
    """Join `parts` with "; " in at most `limit` characters, never cutting one mid-word: "…; and N more"."""
    items = list(parts)
    out: list[str] = []
    for n, part in enumerate(items):
        after = len(items) - n - 1
        reserve = len(f"; and {after} {unit}") if after else 0
        if len("; ".join([*out, part])) + reserve > limit:
            break
        out.append(part)
    else:
        return "; ".join(out)
    left = len(items) - len(out)
    if out:
        return "; ".join(out) + f"; and {left} {unit}"
    tail = f"; and {left - 1} {unit}" if left > 1 else ""
    return _at_word(items[0], limit - len(tail)) + tail


def duration(seconds: float) -> str:
    """`45s`, `12m`, `3h 5m`, `2d 4h`: whole units, for people."""
    total = int(seconds)
    days, hours, minutes = total // 86400, total % 86400 // 3600, total % 3600 // 60
    if days:
        return f"{days}d {hours}h" if hours else f"{days}d"
    if hours:
        return f"{hours}h {minutes}m" if minutes else f"{hours}h"
    return f"{minutes}m" if minutes else f"{total}s"


def _at_word(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[: max(0, limit - 1)].rsplit(" ", 1)[0]
    return cut + "…"
