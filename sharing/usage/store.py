"""The slices' usage windows on the node's disk, so that a restarted agent keeps its window and idle times.

`usage.json` beside the journal (the chart's state directory), written atomically (a temporary file
renamed over it) and read strictly as the agent's other files are (`sharing.store.files`): a file
that is not what this code writes is moved aside (`usage.json.corrupt`) and the agent starts with
empty windows. The format:

    {"version": 1, "bucketSeconds": 3600, "smBins": 20, "slices": [
      {"namespace": "ml", "pod": "trainer-0", "container": "main", "resource": "nvidia.com/gpu.shared",
       "device": "GPU-...::1", "firstHeld": 1767000000.0, "lastActive": 1767003600.0, "idleSaid": false,
       "buckets": [{"start": 1767002400, "peakBytes": 2147483648, "sm": [0, 0, 3, ...]}]}]}

`lastActive` is null for a slice no process has used since it was held; `idleSaid` is whether its
`SliceIdle` Event was recorded (false when absent); `sm` holds `smBins` counts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sharing.store.files import read_capped, set_aside
from sharing.text import bounded
from sharing.usage.window import BUCKET_SECONDS, SM_BINS, Bucket, History, SliceKey

VERSION = 1
MAX_BYTES = 64 << 20
"""Thousands of slices with a week of buckets each; a larger file is not one this code wrote."""


class WindowFileError(Exception):
    """The file could not be read or was not ours (it was moved aside when it was corrupt)."""


def save(path: Path, histories: Mapping[SliceKey, History]) -> None:
    """Write the windows atomically (raises OSError)."""
    document = {
        "version": VERSION,
        "bucketSeconds": BUCKET_SECONDS,
        "smBins": SM_BINS,
        "slices": [
            {
                "namespace": key.namespace,
                "pod": key.pod,
                "container": key.container,
                "resource": key.resource,
                "device": key.device,
                "firstHeld": history.first_held,
                "lastActive": history.last_active,
                "idleSaid": history.idle_said,
                "buckets": [
                    {"start": b.start, "peakBytes": b.peak_bytes, "sm": list(b.sm)} for b in history.buckets
                ],
            }
            for key, history in sorted(histories.items())
        ],
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, separators=(",", ":")), "utf-8")
    os.replace(tmp, path)


def load(path: Path) -> dict[SliceKey, History]:
    """The windows saved, {} when none were; WindowFileError says why they cannot be used."""
    try:
        raw = read_capped(path, MAX_BYTES)
        if raw is None:
            return {}
        if len(raw) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        return _parse(json.loads(raw.decode("utf-8")))
    except (ValueError, TypeError, KeyError) as err:  # NotAFileError and JSON errors are ValueErrors
        raise WindowFileError(
            f"{path} is not a usage window file ({bounded(str(err), 120)}); it {set_aside(path)}"
        ) from None
    except OSError as err:
        raise WindowFileError(f"cannot read {path}: {err.strerror}") from err


def _parse(document: Any) -> dict[SliceKey, History]:
    if not isinstance(document, dict) or document.get("version") != VERSION:
        raise ValueError(f"not a version {VERSION} document")
    if (document.get("bucketSeconds"), document.get("smBins")) != (BUCKET_SECONDS, SM_BINS):
        raise ValueError(f"buckets of {BUCKET_SECONDS} s with {SM_BINS} SM bins were expected")
    found: dict[SliceKey, History] = {}
    for entry in _list(document, "slices"):
        key = SliceKey(
            *(_text(entry, name) for name in ("namespace", "pod", "container", "resource", "device"))
        )
        last = entry["lastActive"]
        buckets = tuple(
            Bucket(_int(b, "start"), _int(b, "peakBytes"), _counts(b)) for b in _list(entry, "buckets")
        )
        said = entry.get("idleSaid", False)
        if not isinstance(said, bool):
            raise TypeError("idleSaid is not true or false")
        found[key] = History(
            _number(entry["firstHeld"]), None if last is None else _number(last), buckets, said
        )
    return found


def _list(value: Any, key: str) -> list[Any]:
    found = value[key] if isinstance(value, dict) else None
    if not isinstance(found, list):
        raise TypeError(f"{key} is not a list")
    return found


def _text(value: Any, key: str) -> str:
    found = value[key] if isinstance(value, dict) else None
    if not isinstance(found, str):
        raise TypeError(f"{key} is not a string")
    return found


def _int(value: Any, key: str) -> int:
    found = value[key] if isinstance(value, dict) else None
    if isinstance(found, bool) or not isinstance(found, int) or found < 0:
        raise TypeError(f"{key} is not a whole number")
    return found


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a time")
    return float(value)


def _counts(bucket: Any) -> tuple[int, ...]:
    counts = _list(bucket, "sm")
    if len(counts) != SM_BINS or not all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts
    ):
        raise TypeError(f"sm is not {SM_BINS} counts")
    return tuple(counts)
