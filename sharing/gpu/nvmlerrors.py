"""NVML errors as BackendError subclasses that name the GPU and say what to do."""

from __future__ import annotations

from sharing.errors import BackendError
from sharing.gpu.backend import GpuBusyError, GpuNotFoundError, InsufficientResourcesError, NotSupportedError
from sharing.gpu.nvmlapi import Nvml, code


def backend_error(nvml: Nvml, err: Exception, doing: str, where: str) -> BackendError:
    """The BackendError for an NVML error raised while `doing` something on `where`."""
    n = nvml
    value = code(err)
    text = f"{doing} on {where}"
    if value == n.NVML_ERROR_IN_USE:
        return GpuBusyError(f"{text}: in use (processes run on it); stop them, then apply again")
    if value == n.NVML_ERROR_INSUFFICIENT_RESOURCES:
        return InsufficientResourcesError(
            f"{text}: insufficient resources (the slices are taken or the profile's maximum is "
            "reached); compare `sharing export` with `sharing profiles`"
        )
    if value == n.NVML_ERROR_NOT_SUPPORTED:
        return NotSupportedError(f"{text}: not supported (the GPU has no MIG, or MIG mode is off)")
    if value == n.NVML_ERROR_NO_PERMISSION:
        return BackendError(
            f"{text}: permission denied; run as root or give access to "
            "/proc/driver/nvidia/capabilities/mig/config"
        )
    if value == n.NVML_ERROR_NOT_FOUND:
        return GpuNotFoundError(f"{text}: not found (it may have just been removed); observe again")
    if value == n.NVML_ERROR_GPU_IS_LOST:
        return BackendError(f"{text}: the GPU is lost; it needs a reset or a reboot")
    if value == n.NVML_ERROR_RESET_REQUIRED:
        return BackendError(f"{text}: the GPU needs a reset first")
    return BackendError(f"{text}: NVML error {value}: {err}")
