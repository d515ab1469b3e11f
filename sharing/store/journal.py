"""The applier's write-ahead journal: every hardware step is on disk before it runs.

One JSON object per line, each line fsynced: `begin` (the target of every GPU the run changes),
then `step` (before the call) and `done` (after it) for each step, and the file is removed when the
run ends. A journal still present at start-up belongs to a run that crashed: its targets tell the
applier which GPUs were mid-change and what they were changing to, so it can roll them forward
even when the config no longer mentions them.

The file is read strictly, entry by entry: anything this code never writes (binary junk, a line that
is not an object, a missing key, a wrong type, a file far larger than any run writes) is corruption.
A corrupt journal is moved aside (`<name>.corrupt`) and reported, never half-trusted; only a last
line torn by a crash mid-write is expected and skipped. One lock file beside the journal keeps the
agent and `sharing apply` from running hardware steps at the same time; another (`<name>.agent`),
which the agent holds shared for its whole life, tells `sharing apply` that an agent serves the
node (flock(2) locks go with the open file and end when the process does, however it ends).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from sharing.errors import SharingError
from sharing.mig import Target
from sharing.model import GpuUuid
from sharing.store.files import NotAFileError, open_regular, read_capped, set_aside
from sharing.text import bounded

DEFAULT_PATH = Path("/var/lib/gpu-sharing/store/journal.jsonl")
"""Where the agent and `sharing apply` keep the journal (a host path in the DaemonSet)."""

MAX_BYTES = 1 << 20
"""A run writes a few hundred short lines; a bigger file was not written by this code."""


class JournalError(SharingError):
    """The journal cannot be read or written; no hardware step runs without its journal entry."""


class JournalCorruptError(JournalError):
    """The journal holds what this code never writes; it was moved aside and nothing was resumed."""


class JournalLockedError(JournalError):
    """Another process (the agent, or `sharing apply`) is running hardware steps right now."""


class AgentServingError(JournalLockedError):
    """An agent serves this node: `sharing apply` would change GPUs under devices it advertises."""


@dataclass(frozen=True, slots=True)
class Unfinished:
    """What a crashed run left: its targets and the step that was running, if any."""

    targets: dict[GpuUuid, Target]
    in_flight: str | None


class Journal:
    """A journal file; `path` need not exist."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._steps = 0

    @property
    def lock_path(self) -> Path:
        """The lock file the agent and `sharing apply` share."""
        return self.path.with_name(self.path.name + ".lock")

    @property
    def agent_path(self) -> Path:
        """The file an agent holds (shared) for as long as it serves the node."""
        return self.path.with_name(self.path.name + ".agent")

    @property
    def owner_path(self) -> Path:
        """The file the agent that owns the node holds (exclusive) for as long as it runs."""
        return self.path.with_name(self.path.name + ".owner")

    def try_own(self) -> contextlib.AbstractContextManager[None] | None:
        """Own the node if no other agent does: a context that holds the owner's file exclusively
        (our PID in it) until it exits, or None while another process holds it (a rolling update's
        old pod, until it stops). JournalError when the file cannot be opened."""
        out = self._open_lock(self.owner_path)
        try:
            fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out.close()
            return None

        @contextlib.contextmanager
        def owned() -> Iterator[None]:
            with out, _holding(out):
                yield

        return owned()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Hold the agent's file for the agent's life (JournalError when it cannot be opened)."""
        out = self._open_lock(self.agent_path)
        with out:
            fcntl.flock(out, fcntl.LOCK_SH)  # only ever held exclusively for an instant (refuse_agent)
            with _holding(out):
                yield

    def refuse_agent(self) -> None:
        """AgentServingError when an agent serves this node (for `sharing apply`)."""
        if not self.agent_path.exists():
            return
        with self._open_lock(self.agent_path) as out:
            try:
                fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = bounded(out.read(32).strip(), 32) or "unknown"
                raise AgentServingError(
                    f"the agent (pid {holder}) serves this node (it holds {self.agent_path}): it still "
                    "advertises the devices a change would destroy, and it puts its own config back; "
                    "edit the node's config in the ConfigMap (or the node's label) instead"
                ) from None
            fcntl.flock(out, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the journal's lock for a run; JournalLockedError names the holder when it is taken."""
        out = self._open_lock(self.lock_path)
        with out:
            try:
                fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                out.seek(0)
                holder = bounded(out.read(32).strip(), 32) or "unknown"
                raise JournalLockedError(
                    f"another process (pid {holder}) is changing the GPUs with the journal {self.path}; "
                    "wait for it to finish"
                ) from None
            with _holding(out):
                yield

    def unfinished(self) -> Unfinished | None:
        """The crashed run's targets, or None when the last run finished.

        Raises JournalCorruptError (after moving the file aside) when it is not a journal.
        """
        try:
            raw = read_capped(self.path, MAX_BYTES)
            if raw is None:
                return None
            return _parse(raw)
        except (_Corrupt, NotAFileError) as err:
            raise JournalCorruptError(
                f"the apply journal {self.path} is corrupt ({err}); it {set_aside(self.path)}; no "
                "interrupted change was resumed: GPUs are planned from what they really are"
            ) from None
        except OSError as err:
            raise JournalError(f"cannot read the apply journal {self.path}: {err.strerror}") from err

    def begin(self, targets: dict[GpuUuid, Target]) -> None:
        """Start a run (replacing any crashed one, whose targets the caller has folded in)."""
        self._steps = 0
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as out:
                self._write(
                    out, {"event": "begin", "targets": {u: _target_json(t) for u, t in targets.items()}}
                )
            os.replace(tmp, self.path)  # a crash here leaves the old journal or the new one, never neither
            _fsync_dir(self.path.parent)
        except OSError as err:
            raise self._unwritable(err, f"the apply journal {self.path}") from err

    def step(self, gpu: GpuUuid, step: str) -> int:
        """Record a step before running it; returns its number for done()."""
        self._steps += 1
        self._append({"event": "step", "n": self._steps, "gpu": gpu, "step": step})
        return self._steps

    def done(self, n: int) -> None:
        """Record that step `n` completed (or failed cleanly)."""
        self._append({"event": "done", "n": n})

    def finish(self) -> None:
        """The run ended: nothing to resume."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        except OSError as err:
            raise self._unwritable(err, f"the apply journal {self.path}") from err
        _fsync_dir(self.path.parent)

    def _open_lock(self, path: Path) -> TextIO:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return open(open_regular(path, os.O_RDWR | os.O_CREAT), "r+", encoding="utf-8")
        except NotAFileError as err:
            raise JournalError(
                f"the apply journal's lock file {path} is {err}; remove it (no hardware step runs "
                "without the lock)"
            ) from None
        except OSError as err:
            raise self._unwritable(err, f"the apply journal's lock file {path}") from err

    def _append(self, entry: dict[str, Any]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as out:
                self._write(out, entry)
        except OSError as err:
            raise self._unwritable(err, f"the apply journal {self.path}") from err

    @staticmethod
    def _unwritable(err: OSError, what: str) -> JournalError:
        return JournalError(
            f"cannot write {what}: {err.strerror}; "
            "pass --journal PATH (or SHARING_JOURNAL) on a writable disk"
        )

    @staticmethod
    def _write(out: TextIO, entry: dict[str, Any]) -> None:
        out.write(json.dumps(entry, separators=(",", ":")) + "\n")
        out.flush()
        os.fsync(out.fileno())


class _Corrupt(Exception):
    pass


def _parse(raw: bytes) -> Unfinished:
    if len(raw) > MAX_BYTES:
        raise _Corrupt(f"larger than {MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _Corrupt(f"not UTF-8 text at byte {err.start}") from None
    lines = text.split("\n")
    torn = lines.pop()  # after the last newline: empty, or a line a crash tore mid-write
    if torn and not lines:
        raise _Corrupt("line 1: not a journal entry")
    targets: dict[GpuUuid, Target] = {}
    running: dict[int, str] = {}
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            kind = entry["event"]
            if kind == "begin":
                if number != 1:
                    raise _Corrupt(f"line {number}: a second begin")
                targets = {GpuUuid(_str(uuid)): _target(t) for uuid, t in _dict(entry["targets"]).items()}
            elif kind == "step":
                running[_int(entry["n"])] = f"{_str(entry['gpu'])}: {_str(entry['step'])}"
            elif kind == "done":
                running.pop(_int(entry["n"]), None)
            else:
                raise _Corrupt(f"line {number}: unknown event {bounded(str(kind), 40)!r}")
        except _Corrupt:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise _Corrupt(
                f"line {number}: not a journal entry ({bounded(type(err).__name__, 40)})"
            ) from None
        if number == 1 and kind != "begin":
            raise _Corrupt("line 1: the run's begin entry is missing")
    return Unfinished(targets, next(iter(running.values()), None))


def _target_json(target: Target) -> dict[str, Any]:
    found: dict[str, Any] = {"mig": target.mig_enabled, "instances": [list(i) for i in target.instances]}
    if target.dynamic:  # a crashed run's dynamic GPU stays dynamic: its instances are the claims'
        found["dynamic"] = True
    return found


def _target(value: Any) -> Target:
    value = _dict(value)
    instances = value["instances"]
    if not isinstance(instances, list):
        raise TypeError("instances")
    pairs = []
    for item in instances:
        if not isinstance(item, list) or len(item) != 2:
            raise TypeError("instance")
        pairs.append((_str(item[0]), _int(item[1])))
    mig = value["mig"]
    dynamic = value.get("dynamic", False)
    if not isinstance(mig, bool) or not isinstance(dynamic, bool):
        raise TypeError("mig")
    return Target(mig, tuple(pairs), dynamic=dynamic)


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("object")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 200:
        raise TypeError("string")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError("integer")
    return value


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _holding(out: TextIO) -> Iterator[None]:
    """While a lock on `out` is held: our PID in it (what a refused process names), then unlocked."""
    out.seek(0)
    out.truncate()
    out.write(str(os.getpid()))
    out.flush()
    try:
        yield
    finally:
        fcntl.flock(out, fcntl.LOCK_UN)
