"""The NVML usage reader (what the sampler reads each interval) over the real pynvml and the fake driver."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.gpu.nvmlapi import Nvml
from sharing.gpu.nvmlusage import NvmlUsageReader
from sharing.mig.catalog import default_catalog
from sharing.readings import DeviceReading, ProcessReading

CATALOG = default_catalog()
MIB = 1 << 20


class Clock:
    """A monotonic clock the test moves (GPM wants its two samples more than 100 ms apart)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def init(state: Path, *products: str) -> list[str]:
    made = simstate.init_state(state, [simstate.resolve_product(CATALOG, p) for p in products])
    return [g["uuid"] for g in made["gpus"]]


@pytest.fixture
async def backend(nvml: Nvml) -> AsyncIterator[NvmlBackend]:
    b = NvmlBackend(nvml, CATALOG)
    yield b
    await b.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def reader(nvml: Nvml, clock: Clock) -> Iterator[NvmlUsageReader]:
    r = NvmlUsageReader(nvml, clock, time.time)
    yield r
    r.close()


async def mig_devices(backend: NvmlBackend, gpu: str, *layout: tuple[str, int]) -> list[str]:
    """MIG on, one instance per (profile, start); their MIG UUIDs."""
    await backend.set_mig_mode(gpu, True)
    made = [await backend.create_instance(gpu, profile, start) for profile, start in layout]
    return [gi.compute_instances[0].uuid for gi in made]


def test_a_gpu_without_mig_gives_its_sensors_memory_and_each_processs_share(
    state: Path, reader: NvmlUsageReader
) -> None:
    l4, t4 = init(state, "L4", "T4")
    simstate.start_process(state, l4, 4100, used_mib=3000, sm=45)
    simstate.start_process(state, l4, 4200, used_mib=1000, sm=15)
    simstate.start_process(state, l4, 4300, used_mib=24, sm=0)
    simstate.set_sensors(state, l4, power_watts=188.5, temperature_c=66)
    readings = reader.read()
    assert readings.unreadable == ()
    first, second = readings.gpus
    assert (first.index, first.uuid, first.mig, first.gpm) == (0, l4, False, False)
    assert (first.power_watts, first.temperature_celsius) == (188.5, 66.0)
    assert (first.memory_used_bytes, first.memory_total_bytes) == (4024 * MIB, 23034 * MIB)
    assert first.utilization == 0.6
    assert first.devices == (
        DeviceReading(
            l4, 4024 * MIB, 23034 * MIB,
            (ProcessReading(4100, 3000 * MIB, 0.45), ProcessReading(4200, 1000 * MIB, 0.15),
             ProcessReading(4300, 24 * MIB, 0.0)),
        ),
    )  # fmt: skip
    assert (second.uuid, second.power_watts, second.utilization, second.devices[0].processes) == (
        t4,
        60.0,
        0.0,
        (),
    )


async def test_mig_devices_give_their_own_memory_and_processes_without_per_process_sm(
    state: Path, backend: NvmlBackend, reader: NvmlUsageReader
) -> None:
    (a100,) = init(state, "A100-SXM4-40GB")
    small, large = await mig_devices(backend, a100, ("1g.5gb", 0), ("3g.20gb", 4))
    simstate.start_process(state, small, 500, used_mib=2048, sm=40)
    simstate.start_process(state, large, 600, used_mib=8192, sm=70)
    with structlog.testing.capture_logs() as logs:
        first = reader.read()
        reader.read()
    (gpu,) = first.gpus
    assert (gpu.mig, gpu.utilization, gpu.gpm) == (True, None, False)
    assert (gpu.memory_used_bytes, gpu.memory_total_bytes) == (10240 * MIB, 40960 * MIB)
    assert [(d.uuid, d.gpu_instance is not None, d.memory_used_bytes, d.memory_total_bytes, d.processes,
             d.sm_active) for d in gpu.devices] == [
        (small, True, 2048 * MIB, 4864 * MIB, (ProcessReading(500, 2048 * MIB, None),), None),
        (large, True, 8192 * MIB, 19968 * MIB, (ProcessReading(600, 8192 * MIB, None),), None),
    ]  # fmt: skip
    # No GPM before Hopper: the field is absent, and the log says so once.
    assert [entry["gpu"] for entry in logs if entry["event"] == "gpm_not_supported"] == [0]


async def test_gpm_gives_each_gpu_instance_its_activity_between_two_readings(
    state: Path, backend: NvmlBackend, reader: NvmlUsageReader, clock: Clock
) -> None:
    (h100,) = init(state, "H100-80GB-HBM3")
    small, large = await mig_devices(backend, h100, ("1g.10gb", 0), ("3g.40gb", 4))
    simstate.start_process(state, small, 700, used_mib=100, sm=60)
    simstate.start_process(state, large, 800, used_mib=100, sm=20)
    simstate.start_process(state, large, 801, used_mib=100, sm=10)
    seeded = reader.read()
    assert seeded.gpus[0].gpm
    assert [d.sm_active for d in seeded.gpus[0].devices] == [None, None]  # one sample so far
    clock.now += 0.05  # nvml.h: more than 100 ms apart; nearer, no figure
    assert [d.sm_active for d in reader.read().gpus[0].devices] == [None, None]
    clock.now += 10
    activity = [(d.uuid, d.sm_active, d.graphics_active) for d in reader.read().gpus[0].devices]
    assert activity == [(small, 0.6, 0.6), (large, 0.3, 0.3)]
    # The small instance made again: a new MIG device, whose first reading has no figure.
    gi = next(g for g in (await backend.observe()).gpus[0].instances if g.profile == "1g.10gb")
    simstate.stop_processes(state, small)
    await backend.destroy_instance(h100, gi.id)
    (again,) = [gi.compute_instances[0].uuid for gi in [await backend.create_instance(h100, "1g.10gb", 0)]]
    clock.now += 10
    devices = {d.uuid: d.sm_active for d in reader.read().gpus[0].devices}
    assert devices == {again: None, large: 0.3}


async def test_a_lost_gpu_is_unreadable_and_the_others_are_read(state: Path, reader: NvmlUsageReader) -> None:
    _, t4 = init(state, "L4", "T4")
    simstate.set_lost(state, 0, True)
    readings = reader.read()
    assert [g.uuid for g in readings.gpus] == [t4]
    assert [u.index for u in readings.unreadable] == [0]
    assert "NVML error" in readings.unreadable[0].error


async def test_an_unprivileged_container_reads_no_mig_processes(
    state: Path, backend: NvmlBackend, reader: NvmlUsageReader
) -> None:
    (a100,) = init(state, "A100-SXM4-40GB")
    (small,) = await mig_devices(backend, a100, ("1g.5gb", 0))
    simstate.start_process(state, small, 500, used_mib=64)
    with simstate.editing(state) as raw:
        raw["unprivilegedProcesses"] = True
    (device,) = reader.read().gpus[0].devices
    assert (device.uuid, device.processes, device.memory_used_bytes) == (small, None, 64 * MIB)
