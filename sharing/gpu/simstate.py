"""The simulated GPUs' state file, and the test hooks that change it from outside NVML.

The state is one JSON document, written atomically and locked around every access, so separate
processes (the agent, `sharing sim busy`, a test) and restarts see the same GPUs. `simnvml` reads
and changes it through the pynvml functions; the hooks here do what no NVML call can: create the
GPUs, start and stop work on a device, raise an XID, reset a GPU, lose a GPU and find it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sharing.errors import BackendError
from sharing.gpu.simspec import (
    CUDA_VERSION,
    DRIVER_VERSION,
    SimGpuSpec,
    State,
    gpu_state,
    resolve_product,
    spec_of,
)

__all__ = ["SimGpuSpec", "State", "resolve_product", "spec_of"]

_MAX_EVENTS = 256


def init_state(
    path: Path, gpus: Sequence[SimGpuSpec], *, pending_mode_changes: bool = False, seed: str = "sim"
) -> State:
    """Create (or replace) the state file with idle GPUs, MIG disabled, no instances."""
    state: State = {
        "version": 1,
        "seed": seed,
        "pendingModeChanges": pending_mode_changes,
        "mutations": 0,
        "mutatingCalls": 0,
        "uuidCounter": 0,
        "eventSeq": 0,
        "events": [],
        "driverVersion": DRIVER_VERSION,
        "cudaVersion": CUDA_VERSION,
        "machine": "gpu-sharing simulator",
        "gpus": [
            gpu_state(
                i, "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpu-sharing-sim/{seed}/gpu/{i}")), spec
            )
            for i, spec in enumerate(gpus)
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path, create=True):
        save(path, state)
    return state


def new_mig_uuid(state: State) -> str:
    """A fresh, stable-looking MIG UUID (a recreated instance gets a new one, as on hardware)."""
    state["uuidCounter"] += 1
    return "MIG-" + str(
        uuid.uuid5(uuid.NAMESPACE_URL, f"gpu-sharing-sim/{state['seed']}/mig/{state['uuidCounter']}")
    )


@contextlib.contextmanager
def locked(path: Path, *, create: bool = False) -> Iterator[None]:
    """Hold the state's lock file (a sibling `.lock`) for the duration."""
    if not create and not path.exists():
        raise BackendError(
            f"no simulated GPUs at {path}: create them with "
            f"`sharing sim init --sim-state {path} --gpus A100-SXM4-40GB:2`"
        )
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load(path: Path) -> State:
    """Read the state (call with the lock held)."""
    try:
        state: State = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise BackendError(f"cannot read the simulated GPUs at {path}: {err}") from err
    return state


def save(path: Path, state: State) -> None:
    """Write the state atomically (call with the lock held).

    Atomic against a process that dies (what the crash tests do), without fsync: a simulated
    machine does not lose power. Compact JSON, so the C encoder writes it: the simulator's
    indented dump and two fsyncs per MIG call were most of a simulated reconfiguration's time.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(state, separators=(",", ":")), encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def editing(path: Path) -> Iterator[State]:
    """Lock, load, let the caller change the state, save."""
    with locked(path):
        state = load(path)
        yield state
        save(path, state)


def find_device(state: State, device_uuid: str) -> tuple[State, State | None, State | None]:
    """(gpu, gpu instance, compute instance) for a GPU or MIG UUID; instance parts None for a GPU."""
    for gpu in state["gpus"]:
        if gpu["uuid"] == device_uuid:
            return gpu, None, None
        for gi in gpu["gpuInstances"]:
            for ci in gi["computeInstances"]:
                if ci["uuid"] == device_uuid:
                    return gpu, gi, ci
    raise BackendError(f"no simulated GPU or MIG device has UUID {device_uuid!r} (see `sharing export`)")


def set_busy(path: Path, device_uuid: str, busy: bool) -> None:
    """Start (busy) or stop (idle) work on a GPU or MIG device."""
    with editing(path) as state:
        gpu, _, ci = find_device(state, device_uuid)
        (ci if ci is not None else gpu)["busy"] = busy


def inject_xid(path: Path, device_uuid: str, xid: int) -> None:
    """Raise an XID on a GPU, or on one MIG device (then the event names its GI and CI)."""
    with editing(path) as state:
        gpu, gi, ci = find_device(state, device_uuid)
        state["eventSeq"] += 1
        state["events"].append(
            {
                "seq": state["eventSeq"],
                "gpu": gpu["index"],
                "xid": xid,
                "gi": None if gi is None else gi["id"],
                "ci": None if ci is None else ci["id"],
            }
        )
        del state["events"][:-_MAX_EVENTS]


def reset(path: Path, gpu_uuid: str | None = None) -> list[str]:
    """Reset one GPU or all: pending MIG mode takes effect, every instance is gone. Returns the UUIDs."""
    with editing(path) as state:
        gpus = state["gpus"] if gpu_uuid is None else [find_device(state, gpu_uuid)[0]]
        for gpu in gpus:
            if gpu_busy(gpu):
                raise BackendError(
                    f"GPU {gpu['index']} ({gpu['uuid']}) has processes; a reset needs an idle "
                    f"GPU: stop them first (`sharing sim idle --uuid ...`)"
                )
        for gpu in gpus:
            gpu["migCurrent"] = gpu["migPending"]
            gpu["gpuInstances"] = []
            # The driver reports that no recovery action is needed any more (the GPU is healthy).
            state["eventSeq"] += 1
            state["events"].append({"seq": state["eventSeq"], "gpu": gpu["index"], "recovered": True})
        del state["events"][:-_MAX_EVENTS]
        return [gpu["uuid"] for gpu in gpus]


def set_lost(path: Path, index: int, lost: bool) -> str:
    """Make GPU `index` fail every NVML read as a lost GPU does (GPU_IS_LOST), or recover; its UUID."""
    with editing(path) as state:
        if not 0 <= index < len(state["gpus"]):
            raise BackendError(f"no simulated GPU {index} (the state has {len(state['gpus'])} GPUs)")
        gpu = state["gpus"][index]
        gpu["lost"] = lost
        return str(gpu["uuid"])


def gpu_busy(gpu: State) -> bool:
    """Processes on the GPU itself or on any of its MIG devices."""
    return bool(gpu["busy"]) or any(ci["busy"] for gi in gpu["gpuInstances"] for ci in gi["computeInstances"])


@dataclass(frozen=True, slots=True)
class Counters:
    """How often NVML was asked to change the simulated hardware, and how often it did."""

    mutating_calls: int
    mutations: int


def counters(path: Path) -> Counters:
    """The mutation counters kept in the state file."""
    with locked(path):
        state = load(path)
    return Counters(state["mutatingCalls"], state["mutations"])


def read(path: Path) -> State:
    """A snapshot of the whole state (for tests and `sharing sim`)."""
    with locked(path):
        return load(path)


GATE_TIMEOUT_S = 120.0


def pass_gate() -> None:
    """With SHARING_SIM_GATE=PATH, wait before a hardware change until a test lets it through.

    The process writes `PATH.waiting` and waits for the file `PATH` to appear; it consumes it (one
    change per file) and goes on. Tests use it to look at the node in the middle of a change.
    """
    gate = os.environ.get("SHARING_SIM_GATE")
    if not gate:
        return
    path, waiting = Path(gate), Path(gate + ".waiting")
    waiting.write_text(str(os.getpid()))
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while True:
        try:
            path.unlink()
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)  # another process opens the gate: there is nothing to wait on but the file
    with contextlib.suppress(FileNotFoundError):
        waiting.unlink()
