"""The node as observed: GPUs, their MIG instances, what is busy, and what the driver says. Frozen values.

Every GPU backend (NVML, simulated) produces these; the applier, inventory and labels consume them.
The driver is the authority on a GPU's MIG profiles (`Gpu.profiles`); the catalog fills in only
where a backend did not read them (`sharing.mig.geometry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

if TYPE_CHECKING:
    from sharing.mig import Product

GpuUuid = NewType("GpuUuid", str)
"""`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML reports it."""

MigUuid = NewType("MigUuid", str)
"""`MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`: one MIG device (a compute instance)."""

MAX_ERROR_CHARS = 300
"""Errors kept in observations are bounded: they end up in Events and logs."""


@dataclass(frozen=True, slots=True)
class ComputeInstance:
    """A compute instance inside a GPU instance; each one is a MIG device with its own UUID."""

    id: int
    uuid: MigUuid
    busy: bool = False
    mig_index: int | None = None
    """Its index among its GPU's MIG devices (nvmlDeviceGetMigDeviceHandleByIndex): `<gpu>:<this>`
    names it in NVIDIA_VISIBLE_DEVICES."""
    slices: int | None = None
    """The compute slices it spans (nvmlComputeInstanceGetInfo `placement.size`); None: not read."""
    processes: int = 0
    """How many compute processes NVML lists on it (0 while busy: they could not be read)."""
    multiprocessors: int | None = None
    """The streaming multiprocessors of its compute-instance profile (nvmlGpuInstanceGetComputeInstance
    ProfileInfo `multiprocessorCount`); None: not read."""

    def busy_beyond(self, idle_servers: int) -> bool:
        """Busy with more than `idle_servers` processes (idle MPS servers of the agent's own daemon)."""
        return beyond(self.busy, self.processes, idle_servers)


@dataclass(frozen=True, slots=True)
class GpuInstance:
    """A MIG GPU instance: its profile and the slots [start, start+size) it occupies."""

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
    processes: int = 0
    """How many compute processes NVML lists on the GPU itself (0 while busy: they could not be
    read, or they run on its MIG devices)."""
    numa_node: int | None = None
    pci_device_id: int | None = None
    """NVML's 32-bit pciDeviceId: device id in the high half, vendor in the low (0x20B010DE)."""
    pci_subsystem_id: int | None = None
    """NVML's pciSubSystemId: subsystem device in the high half, subsystem vendor in the low."""
    pci_class: int | None = None
    """The 24-bit PCI class code (0x030200 a 3D controller, 0x030000 a VGA controller)."""
    compute_capability: tuple[int, int] | None = None
    minor: int | None = None
    """The minor number of its device file, /dev/nvidia<minor> (nvmlDeviceGetMinorNumber)."""
    profiles: Product | None = None
    """The MIG profiles and placements the driver reports (None: no MIG, or not read)."""
    pci_bus_id: str | None = None
    """`0000:65:00.0`: NVML's busId as go-nvlib writes it (lower case, a 4-digit domain)."""
    brand: str | None = None
    """nvmlDeviceGetBrand as go-nvlib names it (`Nvidia`, `Tesla`); None when not read."""
    architecture: str | None = None
    """nvmlDeviceGetArchitecture as go-nvlib names it (`Ampere`, `Hopper`); None when not read."""

    def busy_beyond(self, idle_servers: int) -> bool:
        """Busy with more than `idle_servers` processes (idle MPS servers of the agent's own daemon)."""
        return beyond(self.busy, self.processes, idle_servers)

    @property
    def mig_devices(self) -> tuple[tuple[GpuInstance, ComputeInstance], ...]:
        """Every MIG device on this GPU with the GPU instance it belongs to."""
        return tuple((gi, ci) for gi in self.instances for ci in gi.compute_instances)


@dataclass(frozen=True, slots=True)
class UnreadableGpu:
    """A GPU the backend could count but not read (lost, fallen off the bus, driver error)."""

    index: int
    uuid: GpuUuid | None
    """Its UUID when it could be read now or was seen at this index before."""
    error: str
    """What NVML said, at most MAX_ERROR_CHARS characters."""


@dataclass(frozen=True, slots=True)
class DriverInfo:
    """The driver as NVML reports it (for the GPU-feature-discovery labels)."""

    version: str
    """nvmlSystemGetDriverVersion, e.g. `550.107.02`."""
    cuda_version: int | None = None
    """nvmlSystemGetCudaDriverVersion, e.g. 12050 for CUDA 12.5."""


@dataclass(frozen=True, slots=True)
class NodeState:
    """All readable GPUs of the node, ordered by index, and the ones that could not be read."""

    gpus: tuple[Gpu, ...]
    unreadable: tuple[UnreadableGpu, ...] = ()
    driver: DriverInfo | None = None
    machine: str | None = None
    """The machine's product name (DMI), as GPU feature discovery labels it."""
    virtual: bool = False
    """True inside a VM with NVIDIA vGPU (NVML virtualization mode VGPU)."""

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


def beyond(busy: bool, processes: int, idle_servers: int) -> bool:
    """Whether a device runs processes other than `idle_servers` MPS servers without clients.

    An MPS server is a compute process of its device while it lives ("nvidia-smi/NVML list
    nvidia-cuda-mps-server as the active process", https://docs.nvidia.com/deploy/topics/topic_5_1_2.html),
    and it lives on after its last client until its daemon quits: NVIDIA documents a server ending once
    its clients are done only when a client of another user waits (nvidia-cuda-mps-control(1),
    https://manpages.ubuntu.com/manpages/noble/man1/nvidia-cuda-mps-control.1.html). The count, not
    the PIDs, is compared: NVML's PIDs and the daemon's need not be of the same PID namespace. A busy
    device with no count (they could not be read) is in use.
    """
    return busy and (processes == 0 or processes > idle_servers)


def bounded(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters, saying so."""
    return text if len(text) <= limit else text[: limit - 15] + " ... (truncated)"


@dataclass(frozen=True, slots=True)
class Holding:
    """One container's devices of one resource, as the kubelet's PodResources lists them."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: frozenset[str]


@dataclass(frozen=True, slots=True)
class Listing:
    """What the kubelet's PodResources List answered."""

    pods: frozenset[str] = frozenset()
    """`namespace/name` of every pod it lists, whether or not it holds devices."""
    holdings: tuple[Holding, ...] = ()


@dataclass(frozen=True, slots=True)
class BoundPod:
    """A pod the API server has bound to this node, or that the scheduler is binding to it
    (`bound` False: `status.nominatedNodeName`), that has not ended (phase neither Succeeded nor Failed)."""

    namespace: str
    name: str
    resources: frozenset[str]
    """The resources its containers (init containers too) request or limit."""
    claims: tuple[str, ...] = ()
    """The ResourceClaims (in its namespace) it uses, as far as it names them: `spec.resourceClaims`
    by name, the claims made from its templates (`status.resourceClaimStatuses`) and the claim of its
    extended resources served through DRA (`status.extendedResourceClaimStatus`)."""
    bound: bool = True
    extended_claim: bool = False
    """`status.extendedResourceClaimStatus` names a claim."""
    uid: str = ""
    containers: tuple[tuple[str, str], ...] = ()
    """(container ID without the runtime's `containerd://`, name) of each container that has started
    (`status.containerStatuses`, init containers too): how a process's cgroup names its container."""


@dataclass(frozen=True, slots=True)
class ClaimAllocation:
    """A ResourceClaim the scheduler allocated devices of one driver's pool to (resource.k8s.io/v1
    `status.allocation.devices.results`), and the pods it is reserved for (`status.reservedFor`)."""

    namespace: str
    name: str
    uid: str
    devices: tuple[str, ...]
    """The names of the pool's devices allocated to it."""
    pods: tuple[str, ...] = ()
    """`namespace/name` of the pods using it."""


@dataclass(frozen=True, slots=True)
class ClaimHold:
    """One claim and the GPU and MIG device UUIDs its allocation holds."""

    namespace: str
    name: str
    pods: tuple[str, ...]
    uuids: frozenset[str]

    def describe(self) -> str:
        """`claim ns/name` with the pods using it, for Events."""
        used = f" (pod {', '.join(self.pods)})" if self.pods else " (no pod yet)"
        return f"claim {self.namespace}/{self.name}{used}"
