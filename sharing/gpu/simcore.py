"""The plumbing of the simulated NVML: the state file under its lock, handles, and what a handle names.

Every call reads the state file under its lock; every call that changes the hardware writes it back
and counts in it. `SHARING_SIM_GATE=PATH` holds every hardware change until a test lets it pass
(`simstate.pass_gate`). `SHARING_SIM_CRASH_AFTER=N` kills the process (exit 137) right after its N-th
hardware change, to test crash recovery. A GPU marked lost (`sharing sim lost`) answers every
call about it with GPU_IS_LOST, as a GPU that fell off the bus does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from sharing.gpu import simstate
from sharing.gpu.simspec import State, table_of
from sharing.gpu.simtypes import (
    NVML_DEVICE_MIG_ENABLE,
    NVMLError,
    NVMLError_GpuIsLost,
    NVMLError_InvalidArgument,
    NVMLError_NotFound,
    NVMLError_NotSupported,
    NVMLError_Uninitialized,
)
from sharing.mig import Product, Profile

T = TypeVar("T")

GPU, GI, CI, MIG = 1, 2, 3, 4
"""Handle kinds: a GPU, a GPU instance, a compute instance, a MIG device."""

_process_mutations = 0  # hardware changes made by this process, for SHARING_SIM_CRASH_AFTER
_TABLES_KEPT = 64  # profile tables kept per SimCore (a few per GPU, since each state read makes new ones)


def handle(kind: int, gpu: int, gi: int = 0, ci: int = 0) -> int:
    """An opaque handle (an int here; a ctypes pointer in pynvml)."""
    return kind << 48 | gpu << 24 | gi << 12 | ci


def deref(ref: object) -> object:
    """The object behind a ctypes.byref() argument (or the object itself)."""
    return getattr(ref, "_obj", ref)


def decode(value: object, *kinds: int) -> tuple[int, int, int, int]:
    """(kind, GPU index, GI id, CI id) of a handle; INVALID_ARGUMENT for another kind."""
    raw = getattr(value, "value", value)
    number = raw if isinstance(raw, int) else 0
    kind = number >> 48
    if kind not in kinds:
        raise NVMLError_InvalidArgument()
    return kind, (number >> 24) & 0xFFFFFF, (number >> 12) & 0xFFF, number & 0xFFF


class SimCore:
    """State access and handle resolution shared by every simulated NVML call."""

    def __init__(self, path: Path, *, event_poll_s: float = 0.02) -> None:
        self._path = Path(path)
        self._event_poll_s = event_poll_s
        self._initialised = 0
        self._cached: tuple[tuple[int, int, int] | None, State] = (None, {})
        self._tables: dict[int, tuple[object, Product | None]] = {}

    @contextlib.contextmanager
    def _reading(self) -> Iterator[State]:
        if not self._initialised:
            raise NVMLError_Uninitialized()
        with simstate.locked(self._path):
            # Every write replaces the file (new inode), so an unchanged identity means unchanged
            # content: idle polling costs a stat, not a JSON parse.
            identity = self._identity()
            if identity != self._cached[0]:
                self._cached = (identity, simstate.load(self._path))
            yield self._cached[1]

    def _identity(self) -> tuple[int, int, int]:
        info = os.stat(self._path)
        return (info.st_ino, info.st_mtime_ns, info.st_size)

    def _saved(self, state: State) -> None:
        """Write the state; it is also what the next read sees (no second parse of what we wrote)."""
        simstate.save(self._path, state)
        self._cached = (self._identity(), state)

    def _mutate(self, change: Callable[[State], T]) -> T:
        """Run one hardware-changing call: counted in the state, then maybe the test crash."""
        global _process_mutations  # noqa: PLW0603  (per process, by design of the crash hook)
        if not self._initialised:
            raise NVMLError_Uninitialized()
        simstate.pass_gate()
        with simstate.locked(self._path):
            state = simstate.load(self._path)
            state["mutatingCalls"] += 1
            try:
                result = change(state)
            except NVMLError:
                self._saved(state)
                raise
            state["mutations"] += 1
            self._saved(state)
        _process_mutations += 1
        crash_after = os.environ.get("SHARING_SIM_CRASH_AFTER", "")
        if crash_after.isdigit() and _process_mutations == int(crash_after):
            os._exit(137)
        return result

    @staticmethod
    def _at(state: State, index: int) -> State:
        if index >= len(state["gpus"]):
            raise NVMLError_InvalidArgument()
        gpu: State = state["gpus"][index]
        if gpu.get("lost"):
            raise NVMLError_GpuIsLost()
        return gpu

    def _gpu(self, state: State, device: object) -> State:
        return self._at(state, decode(device, GPU)[1])

    def _gi(self, state: State, gpu_instance: object) -> tuple[State, State]:
        _, index, gi_id, _ = decode(gpu_instance, GI)
        gpu = self._at(state, index)
        for gi in gpu["gpuInstances"]:
            if gi["id"] == gi_id:
                return gpu, gi
        raise NVMLError_InvalidArgument()

    def _ci(self, state: State, ref: object, kind: int) -> tuple[State, State, State]:
        _, index, gi_id, ci_id = decode(ref, kind)
        gpu = self._at(state, index)
        for gi in gpu["gpuInstances"]:
            for ci in gi["computeInstances"]:
                if gi["id"] == gi_id and ci["id"] == ci_id:
                    return gpu, gi, ci
        raise NVMLError_InvalidArgument() if kind == CI else NVMLError_NotFound()

    def _table(self, gpu: State) -> Product:
        """The GPU's MIG profile table; NOT_SUPPORTED on a GPU without MIG.

        Kept per table as read: one read of the state answers many calls, and building the table
        again for each was a third of a simulated reconfiguration's CPU (an agent observing 8 GPUs
        asks for it per MIG device).
        """
        mig = gpu.get("mig")
        cached = self._tables.get(id(mig))
        if cached is not None and cached[0] is mig:  # the same object, kept alive by the cache
            table = cached[1]
        else:
            table = table_of(gpu)
            if len(self._tables) >= _TABLES_KEPT:
                self._tables.clear()
            self._tables[id(mig)] = (mig, table)
        if table is None:
            raise NVMLError_NotSupported()
        return table

    def _enabled_table(self, gpu: State) -> Product:
        table = self._table(gpu)
        if gpu["migCurrent"] != NVML_DEVICE_MIG_ENABLE:
            raise NVMLError_NotSupported()
        return table

    def _gi_profile(self, gpu: State, profile_id: int) -> Profile:
        for p in self._table(gpu).profiles:
            if p.id == profile_id:
                return p
        raise NVMLError_InvalidArgument()
