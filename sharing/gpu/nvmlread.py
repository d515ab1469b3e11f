"""The read side of NVML: the node's GPUs, MIG instances and devices, observed without changing anything.

Synchronous, over the typed NVML surface (the real `pynvml`), called by
`NvmlBackend` on its worker thread. It copes with NVML's read quirks: the caller allocates the
arrays GetGpuInstances and GetComputeInstances fill (and NVML under-reports some counts), MIG device
indices have holes (nvmlDeviceGetMigDeviceHandleByIndex: NOT_FOUND "if no valid MIG device was found
at index", so a handle it returns is a MIG device's), GPUs without MIG answer NOT_SUPPORTED, old
drivers lack nvmlDeviceGetPciInfoExt. Each GPU is read on its own: one whose reads fail (lost,
fallen off the bus) is reported as unreadable and the others as usual.

What cannot change is read once per GPU (`Known`, by UUID): its identity (name, PCI ids and bus,
class, compute capability, minor, brand, architecture: the board's and its slot's, for a UUID that
nvml.h calls "globally unique immutable"), its MIG profile table and the compute-instance profiles
each GPU-instance profile offers ("Information provided by this API is immutable throughout the
lifetime of a MIG mode", nvml.h on nvmlDeviceGetGpuInstanceProfileInfo and
nvmlGpuInstanceGetComputeInstanceProfileInfo). What the hardware does now is read on every
observation: MIG mode, instances, MIG devices and their UUIDs, processes, memory. A GPU's entry is
dropped when its MIG mode changes, when it cannot be read, when the backend changes its MIG mode or
sees an event of it (an XID, a reset's recovery), and all of them when the driver's version changes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sharing.errors import BackendError
from sharing.gpu.backend import GpuNotFoundError
from sharing.gpu.nvmlapi import Handle, Nvml, code
from sharing.gpu.nvmlprofiles import read_table, with_identity
from sharing.mig import MIB, Product
from sharing.model import (
    ComputeInstance,
    DriverInfo,
    Gpu,
    GpuInstance,
    GpuUuid,
    MigUuid,
    NodeState,
    UnreadableGpu,
    bounded,
)

MigDevices = dict[tuple[int, int], tuple[MigUuid, int | None, int | None]]

# nvml.h nvmlBrandType_t and NVML_DEVICE_ARCH_* as go-nvlib names them (pkg/nvlib/device/device.go,
# GetBrandAsString, GetArchitectureAsString): the strings NVIDIA's DRA driver publishes.
BRANDS = {0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
          7: "NvidiaVApps", 8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming",
          12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX"}  # fmt: skip
ARCHITECTURES = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
                 8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell", 13: "Rubin",
                 0xFFFFFFFF: "Unknown"}  # fmt: skip


class NoMigDeviceError(BackendError):
    """A compute instance with no MIG device: its GPU is reported unreadable (nothing of it is used)."""


CiProfiles = tuple[tuple[int, int, int], ...]
"""(profile id, instance count, multiprocessors) of each compute-instance profile a GPU instance offers."""


@dataclass
class Known:
    """What is kept of one GPU between reads: only what cannot change while its MIG mode holds."""

    identity: Gpu | None = None
    """The GPU as read once at its index, every field that changes left at its default."""
    mig_mode: int | None = None
    """The current MIG mode the entry was read under."""
    table: Product | None = None
    """Its MIG profiles, once the driver lists any."""
    ci_profiles: dict[int, CiProfiles] = field(default_factory=dict)
    """Per GPU-instance profile id: the compute-instance profiles it offers."""


class NvmlReader:
    """Observes GPUs through NVML; keeps what cannot change of each GPU (`Known`)."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self._known: dict[str, Known] = {}
        self._uuids: dict[int, GpuUuid] = {}
        self._driver: DriverInfo | None = None

    def forget(self, uuid: str) -> None:
        """Read everything of this GPU again (its MIG mode was changed, it was reset or reported an XID)."""
        self._known.pop(uuid, None)

    def known(self, uuid: str) -> Known:
        """What is kept of this GPU (an empty entry when nothing is yet)."""
        return self._known.setdefault(uuid, Known())

    def find(self, uuid: str) -> tuple[Handle, str]:
        """(handle, description) of the GPU with this UUID; GpuNotFoundError when there is none.

        Where it was last seen is tried first, and its UUID read again there."""
        n = self._nvml
        for index, seen in self._uuids.items():
            if seen == uuid:
                try:
                    handle = n.nvmlDeviceGetHandleByIndex(index)
                    if n.nvmlDeviceGetUUID(handle) == uuid:
                        return handle, f"GPU {index} ({uuid})"
                except n.NVMLError:
                    pass  # gone from there: every GPU is asked below
                break
        for index in range(n.nvmlDeviceGetCount()):
            handle = n.nvmlDeviceGetHandleByIndex(index)
            try:
                if n.nvmlDeviceGetUUID(handle) == uuid:
                    return handle, f"GPU {index} ({uuid})"
            except n.NVMLError:
                continue  # an unreadable GPU is not the one asked for
        raise GpuNotFoundError(f"no readable GPU with UUID {uuid} on this node (see `sharing export`)")

    def table(self, handle: Handle, uuid: str) -> Product | None:
        """The GPU's MIG profiles as its driver reports them; None when the driver lists none now.

        Old drivers (R535) list none while MIG is off, and the catalog fills in (model.geometry):
        only a non-empty table is kept, so the driver's own is read once MIG is on."""
        known = self.known(uuid)
        if known.table is None:
            n = self._nvml
            table = read_table(n, handle, n.nvmlDeviceGetName(handle))
            if not table.profiles:
                return None
            pci = n.nvmlDeviceGetPciInfo(handle).pciDeviceId
            capability = n.nvmlDeviceGetCudaComputeCapability(handle)
            known.table = with_identity(table, pci, capability)
        return known.table

    def gpu_instances(self, handle: Handle, profile_id: int, max_count: int) -> list[Handle]:
        n = self._nvml
        # Over-allocate: NVML under-reports instanceCount on some products (A30).
        array = (n.c_nvmlGpuInstance_t * max(max_count, 8))()
        count = ctypes.c_uint(0)
        n.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
        return list(array[: count.value])

    def ci_profiles(self, gi: Handle) -> CiProfiles:
        """The compute-instance profiles a GPU instance offers (every enum is asked)."""
        n = self._nvml
        found = []
        for enum in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, enum, n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except n.NVMLError as err:
                if code(err) in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            found.append((info.id, info.instanceCount, info.multiprocessorCount))
        return tuple(found)

    def compute_instances(self, gi: Handle, profiles: CiProfiles | None = None) -> list[Handle]:
        """The GPU instance's compute instances, of `profiles` (default: every profile it offers)."""
        n = self._nvml
        found: list[Handle] = []
        for profile_id, max_count, _ in self.ci_profiles(gi) if profiles is None else profiles:
            array = (n.c_nvmlComputeInstance_t * max(max_count, 8))()
            count = ctypes.c_uint(0)
            n.nvmlGpuInstanceGetComputeInstances(gi, profile_id, array, ctypes.byref(count))
            found.extend(array[: count.value])
        return found

    def compute_instances_of(self, uuid: str, gi: Handle, gi_profile: int | None = None) -> list[Handle]:
        """The compute instances of a GPU instance of GPU `uuid` (of profile `gi_profile`, read when
        not given); the compute-instance profiles are asked once per GPU-instance profile (`Known`)."""
        return self.compute_instances(gi, self.ci_profiles_of(uuid, gi, gi_profile))

    def ci_profiles_of(self, uuid: str, gi: Handle, gi_profile: int | None = None) -> CiProfiles:
        """The compute-instance profiles a GPU instance of GPU `uuid` offers, asked once per
        GPU-instance profile (`Known`)."""
        if gi_profile is None:
            gi_profile = self._nvml.nvmlGpuInstanceGetInfo(gi).profileId
        known = self.known(uuid)
        profiles = known.ci_profiles.get(gi_profile)
        if profiles is None:
            profiles = known.ci_profiles[gi_profile] = self.ci_profiles(gi)
        return profiles

    def mig_handles(self, handle: Handle) -> Iterator[tuple[int, Handle]]:
        """(MIG device index, handle) of each MIG device of the GPU; indices may have holes."""
        n = self._nvml
        for index in range(n.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                yield index, n.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except n.NVMLError as err:
                if code(err) not in (n.NVML_ERROR_NOT_FOUND, n.NVML_ERROR_INVALID_ARGUMENT):
                    raise

    def mig_devices(self, handle: Handle) -> MigDevices:
        """(GI id, CI id) -> (MIG UUID, its processes, MIG device index) per MIG device."""
        n = self._nvml
        devices: MigDevices = {}
        for index, mig in self.mig_handles(handle):
            key = (n.nvmlDeviceGetGpuInstanceId(mig), n.nvmlDeviceGetComputeInstanceId(mig))
            devices[key] = (MigUuid(n.nvmlDeviceGetUUID(mig)), self.mig_processes(mig), index)
        return devices

    def mig_device(self, handle: Handle, gi_id: int, ci_id: int) -> tuple[MigUuid, int | None, int] | None:
        """(MIG UUID, its processes, MIG device index) of one compute instance's MIG device; None when none is
        enumerated. The devices before it are asked for their two IDs only; its UUID and processes alone
        are read. NVIDIA measured a walk that reads every MIG device after a create at "O(10 s)" under
        load (https://github.com/NVIDIA/k8s-dra-driver-gpu/blob/main/cmd/gpu-kubelet-plugin/nvlib.go,
        createMigDevice). NVML has no call from (GPU, GI, CI) to the MIG device ("there is unfortunately
        no direct NVML API for that", https://github.com/NVIDIA/go-nvml/issues/57), and
        nvmlComputeInstanceGetInfo's `device` is the parent GPU (nvml.h), so the walk by index stays,
        reading as little as it can."""
        n = self._nvml
        for index, mig in self.mig_handles(handle):
            if (n.nvmlDeviceGetGpuInstanceId(mig), n.nvmlDeviceGetComputeInstanceId(mig)) == (gi_id, ci_id):
                return MigUuid(n.nvmlDeviceGetUUID(mig)), self.mig_processes(mig), index
        return None

    def mig_processes(self, mig: Handle) -> int | None:
        """How many processes run on a MIG device; None when they cannot be read (NO_PERMISSION, an
        unprivileged container): what cannot be seen counts as in use, so it is never destroyed."""
        n = self._nvml
        try:
            return len(n.nvmlDeviceGetComputeRunningProcesses(mig))
        except n.NVMLError as err:
            if code(err) == n.NVML_ERROR_NO_PERMISSION:
                return None
            raise

    def instance(self, gi: Handle, profile: str, migs: MigDevices, uuid: str | None = None) -> GpuInstance:
        """The GPU instance, with its compute instances and their MIG devices (`migs`); with the GPU's
        UUID, its compute-instance profiles are the ones kept (`compute_instances_of`)."""
        n = self._nvml
        info = n.nvmlGpuInstanceGetInfo(gi)
        cis = []
        profiles = self.ci_profiles(gi) if uuid is None else self.ci_profiles_of(uuid, gi, info.profileId)
        multiprocessors = {profile: count for profile, _, count in profiles}
        for ci in self.compute_instances(gi, profiles):
            ci_info = n.nvmlComputeInstanceGetInfo(ci)
            found = migs.get((info.id, ci_info.id))
            cis.append(compute_instance(info.id, ci_info, found, multiprocessors.get(ci_info.profileId)))
        return GpuInstance(
            id=info.id,
            profile=profile,
            start=info.placement.start,
            size=info.placement.size,
            compute_instances=tuple(sorted(cis, key=lambda c: c.id)),
        )

    # ---- observe -----------------------------------------------------------------------------

    def observe(self) -> NodeState:
        """Every GPU; only a failure to count the GPUs fails the whole observation."""
        n = self._nvml
        gpus: list[Gpu] = []
        unreadable: list[UnreadableGpu] = []
        virtual = False
        count = n.nvmlDeviceGetCount()
        driver = self.driver()
        if driver != self._driver:  # another driver: nothing read of the last one holds
            self._known.clear()
            self._driver = driver
        for index in range(count):
            try:
                gpu, vgpu = self.observe_gpu(index)
            except (n.NVMLError, NoMigDeviceError) as err:
                uuid = self._uuids.get(index)
                if uuid is not None:
                    self.forget(uuid)
                error = f"NVML error {code(err)}: {err}" if isinstance(err, n.NVMLError) else str(err)
                unreadable.append(UnreadableGpu(index, uuid, bounded(error)))
                continue
            gpus.append(gpu)
            virtual = virtual or vgpu
        return NodeState(tuple(gpus), tuple(unreadable), driver, virtual=virtual)

    def driver(self) -> DriverInfo | None:
        """The driver and CUDA versions; None when NVML does not say."""
        n = self._nvml
        try:
            version = n.nvmlSystemGetDriverVersion()
        except n.NVMLError:
            return None
        try:
            cuda: int | None = n.nvmlSystemGetCudaDriverVersion()
        except n.NVMLError:
            cuda = None
        return DriverInfo(version, cuda)

    def observe_gpu(self, index: int) -> tuple[Gpu, bool]:
        """One GPU, and whether it is a vGPU (inside a VM)."""
        n = self._nvml
        handle = n.nvmlDeviceGetHandleByIndex(index)
        uuid = GpuUuid(n.nvmlDeviceGetUUID(handle))
        self._uuids[index] = uuid
        known = self.known(uuid)
        identity = known.identity
        if identity is None or identity.index != index:  # the bus id and the minor are the slot's
            identity = self.identity(handle, uuid, index)
            known = self._known[uuid] = Known(identity=identity)
        # Memory is read each time: the ECC mode (set, then applied by a reset) changes the total.
        base = replace(identity, memory_mib=n.nvmlDeviceGetMemoryInfo(handle).total // MIB)
        vgpu = self.virtual(handle)
        try:
            current, pending = n.nvmlDeviceGetMigMode(handle)
        except n.NVMLError as err:
            if code(err) != n.NVML_ERROR_NOT_SUPPORTED:
                raise
            count = self.processes(handle)
            return replace(base, busy=count > 0, processes=count), vgpu
        if known.mig_mode != current:  # profiles hold for "the lifetime of a MIG mode" (nvml.h)
            self._known[uuid] = Known(identity=identity, mig_mode=current)
        table = self.table(handle, uuid)
        enabled = current == n.NVML_DEVICE_MIG_ENABLE
        count = self.processes(handle)
        busy = count > 0
        gpu = replace(base, mig_capable=True, mig_enabled=enabled, processes=count,
                      mig_pending=pending == n.NVML_DEVICE_MIG_ENABLE, busy=busy, profiles=table)  # fmt: skip
        if not enabled or table is None:
            return gpu, vgpu
        migs = self.mig_devices(handle)
        instances = [
            self.instance(gi, profile.name, migs, uuid)
            for profile in table.profiles
            for gi in self.gpu_instances(handle, profile.id, profile.max_count)
        ]
        instances.sort(key=lambda g: (g.start, g.id))
        return replace(gpu, instances=tuple(instances), busy=busy or any(gi.busy for gi in instances)), vgpu

    def identity(self, handle: Handle, uuid: GpuUuid, index: int) -> Gpu:
        """What the GPU at `index` is, read once (`Known`): the fields that change left at their defaults."""
        n = self._nvml
        pci = n.nvmlDeviceGetPciInfo(handle)
        return Gpu(
            index,
            uuid,
            n.nvmlDeviceGetName(handle),
            0,
            mig_capable=False,
            mig_enabled=False,
            mig_pending=False,
            pci_device_id=pci.pciDeviceId,
            pci_subsystem_id=pci.pciSubSystemId,
            pci_class=self.pci_class(handle),
            compute_capability=_capability(n.nvmlDeviceGetCudaComputeCapability(handle)),
            minor=n.nvmlDeviceGetMinorNumber(handle),
            pci_bus_id=bus_id(pci.busId),
            brand=self.named(n.nvmlDeviceGetBrand, handle, BRANDS),
            architecture=self.named(n.nvmlDeviceGetArchitecture, handle, ARCHITECTURES),
        )

    def pci_class(self, handle: Handle) -> int | None:
        """The PCI class code (0x030200), from nvmlDeviceGetPciInfoExt; None on drivers without it."""
        n = self._nvml
        info = n.nvmlPciInfoExt_v1_t()
        info.version = n.nvmlPciInfoExt_v1
        try:
            n.nvmlDeviceGetPciInfoExt(handle, ctypes.byref(info))
        except n.NVMLError as err:
            if code(err) in (n.NVML_ERROR_FUNCTION_NOT_FOUND, n.NVML_ERROR_NOT_SUPPORTED,
                             n.NVML_ERROR_INVALID_ARGUMENT):  # fmt: skip
                return None
            raise
        return info.baseClass << 16 | info.subClass << 8

    def virtual(self, handle: Handle) -> bool:
        """True when the GPU is a vGPU inside a virtual machine."""
        n = self._nvml
        try:
            mode = n.nvmlDeviceGetVirtualizationMode(handle)
        except n.NVMLError:
            return False
        return mode == n.NVML_GPU_VIRTUALIZATION_MODE_VGPU

    def named(self, read: Callable[[Handle], int], handle: Handle, names: Mapping[int, str]) -> str | None:
        """An NVML enum as go-nvlib names it; None when this driver cannot say (NOT_SUPPORTED, an older
        library without the function) or says something go-nvlib has no name for."""
        n = self._nvml
        try:
            return names.get(read(handle))
        except n.NVMLError as err:
            if code(err) in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            raise

    def processes(self, handle: Handle) -> int:
        """How many processes NVML lists on the GPU (0 when the list needs privileges it lacks)."""
        n = self._nvml
        try:
            return len(n.nvmlDeviceGetComputeRunningProcesses(handle))
        except n.NVMLError as err:
            # In MIG mode the parent's aggregate list needs privileges; the MIG devices are asked too.
            if code(err) in (n.NVML_ERROR_NO_PERMISSION, n.NVML_ERROR_NOT_SUPPORTED):
                return 0
            raise


def bus_id(raw: bytes | str) -> str | None:
    """NVML's busId (`00000000:65:00.0`) as go-nvlib writes it (`0000:65:00.0`: lower case, the domain's
    leading 4 zeros dropped; go-nvlib pkg/nvlib/device/device.go, GetPCIBusID); None when empty."""
    text = (raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw).split("\x00")[0].lower()
    if len(text) > 4 and text[:4] == "0000" and text[8:9] == ":":
        text = text[4:]
    return text or None


def _capability(value: tuple[int, int]) -> tuple[int, int] | None:
    major, minor = value
    return None if major == 0 else (major, minor)


def compute_instance(
    gi_id: int,
    ci_info: Any,
    found: tuple[MigUuid, int | None, int | None] | None,
    multiprocessors: int | None = None,
) -> ComputeInstance:
    """A compute instance (`nvmlComputeInstanceGetInfo`) with its MIG device (`found`: UUID, processes,
    index) and its profile's multiprocessors; NoMigDeviceError when it has none. ci_info.device is the
    PARENT GPU (nvml.h nvmlComputeInstanceInfo_st: "Parent device"), never the MIG device: its UUID
    would hand the whole GPU out, so there is no stand-in. Fail closed."""
    ci_id, slices = ci_info.id, ci_info.placement.size
    if found is None:
        raise NoMigDeviceError(
            f"compute instance {ci_id} of GPU instance {gi_id} has no MIG device "
            "(nvmlDeviceGetMigDeviceHandleByIndex lists none): the GPU is not used until it has"
        )
    uuid, processes, index = found
    return ComputeInstance(id=ci_id, uuid=uuid, busy=processes != 0, mig_index=index,
                           processes=processes or 0, slices=slices,
                           multiprocessors=multiprocessors)  # fmt: skip
