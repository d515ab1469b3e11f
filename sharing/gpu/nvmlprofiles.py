"""A GPU's MIG profile table as its driver reports it: the authority the planner, inventory and labels use.

Every GPU-instance profile enum is asked for (NOT_SUPPORTED and INVALID_ARGUMENT mean the GPU has
no such profile), with its id, compute slices, maximum count, memory, multiprocessors, engines and
possible placements; names are derived from NVML's numbers the way NVIDIA's tools derive them, so
they match `nvidia-smi`, mig-parted and the device plugin on every product, including ones the
catalog has not seen. Synchronous, called on the NVML worker thread; NVML errors propagate.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

from sharing.gpu.nvmlapi import Handle, Nvml, code
from sharing.mig import MIB, Engines, Product, Profile, profile_name, split_pci


def read_table(nvml: Nvml, device: Handle, name: str) -> Product:
    """The profile table of one MIG-capable GPU (`name`: its NVML name)."""
    n = nvml
    total_mib = n.nvmlDeviceGetMemoryInfo(device).total // MIB
    profiles = []
    for enum in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = n.nvmlDeviceGetGpuInstanceProfileInfo(device, enum)
        except n.NVMLError as err:
            if code(err) in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        placements = possible_placements(n, device, info.id)
        profiles.append(
            Profile(
                name=profile_name(enum, info.sliceCount, info.memorySizeMB, total_mib),
                enum=enum,
                id=info.id,
                compute_slices=info.sliceCount,
                size=placements[0][1] if placements else 0,
                max_count=info.instanceCount,
                memory_mib=info.memorySizeMB,
                placements=tuple(start for start, _ in placements),
                multiprocessors=info.multiprocessorCount,
                engines=Engines(
                    info.copyEngineCount, info.decoderCount, info.encoderCount, info.jpegCount, info.ofaCount
                ),
                source="the driver (nvmlDeviceGetGpuInstanceProfileInfo)",
            )
        )
    slots = max((start + p.size for p in profiles for start in p.placements), default=0)
    compute = max((p.compute_slices for p in profiles), default=0)
    return Product(
        name=name,
        nvml_names=(name,),
        pci_device_ids=(),
        memory_mib=total_mib,
        slots=slots,
        compute_slices=compute,
        profiles=tuple(profiles),
        origin="driver",
        source="the driver",
        placements_source="the driver (nvmlDeviceGetGpuInstancePossiblePlacements)",
    )


def with_identity(table: Product, pci_device_id: int | None, capability: tuple[int, int] | None) -> Product:
    """The table with the GPU's PCI device id and compute capability filled in."""
    ids = () if pci_device_id is None else (split_pci(pci_device_id)[0],)
    return replace(table, pci_device_ids=ids, compute_capability=capability)


def possible_placements(nvml: Nvml, device: Handle, profile_id: int) -> list[tuple[int, int]]:
    """(start, size) of every placement of a profile (the caller allocates the array NVML fills)."""
    n = nvml
    count = ctypes.c_uint(0)
    n.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, None, ctypes.byref(count))
    array = (n.c_nvmlGpuInstancePlacement_t * count.value)()
    n.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, array, ctypes.byref(count))
    return [(p.start, p.size) for p in array[: count.value]]
