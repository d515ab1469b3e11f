"""The agent's own files on the node (the journal, the last-good config): read back strictly.

A file this code writes is small; one read back is capped, and one that is not what this code
writes (a directory, a FIFO, a device where the file should be) is moved aside (`<name>.corrupt`,
for a person to look at) rather than half-trusted. Nothing here waits: a FIFO is opened without
blocking (open(2) of a FIFO for reading otherwise waits for a writer, and no signal ends that wait
for the agent) and refused once fstat says what it is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFLNK: "a symbolic link",
}


class NotAFileError(ValueError):
    """The path holds something other than a regular file (what, in words)."""


def open_regular(path: Path, flags: int) -> int:
    """os.open without ever blocking (O_NONBLOCK, cleared again), refusing what is not a regular file.

    NotAFileError names what it is instead; OSError (FileNotFoundError...) as os.open raises it.
    """
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            raise NotAFileError(f"{_KINDS.get(kind, 'not a file')}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: Path, limit: int) -> bytes | None:
    """The file's first `limit + 1` bytes (more than `limit` means: too large), None when missing.

    NotAFileError when the path is not a regular file; OSError for any other failure to read it.
    """
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as src:
        return src.read(limit + 1)


def set_aside(path: Path) -> str:
    """Move a corrupt file to `<name>.corrupt`; says where it went, or that it could not be moved
    (to follow "it": "it was moved to …", "it could not be moved aside (…); remove it by hand")."""
    aside = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, aside)
    except OSError as err:
        return f"could not be moved aside ({err.strerror}); remove it by hand"
    return f"was moved to {aside}"
