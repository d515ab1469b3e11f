"""A simulated NVML: the pynvml functions, constants, structs and errors the NVML backend uses.

`NvmlBackend` runs unchanged over `SimNvml(path)` instead of the `pynvml` module, so tests and demos
exercise the real backend code. The simulator enforces the hardware catalog's rules the way the
driver does: valid placements only, no overlap and per-profile maximums (INSUFFICIENT_RESOURCES),
MIG mode pending until a reset (at once on an idle bare-metal GPU unless the state asks for
VM-like behaviour), IN_USE for busy devices and for a GPU instance that still has compute
instances, NOT_SUPPORTED on GPUs without MIG, caller-allocated arrays, sparse MIG device indices,
a ctypes value from nvmlDeviceIsMigDeviceHandle, and activation status from nvmlDeviceSetMigMode.

Every call reads the state file under its lock; every call that changes the hardware writes it
back and counts in it. `SHARING_SIM_GATE=PATH` holds every hardware change until a test lets it
pass (see `simstate.pass_gate`). `SHARING_SIM_CRASH_AFTER=N` kills the process (exit 137) right after its
N-th hardware change, to test crash recovery.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from sharing.catalog import Catalog, Product, default_catalog
from sharing.gpu import simstate, simtypes
from sharing.gpu.simstate import State
from sharing.gpu.simtypes import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_RESET_REQUIRED,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
    NVML_GPU_RECOVERY_ACTION_NONE,
    NVML_SUCCESS,
    NVML_VALUE_NOT_AVAILABLE_uint,
    NVMLError,
    NVMLError_InsufficientResources,
    NVMLError_InsufficientSize,
    NVMLError_InUse,
    NVMLError_InvalidArgument,
    NVMLError_NotFound,
    NVMLError_NotSupported,
    NVMLError_Timeout,
    NVMLError_Uninitialized,
    RunningProcess,
    c_nvmlComputeInstanceInfo_t,
    c_nvmlComputeInstancePlacement_t,
    c_nvmlComputeInstanceProfileInfo_v2_t,
    c_nvmlEventData_t,
    c_nvmlGpuInstanceInfo_t,
    c_nvmlGpuInstancePlacement_t,
    c_nvmlGpuInstanceProfileInfo_v2_t,
    c_nvmlMemory_t,
    nvmlEventTypeGpuRecoveryAction,
    nvmlEventTypeXidCriticalError,
)

T = TypeVar("T")

_GPU, _GI, _CI, _MIG = 1, 2, 3, 4  # handle kinds
# Compute-instance profile enum -> compute slices (REV1 and NVL variants are not simulated).
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


_process_mutations = 0  # hardware changes made by this process, for SHARING_SIM_CRASH_AFTER


def _handle(kind: int, gpu: int, gi: int = 0, ci: int = 0) -> int:
    return kind << 48 | gpu << 24 | gi << 12 | ci


def _deref(ref: Any) -> Any:
    """The object behind a ctypes.byref() argument (or the object itself)."""
    return getattr(ref, "_obj", ref)


class SimNvml:
    """The simulated NVML library over one state file; attribute names are pynvml's."""

    def __getattr__(self, name: str) -> Any:
        """pynvml's constants, errors and structs, as the module has them."""
        try:
            return getattr(simtypes, name)
        except AttributeError:
            raise AttributeError(f"the simulated NVML has no {name!r}") from None

    def __init__(self, path: Path, catalog: Catalog | None = None, *, event_poll_s: float = 0.02) -> None:
        self._path = Path(path)
        self._catalog = catalog or default_catalog()
        self._event_poll_s = event_poll_s
        self._initialised = 0
        self._event_sets: dict[int, dict[int, int]] = {}  # set -> {gpu index: event mask}
        self._event_cursors: dict[int, int] = {}  # set -> last event seen
        self._first_event = 0
        self._cached: tuple[tuple[int, int, int] | None, State] = (None, {})

    # ---- plumbing ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _reading(self) -> Iterator[State]:
        if not self._initialised:
            raise NVMLError_Uninitialized()
        with simstate.locked(self._path):
            # Every write replaces the file (new inode), so an unchanged identity means unchanged
            # content: idle polling costs a stat, not a JSON parse.
            info = os.stat(self._path)
            identity = (info.st_ino, info.st_mtime_ns, info.st_size)
            if identity != self._cached[0]:
                self._cached = (identity, simstate.load(self._path))
            yield self._cached[1]

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
                simstate.save(self._path, state)
                raise
            state["mutations"] += 1
            simstate.save(self._path, state)
        _process_mutations += 1
        crash_after = os.environ.get("SHARING_SIM_CRASH_AFTER", "")
        if crash_after.isdigit() and _process_mutations == int(crash_after):
            os._exit(137)
        return result

    def _product(self, gpu: State) -> Product | None:
        return self._catalog.find(gpu["product"]) if gpu["migCapable"] else None

    @staticmethod
    def _decode(handle: Any, *kinds: int) -> tuple[int, int, int, int]:
        value = int(getattr(handle, "value", handle) or 0)
        kind = value >> 48
        if kind not in kinds:
            raise NVMLError_InvalidArgument()
        return kind, (value >> 24) & 0xFFFFFF, (value >> 12) & 0xFFF, value & 0xFFF

    def _gpu(self, state: State, handle: Any) -> State:
        _, index, _, _ = self._decode(handle, _GPU)
        if index >= len(state["gpus"]):
            raise NVMLError_InvalidArgument()
        gpu: State = state["gpus"][index]
        return gpu

    def _gi(self, state: State, handle: Any) -> tuple[State, State]:
        _, index, gi_id, _ = self._decode(handle, _GI)
        gpu = state["gpus"][index]
        for gi in gpu["gpuInstances"]:
            if gi["id"] == gi_id:
                return gpu, gi
        raise NVMLError_InvalidArgument()

    def _ci(self, state: State, handle: Any, kind: int) -> tuple[State, State, State]:
        _, index, gi_id, ci_id = self._decode(handle, kind)
        gpu = state["gpus"][index]
        for gi in gpu["gpuInstances"]:
            for ci in gi["computeInstances"]:
                if gi["id"] == gi_id and ci["id"] == ci_id:
                    return gpu, gi, ci
        raise NVMLError_InvalidArgument() if kind == _CI else NVMLError_NotFound()

    def _mig_product(self, gpu: State) -> Product:
        product = self._product(gpu)
        if product is None:
            raise NVMLError_NotSupported()
        return product

    def _enabled_product(self, gpu: State) -> Product:
        product = self._mig_product(gpu)
        if gpu["migCurrent"] != NVML_DEVICE_MIG_ENABLE:
            raise NVMLError_NotSupported()
        return product

    # ---- library and devices -----------------------------------------------------------------

    def nvmlInit(self) -> None:
        with simstate.locked(self._path):
            state = simstate.load(self._path)
        if not self._initialised:
            # Events raised before this process loaded NVML are not delivered to it.
            self._first_event = state["eventSeq"]
        self._initialised += 1

    def nvmlShutdown(self) -> None:
        if not self._initialised:
            raise NVMLError_Uninitialized()
        self._initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        with self._reading() as state:
            return len(state["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        with self._reading() as state:
            if not 0 <= index < len(state["gpus"]):
                raise NVMLError_InvalidArgument()
            return _handle(_GPU, index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> int:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        with self._reading() as state:
            for gpu in state["gpus"]:
                if gpu["uuid"] == text:
                    return _handle(_GPU, gpu["index"])
                for gi in gpu["gpuInstances"]:
                    for ci in gi["computeInstances"]:
                        if ci["uuid"] == text:
                            return _handle(_MIG, gpu["index"], gi["id"], ci["id"])
        raise NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        with self._reading() as state:
            if self._decode(handle, _GPU, _MIG)[0] == _MIG:
                return str(self._ci(state, handle, _MIG)[2]["uuid"])
            return str(self._gpu(state, handle)["uuid"])

    def nvmlDeviceGetName(self, handle: Any) -> str:
        with self._reading() as state:
            if self._decode(handle, _GPU, _MIG)[0] == _MIG:
                gpu, gi, _ = self._ci(state, handle, _MIG)
                profile = next(p for p in self._mig_product(gpu).profiles if p.id == gi["profileId"])
                return f"{gpu['name']} MIG {profile.name}"
            return str(self._gpu(state, handle)["name"])

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> c_nvmlMemory_t:
        with self._reading() as state:
            total = self._gpu(state, handle)["memoryMiB"] * 1024 * 1024
            return c_nvmlMemory_t(total, total, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[RunningProcess]:
        with self._reading() as state:
            if self._decode(handle, _GPU, _MIG)[0] == _MIG:
                gpu, gi, ci = self._ci(state, handle, _MIG)
                devices = [(gi, ci)]
            else:
                gpu = self._gpu(state, handle)
                devices = [(gi, ci) for gi in gpu["gpuInstances"] for ci in gi["computeInstances"]]
                if gpu["busy"]:
                    return [
                        RunningProcess(
                            1000 + gpu["index"],
                            1 << 20,
                            NVML_VALUE_NOT_AVAILABLE_uint,
                            NVML_VALUE_NOT_AVAILABLE_uint,
                        )
                    ]
            return [
                RunningProcess(
                    2000 + gpu["index"] * 100 + gi["id"] * 10 + ci["id"], 1 << 20, gi["id"], ci["id"]
                )
                for gi, ci in devices
                if ci["busy"]
            ]

    # ---- MIG mode ----------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        with self._reading() as state:
            gpu = self._gpu(state, handle)
            self._mig_product(gpu)
            return [gpu["migCurrent"], gpu["migPending"]]

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        """Returns the activation status (0, IN_USE, RESET_REQUIRED) instead of raising, as NVML does."""
        if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
            raise NVMLError_InvalidArgument()

        def change(state: State) -> int:
            gpu = self._gpu(state, handle)
            self._mig_product(gpu)
            if gpu["gpuInstances"] and mode == NVML_DEVICE_MIG_DISABLE:
                raise NVMLError_InUse()
            gpu["migPending"] = mode
            if gpu["migCurrent"] == mode:
                return NVML_SUCCESS
            if state["pendingModeChanges"]:
                return NVML_ERROR_RESET_REQUIRED
            if simstate.gpu_busy(gpu):
                return NVML_ERROR_IN_USE
            gpu["migCurrent"] = mode
            return NVML_SUCCESS

        return self._mutate(change)

    # ---- GPU instances -----------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, handle: Any, profile: int, version: int = 2
    ) -> c_nvmlGpuInstanceProfileInfo_v2_t:
        with self._reading() as state:
            product = self._mig_product(self._gpu(state, handle))
        if not 0 <= profile < NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise NVMLError_InvalidArgument()
        for p in product.profiles:
            if p.enum == profile:
                return c_nvmlGpuInstanceProfileInfo_v2_t(
                    version=0x02000098,
                    id=p.id,
                    isP2pSupported=0,
                    sliceCount=p.compute_slices,
                    instanceCount=p.max_count,
                    multiprocessorCount=14 * p.compute_slices,
                    copyEngineCount=p.memory_slices,
                    decoderCount=0,
                    encoderCount=0,
                    jpegCount=0,
                    ofaCount=0,
                    memorySizeMB=p.memory_mib,
                    name=f"MIG {p.name}".encode(),
                )
        raise NVMLError_NotSupported()

    def _gi_profile(self, gpu: State, profile_id: int) -> Any:
        for p in self._mig_product(gpu).profiles:
            if p.id == profile_id:
                return p
        raise NVMLError_InvalidArgument()

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self,
        handle: Any,
        profileId: int,
        placementsRef: Any,
        countRef: Any,
    ) -> int:
        with self._reading() as state:
            profile = self._gi_profile(self._gpu(state, handle), profileId)
        count = _deref(countRef)
        if placementsRef is None:
            count.value = len(profile.placements)
            return NVML_SUCCESS
        if count.value < len(profile.placements):
            count.value = len(profile.placements)
            raise NVMLError_InsufficientSize()
        for i, start in enumerate(profile.placements):
            placementsRef[i] = c_nvmlGpuInstancePlacement_t(start, profile.size)
        count.value = len(profile.placements)
        return NVML_SUCCESS

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self,
        handle: Any,
        profileId: int,
        placement: Any,
    ) -> int:
        wanted = _deref(placement)

        def change(state: State) -> int:
            gpu = self._gpu(state, handle)
            product = self._enabled_product(gpu)
            profile = self._gi_profile(gpu, profileId)
            if wanted.start not in profile.placements or wanted.size != profile.size:
                raise NVMLError_InvalidArgument()
            gis = gpu["gpuInstances"]
            if sum(gi["profileId"] == profileId for gi in gis) >= profile.max_count:
                raise NVMLError_InsufficientResources()
            for gi in gis:
                if wanted.start < gi["start"] + gi["size"] and gi["start"] < wanted.start + wanted.size:
                    raise NVMLError_InsufficientResources()
            compute = sum(self._gi_profile(gpu, gi["profileId"]).compute_slices for gi in gis)
            if compute + profile.compute_slices > product.compute_slices:
                raise NVMLError_InsufficientResources()
            gi_id = min(set(range(len(gis) + 1)) - {gi["id"] for gi in gis})
            gis.append(
                {
                    "id": gi_id,
                    "profileId": profileId,
                    "start": wanted.start,
                    "size": wanted.size,
                    "computeInstances": [],
                }
            )
            return _handle(_GI, gpu["index"], gi_id)

        return self._mutate(change)

    def nvmlDeviceGetGpuInstances(
        self,
        handle: Any,
        profileId: int,
        gpuInstancesRef: Any,
        countRef: Any,
    ) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, handle)
            self._enabled_product(gpu)
            self._gi_profile(gpu, profileId)
            found = [gi for gi in gpu["gpuInstances"] if gi["profileId"] == profileId]
        count = _deref(countRef)
        if len(found) > len(gpuInstancesRef):
            raise NVMLError_InsufficientSize()
        for i, gi in enumerate(found):
            gpuInstancesRef[i] = _handle(_GI, gpu["index"], gi["id"])
        count.value = len(found)
        return NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gpuInstanceId: int) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, handle)
            self._enabled_product(gpu)
            if not any(gi["id"] == gpuInstanceId for gi in gpu["gpuInstances"]):
                raise NVMLError_NotFound()
            return _handle(_GI, gpu["index"], gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> c_nvmlGpuInstanceInfo_t:
        with self._reading() as state:
            gpu, gi = self._gi(state, gpuInstance)
            return c_nvmlGpuInstanceInfo_t(
                _handle(_GPU, gpu["index"]),
                gi["id"],
                gi["profileId"],
                c_nvmlGpuInstancePlacement_t(gi["start"], gi["size"]),
            )

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        def change(state: State) -> int:
            gpu, gi = self._gi(state, gpuInstance)
            if gi["computeInstances"]:
                raise NVMLError_InUse()
            gpu["gpuInstances"].remove(gi)
            return NVML_SUCCESS

        return self._mutate(change)

    # ---- compute instances -------------------------------------------------------------------

    def _ci_slices(self, gpu: State, gi: State, profile: int) -> int:
        giant = self._gi_profile(gpu, gi["profileId"]).compute_slices
        slices = _CI_SLICES.get(profile)
        if slices is None or slices > giant or (slices < giant and 2 * slices > giant + 1):
            raise NVMLError_NotSupported()
        return slices

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self,
        gpuInstance: Any,
        profile: int,
        engProfile: int,
        version: int = 2,
    ) -> c_nvmlComputeInstanceProfileInfo_v2_t:
        if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED or not 0 <= profile < 9:
            raise NVMLError_InvalidArgument()
        with self._reading() as state:
            gpu, gi = self._gi(state, gpuInstance)
            slices = self._ci_slices(gpu, gi, profile)
            whole = self._gi_profile(gpu, gi["profileId"]).compute_slices
        return c_nvmlComputeInstanceProfileInfo_v2_t(
            version=0x02000088,
            id=profile,
            sliceCount=slices,
            instanceCount=whole // slices,
            multiprocessorCount=14 * slices,
            name=f"MIG {slices}c".encode(),
        )

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> int:
        def change(state: State) -> int:
            gpu, gi = self._gi(state, gpuInstance)
            slices = self._ci_slices(gpu, gi, profileId)
            cis = gi["computeInstances"]
            used = sum(_CI_SLICES[ci["profileId"]] for ci in cis)
            if used + slices > self._gi_profile(gpu, gi["profileId"]).compute_slices:
                raise NVMLError_InsufficientResources()
            ci_id = min(set(range(len(cis) + 1)) - {ci["id"] for ci in cis})
            taken = {ci["migIndex"] for g in gpu["gpuInstances"] for ci in g["computeInstances"]}
            cis.append(
                {
                    "id": ci_id,
                    "profileId": profileId,
                    "start": used,
                    "size": slices,
                    "migIndex": min(set(range(len(taken) + 1)) - taken),
                    "uuid": simstate.new_mig_uuid(state),
                    "busy": False,
                }
            )
            return _handle(_CI, gpu["index"], gi["id"], ci_id)

        return self._mutate(change)

    def nvmlGpuInstanceGetComputeInstances(
        self,
        gpuInstance: Any,
        profileId: int,
        computeInstancesRef: Any,
        countRef: Any,
    ) -> int:
        with self._reading() as state:
            gpu, gi = self._gi(state, gpuInstance)
            found = [ci for ci in gi["computeInstances"] if ci["profileId"] == profileId]
        if len(found) > len(computeInstancesRef):
            raise NVMLError_InsufficientSize()
        for i, ci in enumerate(found):
            computeInstancesRef[i] = _handle(_CI, gpu["index"], gi["id"], ci["id"])
        _deref(countRef).value = len(found)
        return NVML_SUCCESS

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> c_nvmlComputeInstanceInfo_t:
        with self._reading() as state:
            gpu, gi, ci = self._ci(state, computeInstance, _CI)
            return c_nvmlComputeInstanceInfo_t(
                _handle(_MIG, gpu["index"], gi["id"], ci["id"]),
                _handle(_GI, gpu["index"], gi["id"]),
                ci["id"],
                ci["profileId"],
                c_nvmlComputeInstancePlacement_t(ci["start"], ci["size"]),
            )

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        def change(state: State) -> int:
            _, gi, ci = self._ci(state, computeInstance, _CI)
            if ci["busy"]:
                raise NVMLError_InUse()
            gi["computeInstances"].remove(ci)
            return NVML_SUCCESS

        return self._mutate(change)

    # ---- MIG devices -------------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, handle)
            product = self._mig_product(gpu)
            return product.compute_slices if gpu["migCurrent"] == NVML_DEVICE_MIG_ENABLE else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, handle)
            product = self._enabled_product(gpu)
            if not 0 <= index < product.compute_slices:
                raise NVMLError_InvalidArgument()
            for gi in gpu["gpuInstances"]:
                for ci in gi["computeInstances"]:
                    if ci["migIndex"] == index:
                        return _handle(_MIG, gpu["index"], gi["id"], ci["id"])
        raise NVMLError_NotFound()

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> ctypes.c_uint:
        return ctypes.c_uint(int(self._decode(handle, _GPU, _MIG)[0] == _MIG))

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        with self._reading() as state:
            return int(self._ci(state, handle, _MIG)[1]["id"])

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        with self._reading() as state:
            return int(self._ci(state, handle, _MIG)[2]["id"])

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> int:
        return _handle(_GPU, self._decode(handle, _MIG)[1])

    # ---- events ------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> int:
        if not self._initialised:
            raise NVMLError_Uninitialized()
        event_set = len(self._event_cursors) + 1
        self._event_sets[event_set] = {}
        self._event_cursors[event_set] = self._first_event
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: int) -> None:
        with self._reading() as state:
            gpu = self._gpu(state, handle)
        if eventSet not in self._event_sets:
            raise NVMLError_InvalidArgument()
        self._event_sets[eventSet][gpu["index"]] = eventTypes

    def nvmlEventSetWait(self, eventSet: int, timeoutms: int) -> c_nvmlEventData_t:
        """The next XID or recovery on a registered GPU; NVMLError_Timeout after `timeoutms`."""
        registered = self._event_sets.get(eventSet)
        if registered is None:
            raise NVMLError_InvalidArgument()
        deadline = time.monotonic() + timeoutms / 1000
        while True:
            with self._reading() as state:
                events = [e for e in state["events"] if e["seq"] > self._event_cursors[eventSet]]
            for event in events:
                self._event_cursors[eventSet] = event["seq"]
                mask = registered.get(event["gpu"], 0)
                if event.get("recovered") and mask & nvmlEventTypeGpuRecoveryAction:
                    return c_nvmlEventData_t(
                        _handle(_GPU, event["gpu"]),
                        nvmlEventTypeGpuRecoveryAction,
                        NVML_GPU_RECOVERY_ACTION_NONE,
                        NVML_VALUE_NOT_AVAILABLE_uint,
                        NVML_VALUE_NOT_AVAILABLE_uint,
                    )
                if "xid" in event and mask & nvmlEventTypeXidCriticalError:
                    return c_nvmlEventData_t(
                        _handle(_GPU, event["gpu"]),
                        nvmlEventTypeXidCriticalError,
                        event["xid"],
                        NVML_VALUE_NOT_AVAILABLE_uint if event["gi"] is None else event["gi"],
                        NVML_VALUE_NOT_AVAILABLE_uint if event["ci"] is None else event["ci"],
                    )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NVMLError_Timeout()
            time.sleep(min(remaining, self._event_poll_s))

    def nvmlEventSetFree(self, eventSet: int) -> None:
        if self._event_sets.pop(eventSet, None) is None:
            raise NVMLError_InvalidArgument()
