"""Exactly the NVML the backend uses, as one typed Protocol: what `pynvml` and the simulator both provide.

`Nvml` lists every function, constant, error class and struct the NVML backend touches, with the
types pynvml (nvidia-ml-py) gives them, so `mypy --strict` checks the backend and the simulator
against one surface. The ctypes structs are defined here once (pynvml's field names and layouts);
the simulator builds them, the real module has its own. Handles are opaque objects.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Protocol

Handle = object
"""A device, GPU-instance, compute-instance or event-set handle: opaque (pynvml: ctypes pointers)."""


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    _fields_ = (("start", ctypes.c_uint), ("size", ctypes.c_uint))
    start: int
    size: int


class c_nvmlComputeInstancePlacement_t(ctypes.Structure):
    _fields_ = (("start", ctypes.c_uint), ("size", ctypes.c_uint))
    start: int
    size: int


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
    id: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    copyEngineCount: int
    decoderCount: int
    encoderCount: int
    jpegCount: int
    ofaCount: int
    memorySizeMB: int


class c_nvmlGpuInstanceInfo_t(ctypes.Structure):
    _fields_ = (
        ("device", ctypes.c_uint64),
        ("id", ctypes.c_uint),
        ("profileId", ctypes.c_uint),
        ("placement", c_nvmlGpuInstancePlacement_t),
    )
    id: int
    profileId: int
    placement: c_nvmlGpuInstancePlacement_t


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
    id: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int


class c_nvmlComputeInstanceInfo_t(ctypes.Structure):
    _fields_ = (
        ("device", ctypes.c_uint64),
        ("gpuInstance", ctypes.c_uint64),
        ("id", ctypes.c_uint),
        ("profileId", ctypes.c_uint),
        ("placement", c_nvmlComputeInstancePlacement_t),
    )
    device: int
    id: int
    profileId: int


class c_nvmlEventData_t(ctypes.Structure):
    _fields_ = (
        ("device", ctypes.c_uint64),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    )
    device: int
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


class nvmlPciInfo_t(ctypes.Structure):
    _fields_ = (
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    )
    pciDeviceId: int
    pciSubSystemId: int
    busId: bytes


class nvmlPciInfoExt_v1_t(ctypes.Structure):
    _fields_ = (
        ("version", ctypes.c_uint),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("baseClass", ctypes.c_uint),
        ("subClass", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    )
    version: int
    baseClass: int
    subClass: int


class RunningProcess(Protocol):
    """An entry of nvmlDeviceGetComputeRunningProcesses."""

    @property
    def pid(self) -> int: ...
    @property
    def usedGpuMemory(self) -> int | None: ...


class ProcessUtilizationSample(Protocol):
    """An entry of nvmlDeviceGetProcessUtilization (c_nvmlProcessUtilizationSample_t)."""

    @property
    def pid(self) -> int: ...
    @property
    def timeStamp(self) -> int: ...
    @property
    def smUtil(self) -> int: ...


class Utilization(Protocol):
    """nvmlDeviceGetUtilizationRates (c_nvmlUtilization_t): percentages."""

    @property
    def gpu(self) -> int: ...


class MemoryInfo(Protocol):
    """nvmlDeviceGetMemoryInfo, v1 or v2 (bytes)."""

    @property
    def total(self) -> int: ...
    @property
    def used(self) -> int: ...


class GpmSupport(Protocol):
    """nvmlGpmQueryDeviceSupport (c_nvmlGpmSupport_t)."""

    @property
    def isSupportedDevice(self) -> int: ...


class GpmMetric(Protocol):
    """One entry of c_nvmlGpmMetricsGet_t.metrics: its id in, its status and value out."""

    metricId: int
    nvmlReturn: int
    value: float


class GpmMetricsGet(Protocol):
    """c_nvmlGpmMetricsGet_t: the two samples and the metrics asked for between them."""

    version: int
    numMetrics: int
    sample1: object
    sample2: object

    @property
    def metrics(self) -> Sequence[GpmMetric]: ...


class Nvml(Protocol):
    """The NVML surface the backend uses (pynvml's names, arguments and results)."""

    NVML_SUCCESS: int
    NVML_ERROR_INVALID_ARGUMENT: int
    NVML_ERROR_NOT_SUPPORTED: int
    NVML_ERROR_NO_PERMISSION: int
    NVML_ERROR_NOT_FOUND: int
    NVML_ERROR_TIMEOUT: int
    NVML_ERROR_FUNCTION_NOT_FOUND: int
    NVML_ERROR_GPU_IS_LOST: int
    NVML_ERROR_RESET_REQUIRED: int
    NVML_ERROR_IN_USE: int
    NVML_ERROR_INSUFFICIENT_RESOURCES: int
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: int
    NVML_DEVICE_MIG_DISABLE: int
    NVML_DEVICE_MIG_ENABLE: int
    NVML_COMPUTEMODE_DEFAULT: int
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: int
    NVML_GPU_INSTANCE_PROFILE_COUNT: int
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT: int
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED: int
    NVML_GPU_RECOVERY_ACTION_NONE: int
    NVML_GPU_VIRTUALIZATION_MODE_VGPU: int
    nvmlEventTypeXidCriticalError: int
    nvmlPciInfoExt_v1: int
    nvmlMemory_v2: int
    NVML_TEMPERATURE_GPU: int
    NVML_GPM_METRICS_GET_VERSION: int
    NVML_GPM_METRIC_GRAPHICS_UTIL: int
    NVML_GPM_METRIC_SM_UTIL: int

    @property
    def NVMLError(self) -> type[Exception]: ...

    c_nvmlGpuInstancePlacement_t: type[c_nvmlGpuInstancePlacement_t]
    c_nvmlGpuInstance_t: type[ctypes.c_uint64]
    c_nvmlComputeInstance_t: type[ctypes.c_uint64]
    nvmlPciInfoExt_v1_t: type[nvmlPciInfoExt_v1_t]
    c_nvmlGpmMetricsGet_t: Callable[[], GpmMetricsGet]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...

    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> Handle: ...
    def nvmlDeviceGetUUID(self, handle: Handle, /) -> str: ...
    def nvmlDeviceGetName(self, handle: Handle, /) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None, /) -> MemoryInfo: ...
    def nvmlDeviceGetPciInfo(self, handle: Handle, /) -> nvmlPciInfo_t: ...
    def nvmlDeviceGetPciInfoExt(self, handle: Handle, c_info: object, /) -> None: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Handle, /) -> tuple[int, int]: ...
    def nvmlDeviceGetMinorNumber(self, handle: Handle, /) -> int: ...
    def nvmlDeviceGetBrand(self, handle: Handle, /) -> int: ...
    def nvmlDeviceGetArchitecture(self, handle: Handle, /) -> int: ...
    def nvmlDeviceGetVirtualizationMode(self, handle: Handle, /) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle, /) -> Sequence[RunningProcess]: ...
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Handle, /) -> Sequence[RunningProcess]: ...
    def nvmlDeviceGetMigMode(self, device: Handle, /) -> list[int]: ...
    def nvmlDeviceSetMigMode(self, device: Handle, mode: int, /) -> int: ...
    def nvmlDeviceGetHandleByUUID(self, uuid: str, /) -> Handle: ...
    def nvmlDeviceGetComputeMode(self, handle: Handle, /) -> int: ...
    def nvmlDeviceSetComputeMode(self, handle: Handle, mode: int, /) -> None: ...

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: Handle, profile: int, version: int = 2, /
    ) -> c_nvmlGpuInstanceProfileInfo_v2_t: ...
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Handle, profileId: int, placementsRef: object, countRef: object, /
    ) -> int: ...
    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: Handle, profileId: int, placement: object, /
    ) -> Handle: ...
    def nvmlDeviceGetGpuInstances(
        self, device: Handle, profileId: int, gpuInstancesRef: object, countRef: object, /
    ) -> int: ...
    def nvmlDeviceGetGpuInstanceById(self, device: Handle, gpuInstanceId: int, /) -> Handle: ...
    def nvmlGpuInstanceGetInfo(self, gpuInstance: Handle, /) -> c_nvmlGpuInstanceInfo_t: ...
    def nvmlGpuInstanceDestroy(self, gpuInstance: Handle, /) -> int: ...

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpuInstance: Handle, profile: int, engProfile: int, version: int = 2, /
    ) -> c_nvmlComputeInstanceProfileInfo_v2_t: ...
    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Handle, profileId: int, /) -> Handle: ...
    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Handle, profileId: int, computeInstancesRef: object, countRef: object, /
    ) -> int: ...
    def nvmlComputeInstanceGetInfo(self, computeInstance: Handle, /) -> c_nvmlComputeInstanceInfo_t: ...
    def nvmlComputeInstanceDestroy(self, computeInstance: Handle, /) -> int: ...

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Handle, /) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Handle, index: int, /) -> Handle: ...
    def nvmlDeviceGetGpuInstanceId(self, device: Handle, /) -> int: ...
    def nvmlDeviceGetComputeInstanceId(self, device: Handle, /) -> int: ...

    def nvmlDeviceGetPowerUsage(self, handle: Handle, /) -> int: ...
    def nvmlDeviceGetTemperatureV(self, handle: Handle, sensor: int, /) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int, /) -> int: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Handle, /) -> Utilization: ...
    def nvmlDeviceGetProcessUtilization(
        self, handle: Handle, timeStamp: int, /
    ) -> Sequence[ProcessUtilizationSample]: ...
    def nvmlGpmQueryDeviceSupport(self, device: Handle, /) -> GpmSupport: ...
    def nvmlGpmSampleAlloc(self) -> Handle: ...
    def nvmlGpmSampleFree(self, gpmSample: Handle, /) -> None: ...
    def nvmlGpmMigSampleGet(self, device: Handle, gpuInstanceId: int, gpmSample: Handle, /) -> Handle: ...
    def nvmlGpmMetricsGet(self, metricsGet: GpmMetricsGet, /) -> GpmMetricsGet: ...

    def nvmlEventSetCreate(self) -> Handle: ...
    def nvmlDeviceRegisterEvents(self, handle: Handle, eventTypes: int, eventSet: Handle, /) -> None: ...
    def nvmlEventSetWait(self, eventSet: Handle, timeoutms: int, /) -> c_nvmlEventData_t: ...
    def nvmlEventSetFree(self, eventSet: Handle, /) -> None: ...


def code(err: BaseException) -> int | None:
    """The NVML return code of a pynvml error (`.value`), or None."""
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def optional_int(nvml: object, name: str, default: int) -> int:
    """An NVML constant that older pynvml releases lack, or `default`."""
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default
