"""The config last applied, kept on disk beside the journal, for a start without the API server.

An agent that restarts while the API server is out of reach still advertises what its last applied
config gives. The file is read strictly: anything else (wrong JSON shape, wrong types, junk) is
moved aside (`<name>.corrupt`) and reported, and the agent starts from "GPUs as they are".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharing.store.files import read_capped, set_aside
from sharing.text import bounded

MAX_BYTES = 4 << 20
"""Two ConfigMaps of at most 1 MiB each, with room for JSON escaping."""


@dataclass(frozen=True, slots=True)
class Remembered:
    """The name of the config last applied (None: none applied) and the configs it came from."""

    config: str | None
    configs: Mapping[str, str]
    """The user's ConfigMap data."""
    presets: Mapping[str, str]
    """The presets ConfigMap data."""


class LastGoodError(Exception):
    """The file could not be read or was not ours; it was moved aside when it was corrupt."""


class LastGood:
    """The last-good file; writes are atomic (temp file + rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: Remembered | None = None

    def save(self, remembered: Remembered) -> None:
        """Write it, unless it is what was written last (raises OSError)."""
        if remembered == self._written:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(
            json.dumps(
                {
                    "config": remembered.config,
                    "configmap": dict(remembered.configs),
                    "presets": dict(remembered.presets),
                }
            ),
            "utf-8",
        )
        os.replace(tmp, self.path)
        self._written = remembered

    def load(self) -> Remembered | None:
        """What was saved, None when nothing was; LastGoodError says why it cannot be used."""
        try:
            raw = read_capped(self.path, MAX_BYTES)
            if raw is None:
                return None
            return _parse(raw)
        except (ValueError, TypeError) as err:  # NotAFileError too
            why = bounded(str(err), 120)
            raise LastGoodError(
                f"{self.path} is not a last-good file ({why}); it {set_aside(self.path)}"
            ) from None
        except OSError as err:
            raise LastGoodError(f"cannot read {self.path}: {err.strerror}") from err


def _parse(raw: bytes) -> Remembered:
    if len(raw) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    value: Any = json.loads(raw.decode("utf-8"))
    if not isinstance(value, dict):
        raise TypeError("not a JSON object")
    name = value.get("config")
    if name is not None and not isinstance(name, str):
        raise TypeError("config is not a string")
    return Remembered(name, _texts(value, "configmap"), _texts(value, "presets"))


def _texts(value: dict[str, Any], key: str) -> dict[str, str]:
    texts = value.get(key, {})
    if not isinstance(texts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in texts.items()
    ):
        raise TypeError(f"{key} is not a mapping of names to texts")
    return texts
