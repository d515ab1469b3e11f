"""The usage sampler's NVML calls on a real GPU, reading only: that NVIDIA's driver answers them as the
fake driver (hack/fakedriver/README.md, "What the GPUs are doing") says it does.

Every call goes through the same guard as test_nvml_readonly (nothing that changes a GPU can be
called); GPM samples are the reader's own buffers, taken and freed, which changes nothing on the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from sharing.gpu.nvml import NvmlBackend
from sharing.gpu.nvmlusage import GPM_MIN_INTERVAL_S, NvmlUsageReader
from sharing.mig.catalog import default_catalog
from tests.gpu.test_nvml_readonly import ReadOnly

CATALOG = default_catalog()


@pytest.fixture
def reader(nvml: Any) -> Iterator[NvmlUsageReader]:
    r = NvmlUsageReader(ReadOnly(nvml), time.monotonic, time.time)
    yield r
    r.close()


def handles(nvml: Any) -> list[Any]:
    return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]


def mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        return bool(nvml.nvmlDeviceGetMigMode(handle)[0] == nvml.NVML_DEVICE_MIG_ENABLE)
    except nvml.NVMLError_NotSupported:
        return False


def test_every_gpu_is_read_with_its_memory_and_sensors(nvml: Any, reader: NvmlUsageReader) -> None:
    readings = reader.read()
    assert readings.unreadable == ()
    assert [g.uuid for g in readings.gpus] == [nvml.nvmlDeviceGetUUID(h) for h in handles(nvml)]
    for gpu, handle in zip(readings.gpus, handles(nvml), strict=True):
        assert gpu.memory_total_bytes == nvml.nvmlDeviceGetMemoryInfo(handle, nvml.nvmlMemory_v2).total
        assert gpu.memory_used_bytes is not None
        assert 0 <= gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.power_watts is None or 0 < gpu.power_watts < 5000
        assert gpu.temperature_celsius is None or 0 < gpu.temperature_celsius < 130
        assert gpu.mig == mig_enabled(nvml, handle)
        if gpu.mig:
            assert gpu.utilization is None
        else:
            assert gpu.utilization is not None
            assert 0 <= gpu.utilization <= 1
            (device,) = gpu.devices
            assert device.processes is not None
            assert all(p.sm is not None and 0 <= p.sm <= 1 for p in device.processes)


async def test_mig_devices_are_the_backends_and_their_memory_is_their_instances(
    nvml: Any, reader: NvmlUsageReader
) -> None:
    backend = NvmlBackend(ReadOnly(nvml), CATALOG)
    try:
        observed = (await backend.observe()).gpus
    finally:
        await backend.close()
    mig = [g for g in observed if g.mig_enabled and g.instances]
    if not mig:
        pytest.skip("no GPU here is in MIG mode with instances")
    read = {g.uuid: g for g in reader.read().gpus}
    for gpu in mig:
        devices = {d.uuid: d for d in read[gpu.uuid].devices}
        assert set(devices) == {ci.uuid for _, ci in gpu.mig_devices}
        for gi, ci in gpu.mig_devices:
            device = devices[ci.uuid]
            assert device.gpu_instance == gi.id
            assert device.memory_total_bytes is not None
            assert device.memory_used_bytes is not None
            assert 0 < device.memory_total_bytes < read[gpu.uuid].memory_total_bytes  # type: ignore[operator]
            assert all(p.sm is None for p in device.processes or ())  # no per-process SM in MIG mode


def test_per_process_and_device_utilization_are_not_supported_in_mig_mode(nvml: Any) -> None:
    """nvml.h: "On MIG-enabled GPUs, querying process utilization is not currently supported" (and
    device utilization rates): the fake driver answers NOT_SUPPORTED for both."""
    mig = [h for h in handles(nvml) if mig_enabled(nvml, h)]
    if not mig:
        pytest.skip("no GPU here is in MIG mode")
    for handle in mig:
        with pytest.raises(nvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetUtilizationRates(handle)
        with pytest.raises(nvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetProcessUtilization(handle, 0)


def test_process_utilization_finds_no_sample_after_now(nvml: Any) -> None:
    """NOT_FOUND "If no valid sample entries are found since the lastSeenTimeStamp", which the reader
    takes as: no process used the SMs."""
    plain = [h for h in handles(nvml) if not mig_enabled(nvml, h)]
    if not plain:
        pytest.skip("every GPU here is in MIG mode")
    future_us = int((time.time() + 3600) * 1e6)
    for handle in plain:
        with pytest.raises(nvml.NVMLError_NotFound):
            nvml.nvmlDeviceGetProcessUtilization(handle, future_us)


def test_gpm_support_is_answered_in_its_field_and_follows_the_architecture(nvml: Any) -> None:
    """The fake driver answers SUCCESS with isSupportedDevice 1 from compute capability 9.0 on (Hopper)
    and 0 before, and NOT_SUPPORTED for a sample of a GPU before Hopper."""
    for handle in handles(nvml):
        supported = nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice
        major, _ = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        assert bool(supported) == (major >= 9), nvml.nvmlDeviceGetName(handle)
        if not supported:
            sample = nvml.nvmlGpmSampleAlloc()
            try:
                with pytest.raises(nvml.NVMLError_NotSupported):
                    nvml.nvmlGpmSampleGet(handle, sample)
            finally:
                nvml.nvmlGpmSampleFree(sample)


def test_gpm_gives_each_gpu_instance_its_activity(nvml: Any, reader: NvmlUsageReader) -> None:
    first = reader.read()
    instances = [(g.uuid, d.uuid) for g in first.gpus if g.gpm and g.mig for d in g.devices]
    if not instances:
        pytest.skip("no Hopper or newer GPU here is in MIG mode with instances")
    # nvml.h: two GPM samples "greater than 100ms" apart; this wait is that interval itself.
    time.sleep(GPM_MIN_INTERVAL_S * 2)
    second = {d.uuid: d for g in reader.read().gpus for d in g.devices}
    for _, device in instances:
        reading = second[device]
        assert reading.sm_active is not None
        assert 0 <= reading.sm_active <= 1
        assert reading.graphics_active is not None
        assert 0 <= reading.graphics_active <= 1
