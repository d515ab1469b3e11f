"""The read side of NVML: the node's GPUs, MIG instances and devices, observed without changing anything.

Synchronous, over a pynvml-shaped module object (the real `pynvml` or the simulated one), called by
`NvmlBackend` on its worker thread. It copes with NVML's read quirks: the caller allocates the arrays
GetGpuInstances, the placement query and GetComputeInstances fill (and NVML under-reports some
counts), nvmlDeviceIsMigDeviceHandle returns a ctypes value, MIG device indices have holes, and
GPUs without MIG answer NOT_SUPPORTED. Profile names are derived from NVML's numbers the way
NVIDIA's tools derive them, and checked against the hardware catalog. NVML errors propagate.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from sharing.catalog import MIB, Catalog
from sharing.gpu.backend import GpuNotFoundError
from sharing.gpu.naming import gi_profile_name
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState


@dataclass(frozen=True, slots=True)
class NvmlProfile:
    """A GPU-instance profile as the driver reports it on one GPU."""

    name: str
    """The name used everywhere: the catalog's for this profile id when the catalog knows the GPU."""
    derived_name: str
    """The name derived from NVML's numbers the way NVIDIA's tools do."""
    id: int
    enum: int
    compute_slices: int
    max_count: int
    memory_mib: int
    size: int
    placements: tuple[int, ...]


class NvmlReader:
    """Observes GPUs through NVML; caches each GPU's profiles (they never change)."""

    def __init__(self, nvml: Any, catalog: Catalog) -> None:
        self._nvml = nvml
        self._catalog = catalog
        self._profiles: dict[str, tuple[NvmlProfile, ...]] = {}
        self.profile_mismatches: set[str] = set()
        """Profiles whose NVIDIA-derived name differs from the catalog's (the catalog name is used)."""

    def find(self, uuid: str) -> tuple[Any, str]:
        n = self._nvml
        for index in range(n.nvmlDeviceGetCount()):
            handle = n.nvmlDeviceGetHandleByIndex(index)
            if n.nvmlDeviceGetUUID(handle) == uuid:
                return handle, f"GPU {index} ({uuid})"
        raise GpuNotFoundError(f"no GPU with UUID {uuid} on this node (see `sharing export`)")

    def gi_profiles(self, handle: Any, uuid: str) -> tuple[NvmlProfile, ...]:
        cached = self._profiles.get(uuid)
        if cached is not None:
            return cached
        n = self._nvml
        name = n.nvmlDeviceGetName(handle)
        total_mib = n.nvmlDeviceGetMemoryInfo(handle).total // MIB
        product = self._catalog.find(name)
        found = []
        for enum in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = n.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum)
            except n.NVMLError as err:
                if err.value in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            derived = gi_profile_name(enum, info.sliceCount, info.memorySizeMB, total_mib)
            known = None if product is None else next((p for p in product.profiles if p.id == info.id), None)
            if known is not None and known.name != derived:
                self.profile_mismatches.add(
                    f"{product.name if product else name} profile id {info.id}: "
                    f"NVML gives {derived}, the catalog says {known.name}"
                )
            placements = self.placements(handle, info.id)
            found.append(
                NvmlProfile(
                    name=derived if known is None else known.name,
                    derived_name=derived,
                    id=info.id,
                    enum=enum,
                    compute_slices=info.sliceCount,
                    max_count=info.instanceCount,
                    memory_mib=info.memorySizeMB,
                    size=placements[0][1] if placements else 0,
                    placements=tuple(s for s, _ in placements),
                )
            )
        self._profiles[uuid] = tuple(found)
        return self._profiles[uuid]

    def placements(self, handle: Any, profile_id: int) -> list[tuple[int, int]]:
        n = self._nvml
        count = ctypes.c_uint(0)
        n.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
        array = (n.c_nvmlGpuInstancePlacement_t * count.value)()
        n.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
        return [(p.start, p.size) for p in array[: count.value]]

    def gpu_instances(self, handle: Any, profile: NvmlProfile) -> list[Any]:
        n = self._nvml
        # Over-allocate: NVML under-reports instanceCount on some products (A30).
        array = (n.c_nvmlGpuInstance_t * max(profile.max_count, 8))()
        count = ctypes.c_uint(0)
        n.nvmlDeviceGetGpuInstances(handle, profile.id, array, ctypes.byref(count))
        return list(array[: count.value])

    def compute_instances(self, gi: Any) -> list[Any]:
        n = self._nvml
        found = []
        for enum in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, enum, n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except n.NVMLError as err:
                if err.value in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            array = (n.c_nvmlComputeInstance_t * max(info.instanceCount, 8))()
            count = ctypes.c_uint(0)
            n.nvmlGpuInstanceGetComputeInstances(gi, info.id, array, ctypes.byref(count))
            found.extend(array[: count.value])
        return found

    def mig_devices(self, handle: Any) -> dict[tuple[int, int], tuple[MigUuid, bool]]:
        """(GI id, CI id) -> (MIG UUID, busy) for every MIG device; indices may have holes."""
        n = self._nvml
        devices = {}
        for index in range(n.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = n.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except n.NVMLError as err:
                if err.value in (n.NVML_ERROR_NOT_FOUND, n.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise
            if not _truthy(n.nvmlDeviceIsMigDeviceHandle(mig)):
                continue
            key = (n.nvmlDeviceGetGpuInstanceId(mig), n.nvmlDeviceGetComputeInstanceId(mig))
            devices[key] = (
                MigUuid(n.nvmlDeviceGetUUID(mig)),
                bool(n.nvmlDeviceGetComputeRunningProcesses(mig)),
            )
        return devices

    def instance(
        self, gi: Any, profile: NvmlProfile, migs: dict[tuple[int, int], tuple[MigUuid, bool]]
    ) -> GpuInstance:
        n = self._nvml
        info = n.nvmlGpuInstanceGetInfo(gi)
        cis = []
        for ci in self.compute_instances(gi):
            ci_info = n.nvmlComputeInstanceGetInfo(ci)
            uuid_busy = migs.get((info.id, ci_info.id))
            if uuid_busy is None:  # not enumerated as a MIG device: ask the CI's own handle
                device = ci_info.device
                uuid_busy = (
                    MigUuid(n.nvmlDeviceGetUUID(device)),
                    bool(n.nvmlDeviceGetComputeRunningProcesses(device)),
                )
            cis.append(ComputeInstance(id=ci_info.id, uuid=uuid_busy[0], busy=uuid_busy[1]))
        return GpuInstance(
            id=info.id,
            profile=profile.name,
            start=info.placement.start,
            size=info.placement.size,
            compute_instances=tuple(sorted(cis, key=lambda c: c.id)),
        )

    # ---- observe -----------------------------------------------------------------------------

    def observe(self) -> NodeState:
        n = self._nvml
        return NodeState(tuple(self.observe_gpu(i) for i in range(n.nvmlDeviceGetCount())))

    def observe_gpu(self, index: int) -> Gpu:
        n = self._nvml
        handle = n.nvmlDeviceGetHandleByIndex(index)
        uuid = GpuUuid(n.nvmlDeviceGetUUID(handle))
        name = n.nvmlDeviceGetName(handle)
        memory_mib = n.nvmlDeviceGetMemoryInfo(handle).total // MIB
        try:
            current, pending = n.nvmlDeviceGetMigMode(handle)
        except n.NVMLError as err:
            if err.value != n.NVML_ERROR_NOT_SUPPORTED:
                raise
            busy = self.has_processes(handle)
            return Gpu(
                index,
                uuid,
                name,
                memory_mib,
                mig_capable=False,
                mig_enabled=False,
                mig_pending=False,
                busy=busy,
            )
        enabled = current == n.NVML_DEVICE_MIG_ENABLE
        pending_enabled = pending == n.NVML_DEVICE_MIG_ENABLE
        busy = self.has_processes(handle)
        if not enabled:
            return Gpu(
                index,
                uuid,
                name,
                memory_mib,
                mig_capable=True,
                mig_enabled=False,
                mig_pending=pending_enabled,
                busy=busy,
            )
        migs = self.mig_devices(handle)
        instances = [
            self.instance(gi, profile, migs)
            for profile in self.gi_profiles(handle, uuid)
            for gi in self.gpu_instances(handle, profile)
        ]
        instances.sort(key=lambda g: (g.start, g.id))
        return Gpu(
            index,
            uuid,
            name,
            memory_mib,
            mig_capable=True,
            mig_enabled=True,
            mig_pending=pending_enabled,
            instances=tuple(instances),
            busy=busy or any(gi.busy for gi in instances),
        )

    def has_processes(self, handle: Any) -> bool:
        n = self._nvml
        try:
            return bool(n.nvmlDeviceGetComputeRunningProcesses(handle))
        except n.NVMLError as err:
            # In MIG mode the parent's aggregate list needs privileges; the MIG devices are asked too.
            if err.value in (n.NVML_ERROR_NO_PERMISSION, n.NVML_ERROR_NOT_SUPPORTED):
                return False
            raise


def _truthy(value: Any) -> bool:
    """NVML booleans arrive as ints or as ctypes values (nvmlDeviceIsMigDeviceHandle)."""
    return bool(getattr(value, "value", value))
