"""The applier's write-ahead journal: every hardware step is on disk before it runs.

One JSON object per line, each line fsynced: `begin` (the target of every GPU the run changes),
then `step` (before the call) and `done` (after it) for each step, and the file is removed when the
run ends. A journal still present at start-up belongs to a run that crashed: its targets tell the
applier which GPUs were mid-change and what they were changing to, so it can roll them forward
even when the config no longer mentions them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharing.change import Target
from sharing.errors import SharingError
from sharing.model import GpuUuid

DEFAULT_PATH = Path("/var/lib/gpu-sharing/journal.jsonl")
"""Where the agent and `sharing apply` keep the journal (a host path in the DaemonSet)."""


class JournalError(SharingError):
    """The journal cannot be read or written; no hardware step runs without its journal entry."""


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

    def unfinished(self) -> Unfinished | None:
        """The crashed run's targets, or None when the last run finished."""
        try:
            lines = self.path.read_text("utf-8").splitlines()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise JournalError(f"cannot read the apply journal {self.path}: {err.strerror}") from err
        targets: dict[GpuUuid, Target] = {}
        running: dict[int, str] = {}
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line torn by the crash: the step it announced never started
            if entry.get("event") == "begin":
                for uuid, target in entry["targets"].items():
                    targets[GpuUuid(uuid)] = Target(
                        bool(target["mig"]), tuple((p, int(n)) for p, n in target["instances"])
                    )
            elif entry.get("event") == "step":
                running[entry["n"]] = f"{entry['gpu']}: {entry['step']}"
            elif entry.get("event") == "done":
                running.pop(entry["n"], None)
        return Unfinished(targets, next(iter(running.values()), None))

    def begin(self, targets: dict[GpuUuid, Target]) -> None:
        """Start a run (replacing any crashed one, whose targets the caller has folded in)."""
        self._steps = 0
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._begin(tmp, targets)
        except OSError as err:
            raise self._unwritable(err) from err

    def _begin(self, tmp: Path, targets: dict[GpuUuid, Target]) -> None:
        with open(tmp, "w", encoding="utf-8") as out:
            self._write(
                out,
                {
                    "event": "begin",
                    "targets": {
                        uuid: {"mig": t.mig_enabled, "instances": [list(i) for i in t.instances]}
                        for uuid, t in targets.items()
                    },
                },
            )
        os.replace(tmp, self.path)  # a crash here leaves the old journal or the new one, never neither
        _fsync_dir(self.path.parent)

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
        _fsync_dir(self.path.parent)

    def _append(self, entry: dict[str, Any]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as out:
                self._write(out, entry)
        except OSError as err:
            raise self._unwritable(err) from err

    def _unwritable(self, err: OSError) -> JournalError:
        return JournalError(
            f"cannot write the apply journal {self.path}: {err.strerror}; "
            "pass --journal PATH (or SHARING_JOURNAL) on a writable disk"
        )

    @staticmethod
    def _write(out: Any, entry: dict[str, Any]) -> None:
        out.write(json.dumps(entry, separators=(",", ":")) + "\n")
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
