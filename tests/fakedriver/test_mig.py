"""MIG through the fake driver: mode changes, profiles per personality, instances, MIG devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from tests.fakedriver.conftest import Nvml, State

A100 = "A100-SXM4-40GB"
# A100-SXM4-40GB profile ids (MIG user guide, "A100 MIG Profiles"): 1g.5gb 19, 3g.20gb 9, 7g.40gb 0.
P1G, P3G, P7G = 19, 9, 0


def mig_on(n: Nvml) -> Any:
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert n.call("nvmlDeviceSetMigMode", gpu, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    return gpu


def create(n: Nvml, gpu: Any, profile: int, start: int, size: int) -> tuple[Any, Any]:
    gi = n.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, profile, {"placement": [start, size]})
    whole = n.call("nvmlDeviceGetGpuInstanceProfileInfo", gpu, {P1G: 0, P3G: 2, P7G: 4}[profile])[
        "sliceCount"
    ]
    ci_enum = {1: 0, 3: 2, 7: 4}[whole]
    info = n.call("nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, ci_enum, 0)
    return gi, n.call("nvmlGpuInstanceCreateComputeInstance", gi, info["id"])


def test_mig_mode_applies_at_once_on_an_idle_bare_metal_gpu(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert n.call("nvmlDeviceGetMigMode", gpu) == [0, 0]
    assert n.call("nvmlDeviceSetMigMode", gpu, 1) == pynvml.NVML_SUCCESS
    assert n.call("nvmlDeviceGetMigMode", gpu) == [1, 1]
    assert n.call("nvmlDeviceGetMaxMigDeviceCount", gpu) == 7
    assert n.code("nvmlDeviceSetMigMode", gpu, 2) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_in_a_vm_the_mode_waits_for_a_reset(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100, "--pending-mode-changes")
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert n.call("nvmlDeviceSetMigMode", gpu, 1) == pynvml.NVML_ERROR_RESET_REQUIRED
    assert n.call("nvmlDeviceGetMigMode", gpu) == [0, 1]
    machine.sim("reset")
    assert n.call("nvmlDeviceGetMigMode", gpu) == [1, 1]


def test_a_busy_gpu_keeps_the_change_pending_with_in_use(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    (uuid,) = machine.init(A100)
    machine.sim("busy", "--uuid", uuid)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert n.call("nvmlDeviceSetMigMode", gpu, 1) == pynvml.NVML_ERROR_IN_USE
    assert n.call("nvmlDeviceGetMigMode", gpu) == [0, 1]


def test_mig_cannot_be_disabled_while_instances_exist(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    gi, ci = create(n, gpu, P1G, 0, 1)
    assert n.code("nvmlDeviceSetMigMode", gpu, 0) == pynvml.NVML_ERROR_IN_USE
    n.call("nvmlComputeInstanceDestroy", ci)
    n.call("nvmlGpuInstanceDestroy", gi)
    assert n.call("nvmlDeviceSetMigMode", gpu, 0) == pynvml.NVML_SUCCESS


def table(n: Nvml, gpu: Any) -> dict[int, dict[str, Any]]:
    """Every GPU-instance profile the driver lists, by enum (skipping NOT_SUPPORTED)."""
    found = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        code = n.code("nvmlDeviceGetGpuInstanceProfileInfo", gpu, enum)
        assert code in (0, pynvml.NVML_ERROR_NOT_SUPPORTED)
        if code == 0:
            found[enum] = n.call("nvmlDeviceGetGpuInstanceProfileInfo", gpu, enum)
    return found


@pytest.mark.parametrize("machine", ["r580"], indirect=True)
def test_the_current_branch_lists_profiles_while_mig_is_off(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    profiles = table(n, n.call("nvmlDeviceGetHandleByIndex", 0))
    one = profiles[pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE]
    assert (one["id"], one["sliceCount"], one["instanceCount"], one["memorySizeMB"]) == (P1G, 1, 7, 4864)
    assert one["name"] == "MIG 1g.5gb"
    assert one["version"] == pynvml.nvmlGpuInstanceProfileInfo_v2
    assert profiles[pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE]["id"] == P7G
    # Multiprocessors and engines are the catalog's, as `sharing sim init` wrote them.
    for written in machine.read()["gpus"][0]["mig"]["profiles"]:
        got = profiles[written["enum"]]
        engines = ["copyEngineCount", "decoderCount", "encoderCount", "jpegCount", "ofaCount"]
        assert [got["multiprocessorCount"], *(got[e] for e in engines)] == [
            written["sm"],
            *written["engines"],
        ]


@pytest.mark.parametrize("machine", ["r535"], indirect=True)
def test_the_old_branch_lists_no_profiles_until_mig_is_on(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert table(n, gpu) == {}
    n.call("nvmlDeviceGetGpuInstancePossiblePlacements", gpu, P1G, None, {"uint": 0})
    assert n.out == [7]  # placements are answered "regardless of whether MIG is enabled or not"
    mig_on(n)
    assert len(table(n, gpu)) == 7


def test_profile_info_versions_and_bad_enums(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)  # the old branch answers only with MIG on
    v1 = n.call("nvmlDeviceGetGpuInstanceProfileInfo", gpu, 0, 1)  # the unversioned struct
    assert v1["id"] == P1G
    assert "version" not in v1
    assert n.code("nvmlDeviceGetGpuInstanceProfileInfo", gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT) == (
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    )


def test_possible_placements(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    n.call("nvmlDeviceGetGpuInstancePossiblePlacements", gpu, P3G, None, {"uint": 0})
    assert n.out == [2]
    array = {"array": "c_nvmlGpuInstancePlacement_t", "n": 2}
    n.call("nvmlDeviceGetGpuInstancePossiblePlacements", gpu, P3G, array, {"uint": 2})
    assert n.out == [[{"start": 0, "size": 4}, {"start": 4, "size": 4}], 2]
    assert n.code("nvmlDeviceGetGpuInstancePossiblePlacements", gpu, 99, None, {"uint": 0}) == (
        pynvml.NVML_ERROR_NOT_SUPPORTED
    )


def test_gpu_instances_follow_the_driver_rules(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    place = "nvmlDeviceCreateGpuInstanceWithPlacement"
    assert n.code(place, gpu, P1G, {"placement": [0, 1]}) == pynvml.NVML_ERROR_NOT_SUPPORTED  # MIG off
    mig_on(n)
    invalid, taken = pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert n.code(place, gpu, P3G, {"placement": [2, 4]}) == invalid  # not one of its placements
    assert n.code(place, gpu, P3G, {"placement": [0, 1]}) == invalid  # the wrong size
    assert n.code(place, gpu, 77, {"placement": [0, 1]}) == invalid  # no such profile
    gi = n.call(place, gpu, P3G, {"placement": [0, 4]})
    assert n.code(place, gpu, P1G, {"placement": [2, 1]}) == taken  # overlaps the 3g.20gb at 0
    n.call(place, gpu, P3G, {"placement": [4, 4]})
    assert n.code(place, gpu, P7G, {"placement": [0, 8]}) == taken
    listed = {"array": "c_nvmlGpuInstance_t", "n": 8}
    n.call("nvmlDeviceGetGpuInstances", gpu, P3G, listed, {"uint": 0})
    assert n.out[1] == 2
    assert n.out[0][0] == gi
    info = n.call("nvmlGpuInstanceGetInfo", gi)
    assert (info["device"], info["profileId"], info["placement"]) == (gpu, P3G, {"start": 0, "size": 4})
    assert n.call("nvmlDeviceGetGpuInstanceById", gpu, info["id"]) == gi
    assert n.code("nvmlDeviceGetGpuInstanceById", gpu, 14) == pynvml.NVML_ERROR_NOT_FOUND


def test_the_profile_maximum_is_enforced(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    for start in range(7):
        n.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, P1G, {"placement": [start, 1]})
    assert n.code("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, P1G, {"placement": [6, 1]}) == (
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    )


def test_compute_instances(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    gi = n.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, P3G, {"placement": [4, 4]})
    cip = "nvmlGpuInstanceGetComputeInstanceProfileInfo"
    half = n.call(cip, gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
    assert (half["sliceCount"], half["instanceCount"], half["version"]) == (
        1,
        3,
        pynvml.nvmlComputeInstanceProfileInfo_v2,
    )
    assert n.code(cip, gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 0) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert (
        n.code(cip, gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT, 0) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert n.code(cip, gi, 0, 1) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # engine profile
    v1 = n.call(cip, gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0, 1)
    assert v1["sliceCount"] == 3
    whole = n.call("nvmlGpuInstanceCreateComputeInstance", gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    assert n.code("nvmlGpuInstanceCreateComputeInstance", gi, 0) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert n.code("nvmlGpuInstanceCreateComputeInstance", gi, 3) == pynvml.NVML_ERROR_NOT_SUPPORTED
    listed = {"array": "c_nvmlComputeInstance_t", "n": 8}
    n.call(
        "nvmlGpuInstanceGetComputeInstances",
        gi,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        listed,
        {"uint": 0},
    )
    assert n.out == [[whole] + [None] * 7, 1]
    info = n.call("nvmlComputeInstanceGetInfo", whole)
    # nvml.h nvmlComputeInstanceInfo_st: `device` is the PARENT device, not the MIG device.
    assert (info["device"], info["gpuInstance"], info["placement"]) == (gpu, gi, {"start": 0, "size": 3})
    assert n.code("nvmlGpuInstanceDestroy", gi) == pynvml.NVML_ERROR_IN_USE
    n.call("nvmlComputeInstanceDestroy", whole)
    assert n.code("nvmlComputeInstanceGetInfo", whole) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # a stale handle
    n.call("nvmlGpuInstanceDestroy", gi)
    assert n.code("nvmlGpuInstanceGetInfo", gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_a_busy_compute_instance_is_not_destroyed(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    _, ci = create(n, gpu, P1G, 0, 1)
    mig = n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0)
    machine.sim("busy", "--uuid", n.call("nvmlDeviceGetUUID", mig))
    assert n.code("nvmlComputeInstanceDestroy", ci) == pynvml.NVML_ERROR_IN_USE
    (process,) = n.call("nvmlDeviceGetComputeRunningProcesses", mig)
    assert (process["gpuInstanceId"], process["computeInstanceId"]) == (0, 0)
    assert len(n.call("nvmlDeviceGetComputeRunningProcesses", gpu)) == 1  # the parent's aggregate


def test_mig_devices_have_sparse_indices_and_stable_uuids(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    made = [create(n, gpu, P1G, start, 1) for start in (0, 1, 2)]
    migs = [n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, i) for i in range(3)]
    uuids = [n.call("nvmlDeviceGetUUID", m) for m in migs]
    assert all(u.startswith("MIG-") and len(u) == 40 for u in uuids)
    assert len(set(uuids)) == 3
    n.call("nvmlComputeInstanceDestroy", made[1][1])
    assert n.code("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 1) == pynvml.NVML_ERROR_NOT_FOUND  # a hole
    assert n.code("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 7) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert n.call("nvmlDeviceGetUUID", n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 2)) == uuids[2]
    assert n.call("nvmlDeviceGetHandleByUUID", uuids[2]) == migs[2]
    assert n.call("nvmlDeviceIsMigDeviceHandle", migs[2]) == 1
    assert n.call("nvmlDeviceIsMigDeviceHandle", gpu) == 0
    assert n.call("nvmlDeviceGetGpuInstanceId", migs[2]) == n.call("nvmlGpuInstanceGetInfo", made[2][0])["id"]
    assert n.call("nvmlDeviceGetComputeInstanceId", migs[2]) == 0
    assert n.code("nvmlDeviceGetGpuInstanceId", gpu) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert n.call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migs[2]) == gpu
    assert n.call("nvmlDeviceGetName", migs[2]) == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    assert n.call("nvmlDeviceGetMemoryInfo", migs[2])["total"] == 4864 << 20


def test_an_unprivileged_container_cannot_list_mig_processes(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100, unprivilegedProcesses=True)
    n = nvml_for(machine)
    gpu = mig_on(n)
    create(n, gpu, P1G, 0, 1)
    mig = n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0)
    assert n.code("nvmlDeviceGetComputeRunningProcesses", mig) == pynvml.NVML_ERROR_NO_PERMISSION
    assert n.code("nvmlDeviceGetComputeRunningProcesses", gpu) == pynvml.NVML_ERROR_NO_PERMISSION


def test_a_reset_removes_every_instance(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    gi, _ = create(n, gpu, P1G, 0, 1)
    machine.sim("reset")
    assert n.code("nvmlGpuInstanceGetInfo", gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert n.code("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0) == pynvml.NVML_ERROR_NOT_FOUND
