"""The names of the simulated NVML: pynvml's constants, error classes and ctypes structs.

Same names, values and fields as in `pynvml` (nvidia-ml-py), so `NvmlBackend` cannot tell the
simulated library from the real one; `SimNvml` exposes all of them as attributes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

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


class NVMLError_InUse(NVMLError):
    code = NVML_ERROR_IN_USE


class NVMLError_InsufficientResources(NVMLError):
    code = NVML_ERROR_INSUFFICIENT_RESOURCES


# Handles are plain integers here (opaque pointers in pynvml): kind, GPU index, GI id, CI id.
c_nvmlDevice_t = ctypes.c_uint64
c_nvmlGpuInstance_t = ctypes.c_uint64
c_nvmlComputeInstance_t = ctypes.c_uint64


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    _fields_ = (("start", ctypes.c_uint), ("size", ctypes.c_uint))


class c_nvmlComputeInstancePlacement_t(ctypes.Structure):
    _fields_ = (("start", ctypes.c_uint), ("size", ctypes.c_uint))


class c_nvmlGpuInstanceProfileInfo_v2_t(ctypes.Structure):
    _fields_ = (
        ("version", ctypes.c_uint),
        ("id", ctypes.c_uint),
        ("isP2pSupported", ctypes.c_uint),
        ("sliceCount", ctypes.c_uint),
        ("instanceCount", ctypes.c_uint),
        ("multiprocessorCount", ctypes.c_uint),
        ("copyEngineCount", ctypes.c_uint),
        ("decoderCount", ctypes.c_uint),
        ("encoderCount", ctypes.c_uint),
        ("jpegCount", ctypes.c_uint),
        ("ofaCount", ctypes.c_uint),
        ("memorySizeMB", ctypes.c_ulonglong),
        ("name", ctypes.c_char * 96),
    )


class c_nvmlGpuInstanceInfo_t(ctypes.Structure):
    _fields_ = (
        ("device", c_nvmlDevice_t),
        ("id", ctypes.c_uint),
        ("profileId", ctypes.c_uint),
        ("placement", c_nvmlGpuInstancePlacement_t),
    )


class c_nvmlComputeInstanceProfileInfo_v2_t(ctypes.Structure):
    _fields_ = (
        ("version", ctypes.c_uint),
        ("id", ctypes.c_uint),
        ("sliceCount", ctypes.c_uint),
        ("instanceCount", ctypes.c_uint),
        ("multiprocessorCount", ctypes.c_uint),
        ("sharedCopyEngineCount", ctypes.c_uint),
        ("sharedDecoderCount", ctypes.c_uint),
        ("sharedEncoderCount", ctypes.c_uint),
        ("sharedJpegCount", ctypes.c_uint),
        ("sharedOfaCount", ctypes.c_uint),
        ("name", ctypes.c_char * 96),
    )


class c_nvmlComputeInstanceInfo_t(ctypes.Structure):
    _fields_ = (
        ("device", c_nvmlDevice_t),
        ("gpuInstance", c_nvmlGpuInstance_t),
        ("id", ctypes.c_uint),
        ("profileId", ctypes.c_uint),
        ("placement", c_nvmlComputeInstancePlacement_t),
    )


class c_nvmlEventData_t(ctypes.Structure):
    _fields_ = (
        ("device", c_nvmlDevice_t),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    )


class c_nvmlMemory_t(ctypes.Structure):
    _fields_ = (("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong))


@dataclass(frozen=True, slots=True)
class RunningProcess:
    """What nvmlDeviceGetComputeRunningProcesses lists."""

    pid: int
    usedGpuMemory: int
    gpuInstanceId: int
    computeInstanceId: int
