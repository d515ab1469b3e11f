"""What the GPUs are doing, through nvidia-ml-py's public wrappers: processes, memory, utilization,
power, temperature and GPM, as the fake driver plays them from the state `sharing sim` writes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from sharing.cli import main
from sharing.gpu import simstate
from tests.fakedriver.conftest import Nvml, State
from tests.fakedriver.test_mig import P1G, P3G, create, mig_on

A100 = "A100-SXM4-40GB"
H100 = "H100-80GB-HBM3"
MIB = 1 << 20
NA = 0xFFFFFFFF
# H100 80GB HBM3 profile ids (MIG user guide, "H100 MIG Profiles"): 1g.10gb 19, 3g.40gb 9.
H1G, H3G = 19, 9


def processes(n: Nvml, handle: Any) -> list[tuple[int, int, int, int]]:
    """(pid, used bytes, GPU instance, compute instance) of each compute process NVML lists."""
    found = n.call("nvmlDeviceGetComputeRunningProcesses", handle)
    return sorted((p["pid"], p["usedGpuMemory"], p["gpuInstanceId"], p["computeInstanceId"]) for p in found)


def busy(machine: State, uuid: str, pid: int, mib: int = 100, sm: int = 0) -> None:
    """A process on a device, as `sharing sim busy --uuid --pid --memory-mib --sm` starts it (in this
    process: the command itself is the first test's)."""
    simstate.start_process(machine.path, uuid, pid, used_mib=mib, sm=sm)


def memory(n: Nvml, handle: Any) -> tuple[int, int, int]:
    info = n.call("nvmlDeviceGetMemoryInfo", handle)
    return info["total"], info["used"], info["free"]


def test_processes_on_a_gpu_are_what_sim_busy_says(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    (uuid,) = machine.init("L4")
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    total = n.call("nvmlDeviceGetMemoryInfo", gpu)["total"]
    assert (total, 0, total) == memory(n, gpu)
    machine.sim("busy", "--uuid", uuid, "--pid", "4242", "--memory-mib", "2048", "--sm", "30")
    busy(machine, uuid, 4343, 512, 0)
    assert [(4242, 2048 * MIB, NA, NA), (4343, 512 * MIB, NA, NA)] == processes(n, gpu)
    assert (total, 2560 * MIB, total - 2560 * MIB) == memory(n, gpu)
    v2 = n.call("nvmlDeviceGetMemoryInfo", gpu, pynvml.nvmlMemory_v2)
    assert (total, 0, 2560 * MIB) == (v2["total"], v2["reserved"], v2["used"])
    assert {"gpu": 30, "memory": 0} == n.call("nvmlDeviceGetUtilizationRates", gpu)
    # The same PID again changes its process; --pid ends one.
    busy(machine, uuid, 4343, 1024, 50)
    assert (total, 3072 * MIB, total - 3072 * MIB) == memory(n, gpu)
    assert 80 == n.call("nvmlDeviceGetUtilizationRates", gpu)["gpu"]
    machine.sim("idle", "--uuid", uuid, "--pid", "4242")
    assert [(4343, 1024 * MIB, NA, NA)] == processes(n, gpu)
    simstate.stop_processes(machine.path, uuid)
    assert [] == processes(n, gpu)
    assert 0 == n.call("nvmlDeviceGetUtilizationRates", gpu)["gpu"]


def test_process_utilization_samples_each_process_that_used_the_sms(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    (uuid,) = machine.init("L4")
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    # "If no valid sample entries are found since the lastSeenTimeStamp, NVML_ERROR_NOT_FOUND".
    assert pynvml.NVML_ERROR_NOT_FOUND == n.code("nvmlDeviceGetProcessUtilization", gpu, 0)
    busy(machine, uuid, 10, sm=70)
    busy(machine, uuid, 11, sm=20)
    busy(machine, uuid, 12, sm=0)
    samples = n.call("nvmlDeviceGetProcessUtilization", gpu, 0)
    # Only processes with "some non-zero utilization during the last sample period".
    assert [(10, 70), (11, 20)] == sorted((s["pid"], s["smUtil"]) for s in samples)
    (stamp,) = {s["timeStamp"] for s in samples}
    assert stamp > 0
    # Samples "with timestamp greater than lastSeenTimeStamp" only (one of the current sample period,
    # or a later one: never older than the one just read).
    assert 2 == len(n.call("nvmlDeviceGetProcessUtilization", gpu, stamp - 1))
    later = int((time.time() + 3600) * 1e6)
    assert pynvml.NVML_ERROR_NOT_FOUND == n.code("nvmlDeviceGetProcessUtilization", gpu, later)


def test_mig_devices_list_their_own_processes_and_memory(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    create(n, gpu, P1G, 0, 1)
    create(n, gpu, P3G, 4, 4)
    small, large = (n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, i) for i in range(2))
    small_uuid, large_uuid = (n.call("nvmlDeviceGetUUID", h) for h in (small, large))
    small_gi, large_gi = (n.call("nvmlDeviceGetGpuInstanceId", h) for h in (small, large))
    busy(machine, small_uuid, 500, 1000, 40)
    busy(machine, large_uuid, 600, 3000, 10)
    busy(machine, large_uuid, 601, 2000, 10)
    assert [(500, 1000 * MIB, small_gi, 0)] == processes(n, small)
    assert [(600, 3000 * MIB, large_gi, 0), (601, 2000 * MIB, large_gi, 0)] == processes(n, large)
    # The GPU's handle: the aggregate of its MIG devices.
    assert [p[0] for p in processes(n, gpu)] == [500, 600, 601]
    # A MIG device's memory is its GPU instance's (1g.5gb: 4864 MiB, 3g.20gb: 19968 MiB on this driver).
    small_total = n.call("nvmlDeviceGetGpuInstanceProfileInfo", gpu, 0)["memorySizeMB"] * MIB
    assert (small_total, 1000 * MIB, small_total - 1000 * MIB) == memory(n, small)
    assert 5000 * MIB == memory(n, large)[1]
    assert (40960 * MIB, 6000 * MIB) == memory(n, gpu)[:2]
    # "On MIG-enabled GPUs, querying device utilization rates is not currently supported", nor
    # process utilization.
    for handle in (gpu, small):
        assert pynvml.NVML_ERROR_NOT_SUPPORTED == n.code("nvmlDeviceGetUtilizationRates", handle)
        assert pynvml.NVML_ERROR_NOT_SUPPORTED == n.code("nvmlDeviceGetProcessUtilization", handle, 0)


def test_power_and_temperature_are_the_gpus(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    uuids = machine.init(f"{A100}:2")
    n = nvml_for(machine)
    first, second = (n.call("nvmlDeviceGetHandleByIndex", i) for i in range(2))
    assert (60000, 35) == (
        n.call("nvmlDeviceGetPowerUsage", first),
        n.call("nvmlDeviceGetTemperatureV", first, pynvml.NVML_TEMPERATURE_GPU),
    )
    machine.sim("sensors", "--uuid", uuids[1], "--power-watts", "312.5", "--temperature", "71")
    assert 312500 == n.call("nvmlDeviceGetPowerUsage", second)
    assert 71 == n.call("nvmlDeviceGetTemperatureV", second, pynvml.NVML_TEMPERATURE_GPU)
    assert 71 == n.call("nvmlDeviceGetTemperature", second, pynvml.NVML_TEMPERATURE_GPU)  # older drivers'
    assert 60000 == n.call("nvmlDeviceGetPowerUsage", first)
    # The fake GPU has the die sensor only; a sensor NVML does not know is an invalid argument.
    assert pynvml.NVML_ERROR_NOT_SUPPORTED == n.code(
        "nvmlDeviceGetTemperatureV", first, pynvml.NVML_TEMPERATURE_GPU_MAX
    )
    assert pynvml.NVML_ERROR_INVALID_ARGUMENT == n.code("nvmlDeviceGetTemperature", first, 7)
    # A MIG device has no power or temperature of its own here.
    gpu = mig_on(n)
    create(n, gpu, P1G, 0, 1)
    mig = n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0)
    assert pynvml.NVML_ERROR_NOT_SUPPORTED == n.code("nvmlDeviceGetPowerUsage", mig)


def test_gpm_is_supported_on_hopper_and_not_on_ampere(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(f"{A100},{H100}")
    n = nvml_for(machine)
    a100, h100 = (n.call("nvmlDeviceGetHandleByIndex", i) for i in range(2))
    assert 0 == n.call("nvmlGpmQueryDeviceSupport", a100)["isSupportedDevice"]
    assert 1 == n.call("nvmlGpmQueryDeviceSupport", h100)["isSupportedDevice"]
    sample = n.call("nvmlGpmSampleAlloc")
    assert pynvml.NVML_ERROR_NOT_SUPPORTED == n.code("nvmlGpmSampleGet", a100, sample)
    n.call("nvmlGpmSampleGet", h100, sample)
    n.call("nvmlGpmSampleFree", sample)


def gpm_metrics(n: Nvml, first: Any, second: Any, *ids: int) -> list[tuple[int, float]]:
    """(nvmlReturn, value) of each metric asked for between two samples."""
    got = n.call("nvmlGpmMetricsGet", {"gpm": list(ids), "samples": [first, second]})
    return [(m["nvmlReturn"], m["value"]) for m in got["metrics"][: len(ids)]]


def test_gpm_gives_each_gpu_instance_its_own_activity(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(H100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    create(n, gpu, H1G, 0, 1)
    create(n, gpu, H3G, 4, 4)
    small, large = (n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, i) for i in range(2))
    small_gi, large_gi = (n.call("nvmlDeviceGetGpuInstanceId", h) for h in (small, large))
    busy(machine, n.call("nvmlDeviceGetUUID", small), 7, sm=60)
    busy(machine, n.call("nvmlDeviceGetUUID", large), 8, sm=25)
    busy(machine, n.call("nvmlDeviceGetUUID", large), 9, sm=25)
    s1, s2, s3, s4 = (n.call("nvmlGpmSampleAlloc") for _ in range(4))
    n.call("nvmlGpmMigSampleGet", gpu, small_gi, s1)
    n.call("nvmlGpmSampleGet", large, s3)  # a MIG device's handle: its GPU instance
    n.call("nvmlGpmMigSampleGet", gpu, small_gi, s2)
    n.call("nvmlGpmMigSampleGet", gpu, large_gi, s4)
    graphics, sm, dram = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_SM_UTIL, 10
    ok, unsupported = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED
    assert [(ok, 60.0), (ok, 60.0), (unsupported, 0.0)] == gpm_metrics(n, s1, s2, graphics, sm, dram)
    assert [(ok, 50.0)] == gpm_metrics(n, s3, s4, sm)
    # Two samples of different GPU instances, or in the wrong order, give no metrics.
    assert pynvml.NVML_ERROR_INVALID_ARGUMENT == n.code(
        "nvmlGpmMetricsGet", {"gpm": [sm], "samples": [s1, s4]}
    )
    assert pynvml.NVML_ERROR_INVALID_ARGUMENT == n.code(
        "nvmlGpmMetricsGet", {"gpm": [sm], "samples": [s2, s1]}
    )
    assert pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH == n.code(
        "nvmlGpmMetricsGet", {"gpm": [sm], "samples": [s1, s2], "version": 2}
    )
    assert pynvml.NVML_ERROR_NOT_FOUND == n.code("nvmlGpmMigSampleGet", gpu, 13, s1)
    for sample in (s1, s2, s3, s4):
        n.call("nvmlGpmSampleFree", sample)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        pytest.param(["--sm", "101"], "a percentage is 0 .. 100", id="sm-over-100"),
        pytest.param(["--memory-mib", "99999"], "has 23034 MiB of memory", id="more-memory-than-the-gpu"),
        pytest.param(["--pid", "0"], "not a process ID", id="pid-0"),
    ],
)
def test_sim_busy_refuses_what_no_process_can_be(
    machine: State, args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (uuid,) = machine.init("L4")
    assert 2 == main(["sim", "busy", "--sim-state", str(machine.path), "--uuid", uuid, *args])
    assert error in capsys.readouterr().err
    assert [] == machine.read()["gpus"][0]["processes"]


def test_sim_sensors_is_for_gpus(
    nvml_for: Callable[[State], Nvml], machine: State, capsys: pytest.CaptureFixture[str]
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = mig_on(n)
    create(n, gpu, P1G, 0, 1)
    mig = n.call("nvmlDeviceGetUUID", n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0))
    sensors = ["sim", "sensors", "--sim-state", str(machine.path), "--uuid", mig, "--power-watts", "90"]
    assert 2 == main(sensors)
    assert "power and temperature are its GPU's" in capsys.readouterr().err
