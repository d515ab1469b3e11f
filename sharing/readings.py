"""What the GPUs are doing at one moment, as NVML says it: frozen values.

A GPU backend reads them for the usage sampler (`sharing.usage`), which says whose processes they
are. Memory is in bytes, activity as a ratio (0..1); a field NVML cannot give on this GPU (device
utilization in MIG mode, GPM before Hopper, a sensor the board lacks) is None, never a stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharing.model import GpuUuid


@dataclass(frozen=True, slots=True)
class ProcessReading:
    """One compute process on a device (nvmlDeviceGetComputeRunningProcesses): a host PID."""

    pid: int
    memory_bytes: int | None
    """Its device memory (`usedGpuMemory`); None where NVML does not say."""
    sm: float | None = None
    """The share of the device's SMs it used since the last reading (nvmlDeviceGetProcessUtilization,
    averaged over its samples; 0 when it had none); None in MIG mode, where NVML has no per-process
    utilization."""


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """A GPU without MIG, or one MIG device of a GPU in MIG mode: its memory and processes."""

    uuid: str
    """The GPU's UUID, or the MIG device's."""
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    processes: tuple[ProcessReading, ...] | None
    """None when they cannot be read (NO_PERMISSION: an unprivileged container)."""
    gpu_instance: int | None = None
    """The MIG device's GPU instance id; None for a whole GPU."""
    sm_active: float | None = None
    """GPM SM_UTIL of its GPU instance between the last two readings (Hopper and newer, MIG only)."""
    graphics_active: float | None = None
    """GPM GRAPHICS_UTIL of its GPU instance, likewise."""


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU: its sensors, memory and utilization, and its devices (itself, or its MIG devices)."""

    index: int
    uuid: GpuUuid
    power_watts: float | None
    temperature_celsius: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization: float | None
    """The share of time a kernel ran (nvmlDeviceGetUtilizationRates); None in MIG mode."""
    mig: bool
    gpm: bool
    """Whether NVML's GPM is supported (Hopper and newer): the GPU instances' activity."""
    devices: tuple[DeviceReading, ...]
    """The GPU itself when MIG is off; its MIG devices when it is on."""


@dataclass(frozen=True, slots=True)
class UnreadableReading:
    """A GPU whose readings failed (lost, fallen off the bus): the others are read as usual."""

    index: int
    error: str


@dataclass(frozen=True, slots=True)
class NodeReadings:
    """Every GPU of the node at one moment."""

    at: float
    """Unix time of the reading."""
    gpus: tuple[GpuReading, ...] = ()
    unreadable: tuple[UnreadableReading, ...] = ()

    def processes(self) -> tuple[tuple[GpuReading, DeviceReading, ProcessReading], ...]:
        """Every process with its GPU and device."""
        return tuple((g, d, p) for g in self.gpus for d in g.devices for p in d.processes or ())
