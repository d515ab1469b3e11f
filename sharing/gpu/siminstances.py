"""GPU instances and compute instances of the simulated NVML, with the driver's rules.

Valid placements only (those of the GPU's profile table, on its grid of slots), no overlap and
per-profile maximums (INSUFFICIENT_RESOURCES), IN_USE for a GPU instance that still has compute
instances and for a busy compute instance, caller-allocated arrays (INSUFFICIENT_SIZE).
"""

from __future__ import annotations

from sharing.gpu import simstate
from sharing.gpu.simcore import CI, GI, GPU, MIG, SimCore, deref, handle
from sharing.gpu.simspec import State
from sharing.gpu.simtypes import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
    NVML_SUCCESS,
    NVMLError_InsufficientResources,
    NVMLError_InsufficientSize,
    NVMLError_InUse,
    NVMLError_InvalidArgument,
    NVMLError_NotFound,
    NVMLError_NotSupported,
    c_nvmlComputeInstanceInfo_t,
    c_nvmlComputeInstancePlacement_t,
    c_nvmlComputeInstanceProfileInfo_v2_t,
    c_nvmlGpuInstanceInfo_t,
    c_nvmlGpuInstancePlacement_t,
    c_nvmlGpuInstanceProfileInfo_v2_t,
)

# Compute-instance profile enum -> compute slices (REV1 and NVL variants are not simulated).
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


def _set(target: object, index: int, value: object) -> None:
    """Fill slot `index` of a caller-allocated ctypes array."""
    target[index] = value  # type: ignore[index]


def _count(ref: object) -> int:
    value = getattr(deref(ref), "value", 0)
    return value if isinstance(value, int) else 0


def _set_count(ref: object, value: int) -> None:
    deref(ref).value = value  # type: ignore[attr-defined]


class SimInstances(SimCore):
    """nvmlDevice*GpuInstance* and nvmlGpuInstance*/nvmlComputeInstance* over the state file."""

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: object, profile: int, version: int = 2
    ) -> c_nvmlGpuInstanceProfileInfo_v2_t:
        with self._reading() as state:
            table = self._table(self._gpu(state, device))
        if not 0 <= profile < NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise NVMLError_InvalidArgument()
        for p in table.profiles:
            if p.enum == profile:
                engines = p.engines
                return c_nvmlGpuInstanceProfileInfo_v2_t(
                    version=0x02000098,
                    id=p.id,
                    isP2pSupported=0,
                    sliceCount=p.compute_slices,
                    instanceCount=p.max_count,
                    multiprocessorCount=p.multiprocessors or 0,
                    copyEngineCount=engines.copy if engines else 0,
                    decoderCount=engines.decoder if engines else 0,
                    encoderCount=engines.encoder if engines else 0,
                    jpegCount=engines.jpeg if engines else 0,
                    ofaCount=engines.ofa if engines else 0,
                    memorySizeMB=p.memory_mib,
                    name=f"MIG {p.name}".encode(),
                )
        raise NVMLError_NotSupported()

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: object, profileId: int, placementsRef: object, countRef: object
    ) -> int:
        with self._reading() as state:
            profile = self._gi_profile(self._gpu(state, device), profileId)
        if placementsRef is None:
            _set_count(countRef, len(profile.placements))
            return NVML_SUCCESS
        if _count(countRef) < len(profile.placements):
            _set_count(countRef, len(profile.placements))
            raise NVMLError_InsufficientSize()
        for i, start in enumerate(profile.placements):
            _set(placementsRef, i, c_nvmlGpuInstancePlacement_t(start, profile.size))
        _set_count(countRef, len(profile.placements))
        return NVML_SUCCESS

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: object, profileId: int, placement: object
    ) -> int:
        wanted = deref(placement)
        start, size = getattr(wanted, "start", -1), getattr(wanted, "size", -1)

        def change(state: State) -> int:
            gpu = self._gpu(state, device)
            table = self._enabled_table(gpu)
            profile = self._gi_profile(gpu, profileId)
            if start not in profile.placements or size != profile.size:
                raise NVMLError_InvalidArgument()
            gis = gpu["gpuInstances"]
            if sum(gi["profileId"] == profileId for gi in gis) >= profile.max_count:
                raise NVMLError_InsufficientResources()
            for gi in gis:
                if start < gi["start"] + gi["size"] and gi["start"] < start + size:
                    raise NVMLError_InsufficientResources()
            compute = sum(self._gi_profile(gpu, gi["profileId"]).compute_slices for gi in gis)
            if compute + profile.compute_slices > table.compute_slices:
                raise NVMLError_InsufficientResources()
            gi_id = min(set(range(len(gis) + 1)) - {gi["id"] for gi in gis})
            gis.append(
                {"id": gi_id, "profileId": profileId, "start": start, "size": size, "computeInstances": []}
            )
            return handle(GI, gpu["index"], gi_id)

        return self._mutate(change)

    def nvmlDeviceGetGpuInstances(
        self, device: object, profileId: int, gpuInstancesRef: object, countRef: object
    ) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, device)
            self._enabled_table(gpu)
            self._gi_profile(gpu, profileId)
            found = [gi for gi in gpu["gpuInstances"] if gi["profileId"] == profileId]
        if len(found) > len(gpuInstancesRef):  # type: ignore[arg-type]
            raise NVMLError_InsufficientSize()
        for i, gi in enumerate(found):
            _set(gpuInstancesRef, i, handle(GI, gpu["index"], gi["id"]))
        _set_count(countRef, len(found))
        return NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, device: object, gpuInstanceId: int) -> int:
        with self._reading() as state:
            gpu = self._gpu(state, device)
            self._enabled_table(gpu)
            if not any(gi["id"] == gpuInstanceId for gi in gpu["gpuInstances"]):
                raise NVMLError_NotFound()
            return handle(GI, gpu["index"], gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: object) -> c_nvmlGpuInstanceInfo_t:
        with self._reading() as state:
            gpu, gi = self._gi(state, gpuInstance)
            return c_nvmlGpuInstanceInfo_t(
                handle(GPU, gpu["index"]),
                gi["id"],
                gi["profileId"],
                c_nvmlGpuInstancePlacement_t(gi["start"], gi["size"]),
            )

    def nvmlGpuInstanceDestroy(self, gpuInstance: object) -> int:
        def change(state: State) -> int:
            gpu, gi = self._gi(state, gpuInstance)
            if gi["computeInstances"]:
                raise NVMLError_InUse()
            gpu["gpuInstances"].remove(gi)
            return NVML_SUCCESS

        return self._mutate(change)

    # ---- compute instances -------------------------------------------------------------------

    def _ci_slices(self, gpu: State, gi: State, profile: int) -> int:
        whole = self._gi_profile(gpu, gi["profileId"]).compute_slices
        slices = CI_SLICES.get(profile)
        if slices is None or slices > whole or (slices < whole and 2 * slices > whole + 1):
            raise NVMLError_NotSupported()
        return slices

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpuInstance: object, profile: int, engProfile: int, version: int = 2
    ) -> c_nvmlComputeInstanceProfileInfo_v2_t:
        if engProfile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED or not 0 <= profile < 9:
            raise NVMLError_InvalidArgument()
        with self._reading() as state:
            gpu, gi = self._gi(state, gpuInstance)
            slices = self._ci_slices(gpu, gi, profile)
            whole = self._gi_profile(gpu, gi["profileId"])
        per_slice = (whole.multiprocessors or 0) // whole.compute_slices
        return c_nvmlComputeInstanceProfileInfo_v2_t(
            version=0x02000088,
            id=profile,
            sliceCount=slices,
            instanceCount=whole.compute_slices // slices,
            multiprocessorCount=per_slice * slices,
            name=f"MIG {slices}c".encode(),
        )

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: object, profileId: int) -> int:
        def change(state: State) -> int:
            gpu, gi = self._gi(state, gpuInstance)
            slices = self._ci_slices(gpu, gi, profileId)
            cis = gi["computeInstances"]
            used = sum(CI_SLICES[ci["profileId"]] for ci in cis)
            if used + slices > self._gi_profile(gpu, gi["profileId"]).compute_slices:
                raise NVMLError_InsufficientResources()
            ci_id = min(set(range(len(cis) + 1)) - {ci["id"] for ci in cis})
            taken = {ci["migIndex"] for g in gpu["gpuInstances"] for ci in g["computeInstances"]}
            cis.append(
                {
                    "id": ci_id,
                    "profileId": profileId,
                    "start": used,
                    "size": slices,
                    "migIndex": min(set(range(len(taken) + 1)) - taken),
                    "uuid": simstate.new_mig_uuid(state),
                    "busy": False,
                }
            )
            return handle(CI, gpu["index"], gi["id"], ci_id)

        return self._mutate(change)

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: object, profileId: int, computeInstancesRef: object, countRef: object
    ) -> int:
        with self._reading() as state:
            gpu, gi = self._gi(state, gpuInstance)
            found = [ci for ci in gi["computeInstances"] if ci["profileId"] == profileId]
        if len(found) > len(computeInstancesRef):  # type: ignore[arg-type]
            raise NVMLError_InsufficientSize()
        for i, ci in enumerate(found):
            _set(computeInstancesRef, i, handle(CI, gpu["index"], gi["id"], ci["id"]))
        _set_count(countRef, len(found))
        return NVML_SUCCESS

    def nvmlComputeInstanceGetInfo(self, computeInstance: object) -> c_nvmlComputeInstanceInfo_t:
        with self._reading() as state:
            gpu, gi, ci = self._ci(state, computeInstance, CI)
            return c_nvmlComputeInstanceInfo_t(
                handle(MIG, gpu["index"], gi["id"], ci["id"]),
                handle(GI, gpu["index"], gi["id"]),
                ci["id"],
                ci["profileId"],
                c_nvmlComputeInstancePlacement_t(ci["start"], ci["size"]),
            )

    def nvmlComputeInstanceDestroy(self, computeInstance: object) -> int:
        def change(state: State) -> int:
            _, gi, ci = self._ci(state, computeInstance, CI)
            if ci["busy"]:
                raise NVMLError_InUse()
            gi["computeInstances"].remove(ci)
            return NVML_SUCCESS

        return self._mutate(change)
