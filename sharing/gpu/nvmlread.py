"""The read side of NVML: the node's GPUs, MIG instances and devices, observed without changing anything.

Synchronous, over the typed NVML surface (the real `pynvml`), called by
`NvmlBackend` on its worker thread. It copes with NVML's read quirks: the caller allocates the
arrays GetGpuInstances and GetComputeInstances fill (and NVML under-reports some counts),
nvmlDeviceIsMigDeviceHandle returns a ctypes value, MIG device indices have holes, GPUs without MIG
answer NOT_SUPPORTED, old drivers lack nvmlDeviceGetPciInfoExt. Each GPU is read on its own: one
whose reads fail (lost, fallen off the bus) is reported as unreadable and the others as usual.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import replace

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


class NvmlReader:
    """Observes GPUs through NVML; caches each GPU's profile table once the driver lists one."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self._tables: dict[str, Product | None] = {}
        self._uuids: dict[int, GpuUuid] = {}

    def find(self, uuid: str) -> tuple[Handle, str]:
        """(handle, description) of the GPU with this UUID; GpuNotFoundError when there is none."""
        n = self._nvml
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
        if uuid not in self._tables:
            n = self._nvml
            table = read_table(n, handle, n.nvmlDeviceGetName(handle))
            if not table.profiles:
                return None
            pci = n.nvmlDeviceGetPciInfo(handle).pciDeviceId
            capability = n.nvmlDeviceGetCudaComputeCapability(handle)
            self._tables[uuid] = with_identity(table, pci, capability)
        return self._tables[uuid]

    def gpu_instances(self, handle: Handle, profile_id: int, max_count: int) -> list[Handle]:
        n = self._nvml
        # Over-allocate: NVML under-reports instanceCount on some products (A30).
        array = (n.c_nvmlGpuInstance_t * max(max_count, 8))()
        count = ctypes.c_uint(0)
        n.nvmlDeviceGetGpuInstances(handle, profile_id, array, ctypes.byref(count))
        return list(array[: count.value])

    def compute_instances(self, gi: Handle) -> list[Handle]:
        n = self._nvml
        found: list[Handle] = []
        for enum in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, enum, n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except n.NVMLError as err:
                if code(err) in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            array = (n.c_nvmlComputeInstance_t * max(info.instanceCount, 8))()
            count = ctypes.c_uint(0)
            n.nvmlGpuInstanceGetComputeInstances(gi, info.id, array, ctypes.byref(count))
            found.extend(array[: count.value])
        return found

    def mig_devices(self, handle: Handle) -> MigDevices:
        """(GI id, CI id) -> (MIG UUID, its processes, MIG device index) per MIG device; indices may
        have holes."""
        n = self._nvml
        devices: MigDevices = {}
        for index in range(n.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = n.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except n.NVMLError as err:
                if code(err) in (n.NVML_ERROR_NOT_FOUND, n.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            if not _truthy(n.nvmlDeviceIsMigDeviceHandle(mig)):
                continue
            key = (n.nvmlDeviceGetGpuInstanceId(mig), n.nvmlDeviceGetComputeInstanceId(mig))
            devices[key] = (MigUuid(n.nvmlDeviceGetUUID(mig)), self.mig_processes(mig), index)
        return devices

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

    def instance(self, gi: Handle, profile: str, migs: MigDevices) -> GpuInstance:
        n = self._nvml
        info = n.nvmlGpuInstanceGetInfo(gi)
        cis = []
        for ci in self.compute_instances(gi):
            ci_info = n.nvmlComputeInstanceGetInfo(ci)
            found = migs.get((info.id, ci_info.id))
            if found is None:
                # ci_info.device is the PARENT GPU (nvml.h nvmlComputeInstanceInfo_st: "Parent
                # device"), never the MIG device: its UUID would hand the whole GPU out. Fail closed.
                raise NoMigDeviceError(
                    f"compute instance {ci_info.id} of GPU instance {info.id} has no MIG device "
                    "(nvmlDeviceGetMigDeviceHandleByIndex lists none): the GPU is not used until it has"
                )
            uuid, processes, index = found
            cis.append(ComputeInstance(id=ci_info.id, uuid=uuid, busy=processes != 0, mig_index=index,
                                       processes=processes or 0))  # fmt: skip
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
        for index in range(n.nvmlDeviceGetCount()):
            try:
                gpu, vgpu = self.observe_gpu(index)
            except n.NVMLError as err:
                unreadable.append(
                    UnreadableGpu(index, self._uuids.get(index), bounded(f"NVML error {code(err)}: {err}"))
                )
                continue
            except NoMigDeviceError as err:
                unreadable.append(UnreadableGpu(index, self._uuids.get(index), bounded(str(err))))
                continue
            self._uuids[index] = gpu.uuid
            gpus.append(gpu)
            virtual = virtual or vgpu
        return NodeState(tuple(gpus), tuple(unreadable), self.driver(), virtual=virtual)

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
        pci = n.nvmlDeviceGetPciInfo(handle)
        base = Gpu(
            index,
            uuid,
            n.nvmlDeviceGetName(handle),
            n.nvmlDeviceGetMemoryInfo(handle).total // MIB,
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
        vgpu = self.virtual(handle)
        try:
            current, pending = n.nvmlDeviceGetMigMode(handle)
        except n.NVMLError as err:
            if code(err) != n.NVML_ERROR_NOT_SUPPORTED:
                raise
            count = self.processes(handle)
            return replace(base, busy=count > 0, processes=count), vgpu
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
            self.instance(gi, profile.name, migs)
            for profile in table.profiles
            for gi in self.gpu_instances(handle, profile.id, profile.max_count)
        ]
        instances.sort(key=lambda g: (g.start, g.id))
        return replace(gpu, instances=tuple(instances), busy=busy or any(gi.busy for gi in instances)), vgpu

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


def _truthy(value: object) -> bool:
    """NVML booleans arrive as ints or as ctypes values (nvmlDeviceIsMigDeviceHandle)."""
    return bool(getattr(value, "value", value))
