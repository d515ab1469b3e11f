"""The real node's cgroups (v1): made at ``up`` in every hierarchy, emptied and removed at ``down``.

This machine has cgroup v1 (the unified hierarchy holds no controllers), so the node gets one tree
``/<name>`` in each v1 hierarchy. The kubelet uses it as its ``cgroupRoot`` (pods go below
``kubepods``); the node's own daemons and everything they fork (containerd's shims) go into
``<name>/daemons``. At ``down`` every process still in the tree is killed (shims and containers have
no PID on record) and the directories are removed bottom-up, so nothing is left on the host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def hierarchies(*, unified: bool = False) -> list[Path]:
    """The mounted v1 hierarchies (``cpu``, ``memory``, ``name=systemd``, ...); with ``unified``
    also the (controller-less) v2 one, where runc makes a cgroup per container too."""
    found = []
    for entry in sorted(ROOT.iterdir()):
        if (
            (entry / "cgroup.procs").exists()
            and not entry.is_symlink()
            and (unified or entry.name != "unified")
        ):
            found.append(entry)
    return found


class CgroupTree:
    """``/<name>`` and ``/<name>/daemons`` in every v1 hierarchy."""

    def __init__(self, name: str) -> None:
        self.name = name

    def create(self) -> None:
        for hierarchy in hierarchies():
            for rel in (self.name, f"{self.name}/daemons"):
                path = hierarchy / rel
                path.mkdir(exist_ok=True)
                if hierarchy.name == "cpuset":  # an empty cpuset cannot hold processes
                    for knob in ("cpuset.cpus", "cpuset.mems"):
                        (path / knob).write_text((path.parent / knob).read_text())

    def daemon_procs(self) -> tuple[Path, ...]:
        """The ``cgroup.procs`` files a daemon writes its PID to (see ``Process``)."""
        return tuple(h / self.name / "daemons" / "cgroup.procs" for h in hierarchies())

    def pids(self) -> set[int]:
        """Every process in the tree, in any hierarchy."""
        found: set[int] = set()
        for hierarchy in hierarchies(unified=True):
            top = hierarchy / self.name
            if not top.exists():
                continue
            for procs in top.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in procs.read_text().split())
        return found

    def kill_all(self, timeout: float = 10.0) -> int:
        """SIGKILL every process in the tree until it is empty; return how many were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while pids := self.pids() - {os.getpid()}:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return len(killed)

    def remove(self) -> list[Path]:
        """Remove the tree bottom-up in every hierarchy; return what could not be removed."""
        left = []
        for hierarchy in hierarchies(unified=True):
            top = hierarchy / self.name
            if not top.exists():
                continue
            dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            for path in [*dirs, top]:
                try:
                    path.rmdir()
                except OSError:
                    left.append(path)
        return left

    def exists(self) -> bool:
        return any((h / self.name).exists() for h in hierarchies(unified=True))
