"""The fake NVIDIA driver's state file, and the hooks that change it from outside NVML.

The state is one JSON document (its schema: hack/fakedriver/README.md), written atomically under
the lock the fake libnvidia-ml.so.1 takes, so separate processes (the agent, `sharing sim busy`, a
test) and restarts see the same GPUs. The library reads and changes it through the NVML functions;
the hooks here do what no NVML call can: create the GPUs, start and stop processes on a device (what
they use of it), set a GPU's power and temperature, raise an XID, reset a GPU, lose a GPU and find it
again, make NVML calls take time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sharing.errors import BackendError
from sharing.gpu.simspec import (
    SimGpuSpec,
    State,
    gpu_state,
    resolve_product,
    spec_of,
)

__all__ = ["SimGpuSpec", "State", "resolve_product", "spec_of"]

_MAX_EVENTS = 256
PERSONALITIES = ("r580", "r535")
"""The driver branches the fake driver plays (hack/fakedriver/README.md, "Personalities")."""


def init_state(
    path: Path,
    gpus: Sequence[SimGpuSpec],
    *,
    pending_mode_changes: bool = False,
    seed: str = "sim",
    personality: str = "r580",
    unprivileged_processes: bool = False,
) -> State:
    """Create (or replace) the state file with idle GPUs, MIG disabled, no instances.

    The driver and CUDA versions are the personality's (the library's defaults)."""
    if personality not in PERSONALITIES:
        raise BackendError(f"unknown driver personality {personality!r} (one of: {', '.join(PERSONALITIES)})")
    state: State = {
        "version": 1,
        "seed": seed,
        "personality": personality,
        "pendingModeChanges": pending_mode_changes,
        "unprivilegedProcesses": unprivileged_processes,
        "mutations": 0,
        "mutatingCalls": 0,
        "uuidCounter": 0,
        "eventSeq": 0,
        "events": [],
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


@dataclass(frozen=True, slots=True)
class SimProcess:
    """A compute process on a simulated device: what NVML lists and what it says the process uses."""

    pid: int
    used_mib: int = 1
    """Device memory it uses (nvmlProcessInfo_t.usedGpuMemory, in MiB)."""
    sm: int = 0
    """Percent of the device's SMs it keeps busy (nvmlDeviceGetProcessUtilization's smUtil, and GPM)."""

    def state(self) -> State:
        """Its entry in a device's `processes`."""
        return {"pid": self.pid, "usedMiB": self.used_mib, "sm": self.sm}


def default_pid(gpu: State, gi: State | None, ci: State | None) -> int:
    """The PID of a process started without one (`sharing sim busy --uuid U`): one per device."""
    if gi is None or ci is None:
        return 1000 + int(gpu["index"])
    return 2000 + int(gpu["index"]) * 100 + int(gi["id"]) * 10 + int(ci["id"])


def device_memory_mib(gpu: State, gi: State | None) -> int:
    """A GPU's memory, or that of a MIG device's GPU instance (its profile's)."""
    if gi is None:
        return int(gpu["memoryMiB"])
    profiles = (gpu.get("mig") or {}).get("profiles", [])
    return int(next((p["memoryMiB"] for p in profiles if p["id"] == gi["profileId"]), 0))


def start_process(
    path: Path, device_uuid: str, pid: int | None = None, *, used_mib: int = 1, sm: int = 0
) -> SimProcess:
    """Run a process on a GPU or MIG device (or change the one with that PID): the stand-in for a
    CUDA process. Without a PID, the device's own default one (`default_pid`)."""
    if pid is not None and not 0 < pid < 2**32:
        raise BackendError(f"PID {pid}: not a process ID (1 .. 2^32-1)")
    if not 0 <= sm <= 100:
        raise BackendError(f"SM {sm} %: a percentage is 0 .. 100")
    with editing(path) as state:
        gpu, gi, ci = find_device(state, device_uuid)
        device = ci if ci is not None else gpu
        memory = device_memory_mib(gpu, gi)
        if not 0 <= used_mib <= memory:
            raise BackendError(f"{used_mib} MiB: {device_uuid} has {memory} MiB of memory")
        process = SimProcess(default_pid(gpu, gi, ci) if pid is None else pid, used_mib, sm)
        others = [p for p in device.get("processes", []) if p["pid"] != process.pid]
        device["processes"] = [*others, process.state()]
        return process


def stop_processes(path: Path, device_uuid: str, pid: int | None = None) -> int:
    """End the processes of a GPU or MIG device (only `pid`'s when given); how many ended."""
    with editing(path) as state:
        gpu, _, ci = find_device(state, device_uuid)
        device = ci if ci is not None else gpu
        before = device.get("processes", [])
        kept = [p for p in before if pid is not None and p["pid"] != pid]
        ended = len(before) - len(kept)
        device["processes"] = kept
        return ended


def set_busy(path: Path, device_uuid: str, busy: bool) -> None:
    """Start the device's default process (busy) or end all of its processes (idle)."""
    if busy:
        start_process(path, device_uuid)
    else:
        stop_processes(path, device_uuid)


def set_sensors(
    path: Path, gpu_uuid: str, *, power_watts: float | None = None, temperature_c: int | None = None
) -> State:
    """A GPU's power draw and temperature (nvmlDeviceGetPowerUsage, nvmlDeviceGetTemperatureV)."""
    if power_watts is not None and not (math.isfinite(power_watts) and 0 <= power_watts <= 5000):
        raise BackendError(f"{power_watts} W: a GPU's power is 0 .. 5000 W")
    if temperature_c is not None and not -50 <= temperature_c <= 150:
        raise BackendError(f"{temperature_c} °C: a GPU's temperature is -50 .. 150 °C")
    with editing(path) as state:
        gpu, gi, _ = find_device(state, gpu_uuid)
        if gi is not None:
            raise BackendError(f"{gpu_uuid} is a MIG device: power and temperature are its GPU's")
        if power_watts is not None:
            gpu["powerWatts"] = float(power_watts)
        if temperature_c is not None:
            gpu["temperatureC"] = int(temperature_c)
        return gpu


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


REALISTIC_LATENCIES: dict[str, float] = {
    "nvmlDeviceSetMigMode": 1.0,
    "nvmlDeviceCreateGpuInstanceWithPlacement": 0.6,
    "nvmlGpuInstanceCreateComputeInstance": 0.4,
    "nvmlComputeInstanceDestroy": 0.2,
    "nvmlGpuInstanceDestroy": 0.3,
}
"""Seconds per MIG call for `sharing sim latency --realistic`. No per-call timing is published: these
are assumed, so that making one instance takes 1 s and destroying one 0.5 s (hack/fakedriver/README.md,
"Latencies", says what they rest on)."""
_SYMBOL = re.compile(r"^nvml[A-Za-z0-9_]+$")
MAX_LATENCY_S = 60.0


def set_latencies(path: Path, latencies: Mapping[str, float], *, replace: bool = False) -> dict[str, float]:
    """Make the fake driver's calls take time: {exported NVML symbol: seconds} merged into the state's
    `latencies` (all replaced with `replace`; 0 removes one). The latencies in effect."""
    for name, seconds in latencies.items():
        if not _SYMBOL.match(name):
            raise BackendError(f"latency of {name!r}: not an NVML function name (nvml...)")
        if isinstance(seconds, bool) or not (
            isinstance(seconds, int | float) and 0 <= seconds <= MAX_LATENCY_S
        ):
            raise BackendError(
                f"latency of {name}: {seconds!r} is not a number of seconds in 0..{MAX_LATENCY_S:g}"
            )
    with editing(path) as state:
        merged = {} if replace else dict(state.get("latencies", {}))
        merged.update(latencies)
        state["latencies"] = {k: float(v) for k, v in sorted(merged.items()) if v > 0}
        return dict(state["latencies"])


def gpu_busy(gpu: State) -> bool:
    """Processes on the GPU itself or on any of its MIG devices."""
    return bool(gpu.get("processes")) or any(
        ci.get("processes") for gi in gpu["gpuInstances"] for ci in gi["computeInstances"]
    )


@dataclass(frozen=True, slots=True)
class Counters:
    """How often NVML was asked to change the fake hardware, and how often it did."""

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
