"""The names of the simulated NVML: pynvml's constants, error classes and ctypes structs.

Same names, values and fields as in `pynvml` (nvidia-ml-py), so `NvmlBackend` cannot tell the
simulated library from the real one; `SimNvml` exposes all of them as attributes. The structs are
the typed ones of `nvmlapi`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from sharing.gpu.nvmlapi import (
    c_nvmlComputeInstanceInfo_t,
    c_nvmlComputeInstancePlacement_t,
    c_nvmlComputeInstanceProfileInfo_v2_t,
    c_nvmlEventData_t,
    c_nvmlGpuInstanceInfo_t,
    c_nvmlGpuInstancePlacement_t,
    c_nvmlGpuInstanceProfileInfo_v2_t,
    c_nvmlMemory_t,
    nvmlPciInfo_t,
    nvmlPciInfoExt_v1_t,
)

__all__ = [
    "c_nvmlComputeInstanceInfo_t",
    "c_nvmlComputeInstancePlacement_t",
    "c_nvmlComputeInstanceProfileInfo_v2_t",
    "c_nvmlEventData_t",
    "c_nvmlGpuInstanceInfo_t",
    "c_nvmlGpuInstancePlacement_t",
    "c_nvmlGpuInstanceProfileInfo_v2_t",
    "c_nvmlMemory_t",
    "nvmlPciInfoExt_v1_t",
    "nvmlPciInfo_t",
]

# Return and error codes (nvml.h).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeGpuRecoveryAction = 0x8000
NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_VIRTUALIZATION_MODE_NONE = 0
NVML_GPU_VIRTUALIZATION_MODE_VGPU = 2
nvmlPciInfoExt_v1 = 0x1000040
NVML_VALUE_NOT_AVAILABLE_uint = 0xFFFFFFFF  # pynvml has it as c_uint(-1); the value is what counts


class NVMLError(Exception):
    """Base of the simulated NVML errors; `.value` is the NVML return code, as in pynvml."""

    code = NVML_ERROR_UNKNOWN

    def __init__(self, value: int | None = None) -> None:
        self.value = self.code if value is None else value
        super().__init__(f"simulated NVML error {self.value}")


class NVMLError_Uninitialized(NVMLError):
    code = NVML_ERROR_UNINITIALIZED


class NVMLError_InvalidArgument(NVMLError):
    code = NVML_ERROR_INVALID_ARGUMENT


class NVMLError_NotSupported(NVMLError):
    code = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NotFound(NVMLError):
    code = NVML_ERROR_NOT_FOUND


class NVMLError_InsufficientSize(NVMLError):
    code = NVML_ERROR_INSUFFICIENT_SIZE


class NVMLError_Timeout(NVMLError):
    code = NVML_ERROR_TIMEOUT


class NVMLError_GpuIsLost(NVMLError):
    code = NVML_ERROR_GPU_IS_LOST


class NVMLError_FunctionNotFound(NVMLError):
    code = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_InUse(NVMLError):
    code = NVML_ERROR_IN_USE


class NVMLError_InsufficientResources(NVMLError):
    code = NVML_ERROR_INSUFFICIENT_RESOURCES


# Handles are plain integers here (opaque pointers in pynvml): kind, GPU index, GI id, CI id.
c_nvmlDevice_t = ctypes.c_uint64
c_nvmlGpuInstance_t = ctypes.c_uint64
c_nvmlComputeInstance_t = ctypes.c_uint64


@dataclass(frozen=True, slots=True)
class RunningProcess:
    """What nvmlDeviceGetComputeRunningProcesses lists."""

    pid: int
    usedGpuMemory: int
    gpuInstanceId: int
    computeInstanceId: int
