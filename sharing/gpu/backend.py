"""What the agent asks of GPUs, as one small Protocol: observe, change MIG, watch health, read usage.

The applier and the agent are written against this; `NvmlBackend` implements it on real GPUs and,
over the simulated NVML, on simulated ones. Methods are async: implementations keep blocking
driver calls off the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from sharing.errors import BackendError
from sharing.gpu.devfiles import DeviceFiles
from sharing.model import GpuInstance, GpuUuid, HealthEvent, NodeState
from sharing.readings import NodeReadings

MIG_OPERATIONS = (
    "enable_mig", "disable_mig", "create_gpu_instance", "create_compute_instance",
    "destroy_compute_instance", "destroy_gpu_instance",
)  # fmt: skip
"""The driver calls that change MIG, as the backend times them (`MigSeconds`)."""
MigSeconds = Callable[[str, float], None]
"""Where a backend reports the time of each MIG operation it asked the driver for: (one of
MIG_OPERATIONS, seconds), failed calls too."""


class NvmlUnavailableError(BackendError):
    """NVML cannot be loaded or initialised (no driver, no GPU, not installed)."""


class GpuNotFoundError(BackendError):
    """No GPU, GPU instance or MIG device with that identity."""


class GpuBusyError(BackendError):
    """The device has processes (NVML IN_USE); nothing was changed."""


class InsufficientResourcesError(BackendError):
    """The slices are taken or the profile's maximum is reached (NVML INSUFFICIENT_RESOURCES)."""


class NotSupportedError(BackendError):
    """The GPU cannot do it: no MIG, or MIG mode is off (NVML NOT_SUPPORTED)."""


class UsageReader(Protocol):
    """What the GPUs are doing, read on the usage sampler's own thread (blocking calls)."""

    def read(self) -> NodeReadings:
        """Every GPU now: sensors, memory, utilization, processes, GPU-instance activity."""
        ...

    def close(self) -> None:
        """Release what the reader holds of the driver."""
        ...


class GpuBackend(Protocol):
    """The GPUs of one node."""

    device_files: DeviceFiles
    """Where each device's files are, for the CDI spec."""

    async def observe(self) -> NodeState:
        """Every GPU: identity, MIG mode (current and pending), instances, MIG UUIDs, busy."""
        ...

    async def set_mig_mode(self, gpu: GpuUuid, enabled: bool) -> bool:
        """Ask for MIG on or off; True when the change is pending until the GPU is reset."""
        ...

    async def set_compute_mode(self, gpu: GpuUuid, exclusive: bool) -> None:
        """Exclusive-process compute mode (for an MPS GPU) or the default one."""
        ...

    async def destroy_instance(self, gpu: GpuUuid, gi_id: int) -> None:
        """Destroy a GPU instance: its compute instances first, then the GPU instance."""
        ...

    async def create_instance(self, gpu: GpuUuid, profile: str, start: int) -> GpuInstance:
        """Create a GPU instance of `profile` at slice `start` with one compute instance spanning it.

        A GPU instance already at that placement with no compute instance (left half-built by a
        crash) is completed instead of failing.
        """
        ...

    def usage_reader(self) -> UsageReader:
        """A reader of what the GPUs are doing, for one thread of its own (the usage sampler); it
        asks the driver nothing until it is read."""
        ...

    def health_events(self) -> AsyncIterator[HealthEvent]:
        """Critical XIDs as they happen, attributed to a MIG device when the driver says which."""
        ...

    async def close(self) -> None:
        """Release the driver and the worker thread."""
        ...
