"""The agent's own files on the node (the journal, the last-good config): read back strictly.

A file this code writes is small; one read back is capped, and one that is not what this code
writes is moved aside (`<name>.corrupt`, for a person to look at) rather than half-trusted.
"""

from __future__ import annotations

import os
from pathlib import Path


def read_capped(path: Path, limit: int) -> bytes | None:
    """The file's first `limit + 1` bytes (more than `limit` means: too large), None when missing.

    OSError for any other failure to read it.
    """
    try:
        with open(path, "rb") as src:
            return src.read(limit + 1)
    except FileNotFoundError:
        return None


def set_aside(path: Path) -> str:
    """Move a corrupt file to `<name>.corrupt`; says where it went (or that it could not be moved)."""
    aside = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, aside)
    except OSError as err:
        return f"could not be moved aside ({err.strerror}); remove it by hand"
    return f"moved to {aside}"
