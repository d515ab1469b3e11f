"""The node as observed: GPUs, their MIG instances and what is busy. Frozen values, no behaviour.

Every GPU backend (NVML, simulated) produces these; the applier, inventory and labels consume them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

GpuUuid = NewType("GpuUuid", str)
"""`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML reports it."""

MigUuid = NewType("MigUuid", str)
"""`MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`: one MIG device (a compute instance)."""


@dataclass(frozen=True, slots=True)
class ComputeInstance:
    """A compute instance inside a GPU instance; each one is a MIG device with its own UUID."""

    id: int
    uuid: MigUuid
    busy: bool = False


@dataclass(frozen=True, slots=True)
class GpuInstance:
    """A MIG GPU instance: its profile and the memory slices [start, start+size) it occupies."""

    id: int
    profile: str
    start: int
    size: int
    compute_instances: tuple[ComputeInstance, ...] = ()

    @property
    def busy(self) -> bool:
        """True when any of its MIG devices has work on it."""
        return any(ci.busy for ci in self.compute_instances)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU as observed."""

    index: int
    uuid: GpuUuid
    product: str
    """The NVML product name, e.g. `NVIDIA A100-SXM4-40GB`."""
    memory_mib: int
    mig_capable: bool
    mig_enabled: bool
    """Current MIG mode."""
    mig_pending: bool
    """Pending MIG mode: differs from mig_enabled until the GPU is reset."""
    instances: tuple[GpuInstance, ...] = ()
    busy: bool = False
    """Processes run on the GPU itself (MIG disabled) or on any of its MIG devices."""
    numa_node: int | None = None

    @property
    def mig_devices(self) -> tuple[tuple[GpuInstance, ComputeInstance], ...]:
        """Every MIG device on this GPU with the GPU instance it belongs to."""
        return tuple((gi, ci) for gi in self.instances for ci in gi.compute_instances)


@dataclass(frozen=True, slots=True)
class UnreadableGpu:
    """A GPU the backend could not read (e.g. lost): the others are observed regardless."""

    index: int
    uuid: GpuUuid | None
    error: str


@dataclass(frozen=True, slots=True)
class NodeState:
    """All GPUs of the node, ordered by index; those that could not be read are listed apart."""

    gpus: tuple[Gpu, ...]
    unreadable: tuple[UnreadableGpu, ...] = ()

    def gpu(self, uuid: str) -> Gpu | None:
        """The GPU with this UUID, or None."""
        return next((g for g in self.gpus if g.uuid == uuid), None)


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A change of health reported by a backend: an XID on a GPU (optionally one MIG device), or recovery."""

    gpu_uuid: GpuUuid
    healthy: bool
    xid: int | None = None
    mig_uuid: MigUuid | None = None
    """The affected MIG device when NVML attributes the event to one; None means the whole GPU."""
