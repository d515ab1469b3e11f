"""The fake driver's library and whole-GPU calls, through nvidia-ml-py's public wrappers."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pynvml

from tests.fakedriver.conftest import Nvml, State, driver_env

A100 = "A100-SXM4-40GB"


def test_every_exported_symbol_is_an_nvml_function_the_tests_call(driver_root: Path) -> None:
    lib = driver_root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
    )
    exported = {line.split()[-1] for line in symbols.stdout.splitlines()}
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    assert all(name.startswith("nvml") for name in exported), exported
    # Each C symbol is reached through the pynvml wrapper of the same name (less the version suffix).
    wrappers = {name.removesuffix("_v2").removesuffix("_v3").removesuffix("V") for name in exported}
    missing = {w for w in wrappers if f'"{w}"' not in tests and w not in ("nvmlInit", "nvmlInitWithFlags")}
    assert not missing, f"exported but never called by a test: {sorted(missing)}"


def test_calls_before_init_answer_uninitialized(driver_root: Path, machine: State) -> None:
    machine.init(A100)
    worker = Nvml(driver_root, machine)
    try:
        worker.call("nvmlInit")
        worker.call("nvmlShutdown")
        assert worker.code("nvmlShutdown") == pynvml.NVML_ERROR_UNINITIALIZED
    finally:
        worker.close()


def test_init_without_gpus_fails_as_without_a_driver(driver_root: Path, machine: State) -> None:
    worker = Nvml(driver_root, machine)  # no state file at all
    try:
        assert worker.code("nvmlInit") == pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    finally:
        worker.close()


def test_error_strings(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    assert n.call("nvmlErrorString", pynvml.NVML_ERROR_IN_USE) == "In use by another client"
    assert n.call("nvmlErrorString", pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"


def test_versions_follow_the_personality(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    assert "driverVersion" not in machine.read()  # `sharing sim init` leaves them to the personality
    driver, cuda = {"r580": ("580.65.06", 13000), "r535": ("535.261.03", 12020)}[machine.personality]
    n = nvml_for(machine)
    assert n.call("nvmlSystemGetDriverVersion") == driver
    assert n.call("nvmlSystemGetCudaDriverVersion") == cuda
    assert n.call("nvmlSystemGetCudaDriverVersion_v2") == cuda


def test_identity_of_each_gpu(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    uuids = machine.init(f"{A100}:2,T4")
    n = nvml_for(machine)
    assert n.call("nvmlDeviceGetCount") == 3
    handles = [n.call("nvmlDeviceGetHandleByIndex", i) for i in range(3)]
    assert [n.call("nvmlDeviceGetUUID", h) for h in handles] == uuids
    assert n.call("nvmlDeviceGetHandleByUUID", uuids[2]) == handles[2]
    assert n.call("nvmlDeviceGetName", handles[0]) == "NVIDIA A100-SXM4-40GB"
    assert n.call("nvmlDeviceGetMemoryInfo", handles[0])["total"] == 40960 << 20
    pci = n.call("nvmlDeviceGetPciInfo", handles[1])
    assert pci["pciDeviceId"] == 0x20B010DE
    assert pci["busId"] == "00000000:11:00.0"
    assert n.call("nvmlDeviceGetCudaComputeCapability", handles[0]) == [8, 0]
    assert n.call("nvmlDeviceGetMinorNumber", handles[2]) == 2
    assert n.call("nvmlDeviceGetBrand", handles[0]) == pynvml.NVML_BRAND_NVIDIA
    assert [n.call("nvmlDeviceGetArchitecture", h) for h in handles] == [
        pynvml.NVML_DEVICE_ARCH_AMPERE,
        pynvml.NVML_DEVICE_ARCH_AMPERE,
        pynvml.NVML_DEVICE_ARCH_TURING,
    ]
    assert n.call("nvmlDeviceGetVirtualizationMode", handles[0]) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
    ext = {"struct": "nvmlPciInfoExt_v1_t", "fields": {"version": pynvml.nvmlPciInfoExt_v1}}
    n.call("nvmlDeviceGetPciInfoExt", handles[0], ext)
    assert (n.out[0]["baseClass"], n.out[0]["subClass"]) == (3, 2)  # a 3D controller


def test_bad_handles_indices_and_uuids(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    assert n.code("nvmlDeviceGetHandleByIndex", 1) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert n.code("nvmlDeviceGetHandleByUUID", "GPU-nope") == pynvml.NVML_ERROR_NOT_FOUND
    assert n.code("nvmlDeviceGetUUID", {"h": 8}) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_pci_info_ext_needs_its_struct_version(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    wrong = {"struct": "nvmlPciInfoExt_v1_t", "fields": {"version": 1}}
    assert n.code("nvmlDeviceGetPciInfoExt", gpu, wrong) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_a_lost_gpu_answers_gpu_is_lost_and_the_others_answer(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(f"{A100}:2")
    n = nvml_for(machine)
    machine.sim("lost", "--gpu", "0")
    lost, fine = n.call("nvmlDeviceGetHandleByIndex", 0), n.call("nvmlDeviceGetHandleByIndex", 1)
    for call in ("nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMigMode", "nvmlDeviceGetMemoryInfo"):
        assert n.code(call, lost) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert n.call("nvmlDeviceGetName", fine) == "NVIDIA A100-SXM4-40GB"
    machine.sim("found", "--gpu", "0")
    assert n.call("nvmlDeviceGetName", lost) == "NVIDIA A100-SXM4-40GB"


def test_a_busy_gpu_runs_one_process(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    (uuid,) = machine.init("T4")
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert n.call("nvmlDeviceGetComputeRunningProcesses", gpu) == []
    machine.sim("busy", "--uuid", uuid)
    (process,) = n.call("nvmlDeviceGetComputeRunningProcesses", gpu)
    assert process["gpuInstanceId"] == process["computeInstanceId"] == 0xFFFFFFFF  # not MIG
    machine.sim("idle", "--uuid", uuid)
    assert n.call("nvmlDeviceGetComputeRunningProcesses", gpu) == []


def test_a_gpu_without_mig_does_not_support_mig_calls(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init("T4")
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert n.code("nvmlDeviceGetMigMode", gpu) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert n.code("nvmlDeviceSetMigMode", gpu, 1) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert n.code("nvmlDeviceGetGpuInstanceProfileInfo", gpu, 0) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert n.call("nvmlDeviceGetMaxMigDeviceCount", gpu) == 0


def test_nvidia_smi_lists_gpus_and_mig_devices(
    driver_root: Path, machine: State, nvml_for: Callable[[State], Nvml]
) -> None:
    uuids = machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    n.call("nvmlDeviceSetMigMode", gpu, 1)
    gi = n.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, 19, {"placement": [0, 1]})
    n.call("nvmlGpuInstanceCreateComputeInstance", gi, 0)
    mig = n.call("nvmlDeviceGetUUID", n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0))
    smi = subprocess.run(
        [str(driver_root / "usr/bin/nvidia-smi"), "-L"],
        capture_output=True, text=True, check=True, env=driver_env(driver_root, machine.path),
    )  # fmt: skip
    assert smi.stdout.splitlines() == [
        f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {uuids[0]})",
        f"  MIG 1g.5gb Device  0: (UUID: {mig})",
    ]
