"""A simulated NVML: the pynvml functions, constants, structs and errors the NVML backend uses.

`NvmlBackend` runs unchanged over `SimNvml(path)` instead of the `pynvml` module, so tests and demos
exercise the real backend code; `SimNvml` satisfies the typed `nvmlapi.Nvml` surface. The GPUs'
profile tables (profiles, memory, placements on their grid, engines, multiprocessors), PCI ids,
compute capability and the driver and CUDA versions come from the state file. The simulator
enforces the driver's rules: MIG mode pending until a reset (at once on an idle bare-metal GPU
unless the state asks for VM-like behaviour), IN_USE for busy devices, NOT_SUPPORTED on GPUs
without MIG, sparse MIG device indices, a ctypes value from nvmlDeviceIsMigDeviceHandle, activation
status from nvmlDeviceSetMigMode, GPU_IS_LOST for a lost GPU. Instances: `siminstances`.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

from sharing.gpu import simstate, simtypes
from sharing.gpu.nvmlapi import nvmlPciInfoExt_v1_t
from sharing.gpu.simcore import GPU, MIG, decode, handle
from sharing.gpu.siminstances import SimInstances
from sharing.gpu.simspec import State
from sharing.gpu.simtypes import (
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_RESET_REQUIRED,
    NVML_GPU_RECOVERY_ACTION_NONE,
    NVML_SUCCESS,
    NVML_VALUE_NOT_AVAILABLE_uint,
    NVMLError_InUse,
    NVMLError_InvalidArgument,
    NVMLError_NotFound,
    NVMLError_Timeout,
    NVMLError_Uninitialized,
    RunningProcess,
    c_nvmlEventData_t,
    c_nvmlMemory_t,
    nvmlEventTypeGpuRecoveryAction,
    nvmlEventTypeXidCriticalError,
    nvmlPciInfo_t,
)
from sharing.mig import Catalog


class SimNvml(SimInstances):
    """The simulated NVML library over one state file; attribute names are pynvml's."""

    NVML_SUCCESS = simtypes.NVML_SUCCESS
    NVML_ERROR_INVALID_ARGUMENT = simtypes.NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = simtypes.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = simtypes.NVML_ERROR_NO_PERMISSION
    NVML_ERROR_NOT_FOUND = simtypes.NVML_ERROR_NOT_FOUND
    NVML_ERROR_TIMEOUT = simtypes.NVML_ERROR_TIMEOUT
    NVML_ERROR_FUNCTION_NOT_FOUND = simtypes.NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = simtypes.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_RESET_REQUIRED = simtypes.NVML_ERROR_RESET_REQUIRED
    NVML_ERROR_IN_USE = simtypes.NVML_ERROR_IN_USE
    NVML_ERROR_INSUFFICIENT_RESOURCES = simtypes.NVML_ERROR_INSUFFICIENT_RESOURCES
    NVML_DEVICE_MIG_DISABLE = simtypes.NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = simtypes.NVML_DEVICE_MIG_ENABLE
    NVML_GPU_INSTANCE_PROFILE_COUNT = simtypes.NVML_GPU_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT = simtypes.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = simtypes.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    NVML_GPU_RECOVERY_ACTION_NONE = simtypes.NVML_GPU_RECOVERY_ACTION_NONE
    NVML_GPU_VIRTUALIZATION_MODE_VGPU = simtypes.NVML_GPU_VIRTUALIZATION_MODE_VGPU
    nvmlEventTypeXidCriticalError = simtypes.nvmlEventTypeXidCriticalError
    nvmlEventTypeGpuRecoveryAction = simtypes.nvmlEventTypeGpuRecoveryAction
    nvmlPciInfoExt_v1 = simtypes.nvmlPciInfoExt_v1
    NVMLError = simtypes.NVMLError
    c_nvmlGpuInstancePlacement_t = simtypes.c_nvmlGpuInstancePlacement_t
    c_nvmlGpuInstance_t = simtypes.c_nvmlGpuInstance_t
    c_nvmlComputeInstance_t = simtypes.c_nvmlComputeInstance_t
    nvmlPciInfoExt_v1_t = nvmlPciInfoExt_v1_t

    def __getattr__(self, name: str) -> object:
        """The rest of pynvml's names the simulated module has (error classes, structs)."""
        try:
            found: object = getattr(simtypes, name)
        except AttributeError:
            raise AttributeError(f"the simulated NVML has no {name!r}") from None
        return found

    def __init__(self, path: Path, catalog: Catalog | None = None, *, event_poll_s: float = 0.02) -> None:
        """`catalog` is accepted for compatibility: the GPUs' tables live in the state file."""
        super().__init__(path, event_poll_s=event_poll_s)
        self._event_sets: dict[int, dict[int, int]] = {}  # set -> {gpu index: event mask}
        self._event_cursors: dict[int, int] = {}  # set -> last event seen
        self._first_event = 0

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

    def nvmlSystemGetDriverVersion(self) -> str:
        with self._reading() as state:
            return str(state.get("driverVersion", "580.65.06"))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        with self._reading() as state:
            return int(state.get("cudaVersion", 13000))

    def nvmlDeviceGetCount(self) -> int:
        with self._reading() as state:
            return len(state["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        with self._reading() as state:
            if not 0 <= index < len(state["gpus"]):
                raise NVMLError_InvalidArgument()
            return handle(GPU, index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> int:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        with self._reading() as state:
            for gpu in state["gpus"]:
                if gpu["uuid"] == text:
                    return handle(GPU, gpu["index"])
                for gi in gpu["gpuInstances"]:
                    for ci in gi["computeInstances"]:
                        if ci["uuid"] == text:
                            return handle(MIG, gpu["index"], gi["id"], ci["id"])
        raise NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, device: object) -> str:
        with self._reading() as state:
            if decode(device, GPU, MIG)[0] == MIG:
                return str(self._ci(state, device, MIG)[2]["uuid"])
            return str(self._gpu(state, device)["uuid"])

    def nvmlDeviceGetName(self, device: object) -> str:
        with self._reading() as state:
            if decode(device, GPU, MIG)[0] == MIG:
                gpu, gi, _ = self._ci(state, device, MIG)
                return f"{gpu['name']} MIG {self._gi_profile(gpu, gi['profileId']).name}"
            return str(self._gpu(state, device)["name"])

    def nvmlDeviceGetMemoryInfo(self, device: object) -> c_nvmlMemory_t:
        with self._reading() as state:
            total = self._gpu(state, device)["memoryMiB"] * 1024 * 1024
            return c_nvmlMemory_t(total, total, 0)

    def nvmlDeviceGetPciInfo(self, device: object) -> nvmlPciInfo_t:
        with self._reading() as state:
            gpu = self._gpu(state, device)
            bus = f"00000000:{0x10 + gpu['index']:02X}:00.0".encode()
            return nvmlPciInfo_t(
                bus[:15], 0, 0x10 + gpu["index"], 0, gpu["pciDeviceId"], gpu["pciSubsystemId"], bus
            )

    def nvmlDeviceGetPciInfoExt(self, device: object, c_info: object) -> None:
        info = getattr(c_info, "_obj", c_info)
        if not isinstance(info, nvmlPciInfoExt_v1_t) or info.version != simtypes.nvmlPciInfoExt_v1:
            raise NVMLError_InvalidArgument()
        with self._reading() as state:
            gpu = self._gpu(state, device)
            info.baseClass, info.subClass = gpu["pciClass"] >> 16, (gpu["pciClass"] >> 8) & 0xFF

    def nvmlDeviceGetCudaComputeCapability(self, device: object) -> tuple[int, int]:
        with self._reading() as state:
            capability = self._gpu(state, device)["computeCapability"] or [0, 0]
            return int(capability[0]), int(capability[1])

    def nvmlDeviceGetMinorNumber(self, device: object) -> int:
        with self._reading() as state:
            return int(self._gpu(state, device)["index"])

    def nvmlDeviceGetVirtualizationMode(self, device: object) -> int:
        with self._reading() as state:
            self._gpu(state, device)
            return int(state.get("virtualizationMode", simtypes.NVML_GPU_VIRTUALIZATION_MODE_NONE))

    def nvmlDeviceGetComputeRunningProcesses(self, device: object) -> list[RunningProcess]:
        with self._reading() as state:
            if decode(device, GPU, MIG)[0] == MIG:
                gpu, gi, ci = self._ci(state, device, MIG)
                devices = [(gi, ci)]
            else:
                gpu = self._gpu(state, device)
                devices = [(gi, ci) for gi in gpu["gpuInstances"] for ci in gi["computeInstances"]]
                if gpu["busy"]:
                    na = NVML_VALUE_NOT_AVAILABLE_uint
                    return [RunningProcess(1000 + gpu["index"], 1 << 20, na, na)]
            return [
                RunningProcess(
                    2000 + gpu["index"] * 100 + gi["id"] * 10 + ci["id"], 1 << 20, gi["id"], ci["id"]
                )
                for gi, ci in devices
                if ci["busy"]
            ]

    # ---- MIG mode ----------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: object) -> list[int]:
        with self._reading() as state:
            gpu = self._gpu(state, device)
            self._table(gpu)
            return [gpu["migCurrent"], gpu["migPending"]]

    def nvmlDeviceSetMigMode(self, device: object, mode: int) -> int:
        """Returns the activation status (0, IN_USE, RESET_REQUIRED) instead of raising, as NVML does."""
        if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
            raise NVMLError_InvalidArgument()

        def change(state: State) -> int:
            gpu = self._gpu(state, device)
            self._table(gpu)
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

    # ---- MIG devices -------------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, device: object) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, device)
            table = self._table(gpu)
            return table.compute_slices if gpu["migCurrent"] == NVML_DEVICE_MIG_ENABLE else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: object, index: int) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, device)
            table = self._enabled_table(gpu)
            if not 0 <= index < table.compute_slices:
                raise NVMLError_InvalidArgument()
            for gi in gpu["gpuInstances"]:
                for ci in gi["computeInstances"]:
                    if ci["migIndex"] == index:
                        return handle(MIG, gpu["index"], gi["id"], ci["id"])
        raise NVMLError_NotFound()

    def nvmlDeviceIsMigDeviceHandle(self, device: object) -> ctypes.c_uint:
        return ctypes.c_uint(int(decode(device, GPU, MIG)[0] == MIG))

    def nvmlDeviceGetGpuInstanceId(self, device: object) -> int:
        with self._reading() as state:
            return int(self._ci(state, device, MIG)[1]["id"])

    def nvmlDeviceGetComputeInstanceId(self, device: object) -> int:
        with self._reading() as state:
            return int(self._ci(state, device, MIG)[2]["id"])

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, device: object) -> int:
        return handle(GPU, decode(device, MIG)[1])

    # ---- events ------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> int:
        if not self._initialised:
            raise NVMLError_Uninitialized()
        event_set = len(self._event_cursors) + 1
        self._event_sets[event_set] = {}
        self._event_cursors[event_set] = self._first_event
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: object, eventTypes: int, eventSet: object) -> None:
        with self._reading() as state:
            gpu = self._gpu(state, handle)
        if not isinstance(eventSet, int) or eventSet not in self._event_sets:
            raise NVMLError_InvalidArgument()
        self._event_sets[eventSet][gpu["index"]] = eventTypes

    def nvmlEventSetWait(self, eventSet: object, timeoutms: int) -> c_nvmlEventData_t:
        """The next XID or recovery on a registered GPU; NVMLError_Timeout after `timeoutms`."""
        registered = self._event_sets.get(eventSet) if isinstance(eventSet, int) else None
        if registered is None or not isinstance(eventSet, int):
            raise NVMLError_InvalidArgument()
        na = NVML_VALUE_NOT_AVAILABLE_uint
        deadline = time.monotonic() + timeoutms / 1000
        while True:
            with self._reading() as state:
                events = [e for e in state["events"] if e["seq"] > self._event_cursors[eventSet]]
            for event in events:
                self._event_cursors[eventSet] = event["seq"]
                mask = registered.get(event["gpu"], 0)
                device = handle(GPU, event["gpu"])
                if event.get("recovered") and mask & nvmlEventTypeGpuRecoveryAction:
                    return c_nvmlEventData_t(
                        device, nvmlEventTypeGpuRecoveryAction, NVML_GPU_RECOVERY_ACTION_NONE, na, na
                    )
                if "xid" in event and mask & nvmlEventTypeXidCriticalError:
                    gi = na if event["gi"] is None else event["gi"]
                    ci = na if event["ci"] is None else event["ci"]
                    return c_nvmlEventData_t(device, nvmlEventTypeXidCriticalError, event["xid"], gi, ci)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NVMLError_Timeout()
            time.sleep(min(remaining, self._event_poll_s))

    def nvmlEventSetFree(self, eventSet: object) -> None:
        if not isinstance(eventSet, int) or self._event_sets.pop(eventSet, None) is None:
            raise NVMLError_InvalidArgument()
