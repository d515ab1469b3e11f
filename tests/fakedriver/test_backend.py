"""NvmlBackend's whole behaviour over the real pynvml and the fake driver (the code run on real GPUs)."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest
from lab.deadlines import scaled

from sharing.errors import BackendError
from sharing.gpu import open_backend, simstate
from sharing.gpu.backend import (
    GpuBusyError,
    GpuNotFoundError,
    InsufficientResourcesError,
    NotSupportedError,
    NvmlUnavailableError,
)
from sharing.gpu.devfiles import DriverFiles
from sharing.gpu.nvml import NvmlBackend
from sharing.gpu.nvmlapi import Nvml
from sharing.mig.catalog import Catalog, default_catalog, differences
from sharing.model import DriverInfo, Gpu, GpuUuid, HealthEvent
from sharing.ops import Metrics
from tests.fakedriver.conftest import make_gpu_instance

CATALOG = default_catalog()


@pytest.fixture
def gpus(state: Path) -> Path:
    simstate.init_state(
        state, [simstate.resolve_product(CATALOG, p) for p in ("A100-SXM4-40GB", "H100-80GB-HBM3", "T4")]
    )
    return state


def over(nvml: Nvml, catalog: Catalog = CATALOG) -> NvmlBackend:
    return NvmlBackend(nvml, catalog, event_poll_s=0.01)


@pytest.fixture
async def backend(gpus: Path, nvml: Nvml) -> AsyncIterator[NvmlBackend]:
    b = over(nvml)
    yield b
    await b.close()


class Replaced:
    """The real pynvml with some functions replaced (a test's view of a misbehaving driver)."""

    def __init__(self, nvml: Nvml, **functions: Callable[..., Any]) -> None:
        self._nvml, self._functions = nvml, functions

    def __getattr__(self, name: str) -> Any:
        return self._functions.get(name) or getattr(self._nvml, name)


def replaced(nvml: Nvml, **functions: Callable[..., Any]) -> Nvml:
    return cast(Nvml, Replaced(nvml, **functions))


async def uuids(backend: NvmlBackend) -> list[GpuUuid]:
    return [g.uuid for g in (await backend.observe()).gpus]


async def test_observe_a_fresh_node(backend: NvmlBackend) -> None:
    gpus = (await backend.observe()).gpus
    assert [
        (g.index, g.product, g.memory_mib, g.mig_capable, g.mig_enabled, g.mig_pending, g.busy) for g in gpus
    ] == [
        (0, "NVIDIA A100-SXM4-40GB", 40960, True, False, False, False),
        (1, "NVIDIA H100 80GB HBM3", 81559, True, False, False, False),
        (2, "Tesla T4", 15360, False, False, False, False),
    ]
    assert all(g.uuid.startswith("GPU-") and g.instances == () for g in gpus)


async def test_create_observe_destroy(backend: NvmlBackend, gpus: Path) -> None:
    state = gpus
    a100 = (await uuids(backend))[0]
    assert await backend.set_mig_mode(a100, True) is False
    made = await backend.create_instance(a100, "3g.20gb", 4)
    small = await backend.create_instance(a100, "1g.5gb", 0)
    assert (made.profile, made.start, made.size, len(made.compute_instances)) == ("3g.20gb", 4, 4, 1)
    assert made.compute_instances[0].uuid.startswith("MIG-")
    gpu = (await backend.observe()).gpus[0]
    assert (gpu.mig_enabled, gpu.mig_pending) == (True, True)
    assert gpu.instances == (small, made)  # ordered by start, same values as create returned
    before = simstate.counters(state).mutations
    await backend.destroy_instance(a100, made.id)
    assert simstate.counters(state).mutations - before == 2  # the compute instance, then the GPU instance
    assert (await backend.observe()).gpus[0].instances == (small,)


def histogram_counts(metrics: Metrics, name: str) -> dict[str, float]:
    """{first label value: count} of a histogram, as Prometheus scrapes it."""
    counts = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith(f"{name}_count{{"):
            series, value = line.rsplit(" ", 1)
            counts[series.split('"')[1]] = float(value)
    return counts


async def test_each_mig_operation_is_timed_by_its_name(gpus: Path, nvml: Nvml) -> None:
    """Both directions of every operation the driver is asked for, each in its series of
    gpu_sharing_mig_operation_seconds, failed calls too (the half-built completion makes no GPU instance)."""
    metrics = Metrics("test")
    backend = NvmlBackend(nvml, CATALOG, mig_seconds=metrics.mig_operation)
    try:
        a100 = (await uuids(backend))[0]
        await backend.set_mig_mode(a100, True)
        made = await backend.create_instance(a100, "3g.20gb", 4)
        with pytest.raises(InsufficientResourcesError):  # overlaps the 3g.20gb: the driver refuses it
            await backend.create_instance(a100, "7g.40gb", 0)
        await backend.destroy_instance(a100, made.id)
        await backend.set_mig_mode(a100, False)
    finally:
        await backend.close()
    assert {
        "enable_mig": 1.0, "disable_mig": 1.0, "create_gpu_instance": 2.0, "create_compute_instance": 1.0,
        "destroy_compute_instance": 1.0, "destroy_gpu_instance": 1.0,
    } == histogram_counts(metrics, "gpu_sharing_mig_operation_seconds")  # fmt: skip


async def test_the_new_mig_device_is_found_without_reading_the_others(gpus: Path, nvml: Nvml) -> None:
    """After a create only the new MIG device's UUID and processes are read, not every device's (NVIDIA
    measured such a walk at O(10 s) under load, k8s-dra-driver-gpu nvlib.go createMigDevice)."""
    read: list[str] = []
    asked: list[object] = []

    def uuid_of(handle: object) -> str:
        found = str(nvml.nvmlDeviceGetUUID(handle))
        read.append(found)
        return found

    def processes(handle: object) -> list[object]:
        asked.append(handle)
        return list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))

    counting = replaced(nvml, nvmlDeviceGetUUID=uuid_of, nvmlDeviceGetComputeRunningProcesses=processes)
    backend = over(counting)
    try:
        a100 = (await uuids(backend))[0]
        await backend.set_mig_mode(a100, True)
        for start in range(6):
            await backend.create_instance(a100, "1g.5gb", start)
        before = {ci.uuid for _, ci in (await backend.observe()).gpus[0].mig_devices}
        read.clear()
        asked.clear()
        made = await backend.create_instance(a100, "1g.5gb", 6)
        uuids_read, processes_read = list(read), len(asked)
        after = (await backend.observe()).gpus[0]
    finally:
        await backend.close()
    new = made.compute_instances[0]
    assert (len(before), new.uuid not in before) == (6, True)
    assert [u for u in uuids_read if u.startswith("MIG-")] == [new.uuid]  # not the six others
    assert processes_read == 1
    assert made in after.instances  # what create says it made is what the driver then reports


async def test_a_latency_in_the_state_is_spent_in_that_call_and_the_call_still_does_its_work(
    gpus: Path, nvml: Nvml
) -> None:
    """The fake driver's contract (hack/fakedriver/README.md, "Latencies"): a call with a latency
    returns no sooner than that, with the result it has without one."""
    simstate.set_latencies(gpus, {"nvmlGpuInstanceCreateComputeInstance": 0.25})
    seconds: list[tuple[str, float]] = []
    backend = NvmlBackend(nvml, CATALOG, mig_seconds=lambda op, s: seconds.append((op, s)))
    try:
        a100 = (await uuids(backend))[0]
        await backend.set_mig_mode(a100, True)
        made = await backend.create_instance(a100, "2g.10gb", 2)
        observed = (await backend.observe()).gpus[0].instances
    finally:
        await backend.close()
    assert [op for op, _ in seconds] == ["enable_mig", "create_gpu_instance", "create_compute_instance"]
    assert dict(seconds)["create_compute_instance"] >= 0.25
    assert observed == (made,)
    assert (made.profile, made.start, len(made.compute_instances)) == ("2g.10gb", 2, 1)


async def test_mode_change_pending_until_reset(state: Path, node_root: Path) -> None:
    path = state
    simstate.init_state(
        path, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")], pending_mode_changes=True
    )
    backend = open_backend("nvml", CATALOG, driver_root=node_root)
    try:
        gpu = (await backend.observe()).gpus[0]
        assert await backend.set_mig_mode(gpu.uuid, True) is True
        observed = (await backend.observe()).gpus[0]
        assert (observed.mig_enabled, observed.mig_pending) == (False, True)
        simstate.reset(path)
        observed = (await backend.observe()).gpus[0]
        assert (observed.mig_enabled, observed.mig_pending) == (True, True)
    finally:
        await backend.close()


async def test_mode_change_on_a_busy_gpu_is_withdrawn_and_done_once_it_is_idle(
    backend: NvmlBackend, gpus: Path
) -> None:
    state = gpus
    a100 = (await uuids(backend))[0]
    simstate.set_busy(state, a100, True)
    with pytest.raises(GpuBusyError, match="in use"):
        await backend.set_mig_mode(a100, True)
    gpu = (await backend.observe()).gpus[0]
    assert (gpu.busy, gpu.mig_enabled, gpu.mig_pending) == (True, False, False)  # nothing waits for a reset
    simstate.set_busy(state, a100, False)
    assert await backend.set_mig_mode(a100, True) is False
    assert (await backend.observe()).gpus[0].mig_enabled


async def test_busy_instances_are_reported_and_protected(backend: NvmlBackend, gpus: Path) -> None:
    state = gpus
    a100 = (await uuids(backend))[0]
    await backend.set_mig_mode(a100, True)
    made = await backend.create_instance(a100, "2g.10gb", 2)
    simstate.set_busy(state, made.compute_instances[0].uuid, True)
    gpu = (await backend.observe()).gpus[0]
    assert (gpu.busy, gpu.instances[0].busy, gpu.instances[0].compute_instances[0].busy) == (True, True, True)
    with pytest.raises(GpuBusyError, match=r"GPU 0 .*in use"):
        await backend.destroy_instance(a100, made.id)
    assert (await backend.observe()).gpus[0].instances == gpu.instances


async def test_error_mapping_names_the_gpu(backend: NvmlBackend) -> None:
    a100, h100, t4 = await uuids(backend)
    with pytest.raises(NotSupportedError, match=rf"GPU 2 \({t4}\).*no MIG"):
        await backend.set_mig_mode(t4, True)
    with pytest.raises(NotSupportedError, match="MIG mode is off"):
        await backend.create_instance(a100, "1g.5gb", 0)
    await backend.set_mig_mode(h100, True)
    await backend.create_instance(h100, "4g.40gb", 0)
    with pytest.raises(InsufficientResourcesError, match=r"creating 3g.40gb@0 on GPU 1"):
        await backend.create_instance(h100, "3g.40gb", 0)
    with pytest.raises(BackendError, match=r"cannot start at slot 2 \(valid: 0, 4\)"):
        await backend.create_instance(h100, "3g.40gb", 2)
    with pytest.raises(BackendError, match=r"no such MIG profile .*valid: .*1g.10gb"):
        await backend.create_instance(h100, "1g.5gb", 0)
    with pytest.raises(GpuNotFoundError, match="GPU instance 9"):
        await backend.destroy_instance(h100, 9)
    with pytest.raises(GpuNotFoundError, match="no readable GPU with UUID GPU-nope"):
        await backend.destroy_instance(GpuUuid("GPU-nope"), 0)


async def test_a_half_built_instance_is_completed_not_duplicated(
    backend: NvmlBackend, gpus: Path, nvml: Nvml
) -> None:
    state = gpus
    a100 = (await uuids(backend))[0]
    await backend.set_mig_mode(a100, True)
    make_gpu_instance(nvml, 0, 9, 4, 4)
    assert (await backend.observe()).gpus[0].instances[0].compute_instances == ()
    before = simstate.counters(state).mutations
    made = await backend.create_instance(a100, "3g.20gb", 4)
    assert simstate.counters(state).mutations - before == 1  # only the compute instance
    assert len(made.compute_instances) == 1
    with pytest.raises(BackendError, match="already exists"):
        await backend.create_instance(a100, "3g.20gb", 4)


async def test_the_driver_reports_the_catalogs_profiles(backend: NvmlBackend) -> None:
    for gpu in (await backend.observe()).gpus[:2]:
        table = await backend.profiles(gpu.uuid)
        assert table is not None
        assert table == gpu.profiles
        assert (table.origin, table.compute_capability) == (
            "driver",
            CATALOG.product(gpu.product).compute_capability,
        )
        assert () == differences(table, CATALOG.product(gpu.product))
    assert await backend.profiles((await uuids(backend))[2]) is None  # T4: no MIG
    assert {} == backend.catalog_differences


async def test_the_drivers_names_win_and_the_disagreement_is_recorded(gpus: Path, nvml: Nvml) -> None:
    """The agent uses what the driver reports; where the catalog says otherwise it is logged, not used."""
    a100 = CATALOG.product("A100-SXM4-40GB")
    renamed = tuple(
        dataclasses.replace(p, name="3g.19gb") if p.name == "3g.20gb" else p for p in a100.profiles
    )
    catalog = Catalog(
        tuple(dataclasses.replace(p, profiles=renamed) if p is a100 else p for p in CATALOG.products),
        CATALOG.plain,
    )
    backend = over(nvml, catalog)
    try:
        gpu = (await backend.observe()).gpus[0]
        assert gpu.profiles is not None
        assert gpu.profiles.profile("3g.20gb") is not None
        await backend.set_mig_mode(gpu.uuid, True)
        made = await backend.create_instance(gpu.uuid, "3g.20gb", 0)
        assert made.profile == "3g.20gb"
        with pytest.raises(BackendError, match="no such MIG profile"):
            await backend.create_instance(gpu.uuid, "3g.19gb", 4)
        assert backend.catalog_differences == {
            gpu.uuid: ("3g.20gb (id 9): name is 3g.20gb on the driver, 3g.19gb here",)
        }
    finally:
        await backend.close()


async def test_identity_versions_and_architecture_are_observed(backend: NvmlBackend) -> None:
    node = await backend.observe()
    a100, h100, t4 = node.gpus
    assert (a100.pci_device_id, a100.compute_capability, a100.pci_class) == (0x20B010DE, (8, 0), 0x030200)
    assert (h100.pci_device_id, h100.compute_capability) == (0x233010DE, (9, 0))
    assert (t4.compute_capability, t4.profiles, t4.mig_capable) == ((7, 5), None, False)
    # What NVIDIA's DRA driver publishes as brand, architecture and resource.kubernetes.io/pciBusID.
    assert [(g.brand, g.architecture, g.pci_bus_id) for g in node.gpus] == [
        ("Nvidia", "Ampere", "0000:10:00.0"),
        ("Nvidia", "Hopper", "0000:11:00.0"),
        ("Nvidia", "Turing", "0000:12:00.0"),
    ]
    assert node.driver == DriverInfo("580.65.06", 13000)  # the r580 personality's
    assert not node.virtual


async def test_a_lost_gpu_does_not_hide_the_others(backend: NvmlBackend, gpus: Path) -> None:
    state = gpus
    a100, h100, t4 = await uuids(backend)
    simstate.set_lost(state, 1, True)
    node = await backend.observe()
    assert [g.uuid for g in node.gpus] == [a100, t4]
    (lost,) = node.unreadable
    assert (lost.index, lost.uuid) == (1, h100)
    assert "NVML error 15" in lost.error
    assert len(lost.error) <= 300
    with pytest.raises(GpuNotFoundError):
        await backend.set_mig_mode(h100, True)
    simstate.set_lost(state, 1, False)
    assert [g.uuid for g in (await backend.observe()).gpus] == [a100, h100, t4]


async def test_a_gpu_lost_before_it_was_ever_read_has_no_uuid(gpus: Path, nvml: Nvml) -> None:
    simstate.set_lost(gpus, 0, True)
    backend = over(nvml)
    try:
        node = await backend.observe()
    finally:
        await backend.close()
    assert [(u.index, u.uuid) for u in node.unreadable] == [(0, None)]
    assert 2 == len(node.gpus)


def make_compute_instances(nvml: Any, gpu: int, gi_id: int, count: int) -> None:
    """`count` one-slice compute instances in GPU instance `gi_id`, made by another NVML user."""
    nvml.nvmlInit()  # reference counted
    try:
        gi = nvml.nvmlDeviceGetGpuInstanceById(nvml.nvmlDeviceGetHandleByIndex(gpu), gi_id)
        info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, nvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        )
        for _ in range(count):
            nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    finally:
        nvml.nvmlShutdown()


async def test_compute_instances_another_tool_makes_are_seen(
    backend: NvmlBackend, gpus: Path, nvml: Nvml
) -> None:
    """The compute-instance profiles a GPU-instance profile offers are asked once: all of them, not
    only the ones in use when first read."""
    a100 = (await uuids(backend))[0]
    await backend.set_mig_mode(a100, True)
    made = await backend.create_instance(a100, "3g.20gb", 0)
    (gi,) = (await backend.observe()).gpus[0].instances
    assert len(gi.compute_instances) == 1
    await backend.destroy_instance(a100, made.id)
    make_gpu_instance(nvml, 0, 9, 4, 4)  # a 3g.20gb at slot 4 (A100 profile id 9), by someone else
    gi_id = (await backend.observe()).gpus[0].instances[0].id
    make_compute_instances(nvml, 0, gi_id, 2)
    (gi,) = (await backend.observe()).gpus[0].instances
    assert (gi.profile, gi.start, len(gi.compute_instances)) == ("3g.20gb", 4, 2)
    assert all(ci.uuid.startswith("MIG-") for ci in gi.compute_instances)
    await backend.destroy_instance(a100, gi.id)  # every compute instance first, then the GPU instance
    assert (await backend.observe()).gpus[0].instances == ()


def profile_names(gpu: Gpu) -> list[str]:
    return [p.name for p in gpu.profiles.profiles] if gpu.profiles is not None else []


async def test_a_new_driver_is_read_afresh(backend: NvmlBackend, gpus: Path) -> None:
    """What is kept of a GPU holds for one driver: another version's profile table is read again."""
    a100 = (await uuids(backend))[0]
    await backend.set_mig_mode(a100, True)
    assert "1g.10gb" in profile_names((await backend.observe()).gpus[0])
    drop_profile(gpus, 0, "1g.10gb")
    with simstate.editing(gpus) as state:
        state["driverVersion"] = "590.10.01"
    node = await backend.observe()
    assert node.driver == DriverInfo("590.10.01", 13000)
    assert "1g.10gb" not in profile_names(node.gpus[0])


def drop_profile(path: Path, gpu: int, name: str) -> None:
    """The driver lists one profile less for the GPU (from its next read of the table on)."""
    with simstate.editing(path) as state:
        table = state["gpus"][gpu]["mig"]
        table["profiles"] = [p for p in table["profiles"] if p["name"] != name]


@pytest.mark.parametrize("event", ["another tool changes the MIG mode", "the GPU is lost and found"])
async def test_the_profile_table_is_read_again(
    event: str, backend: NvmlBackend, gpus: Path, nvml: Nvml
) -> None:
    """The table holds for "the lifetime of a MIG mode" (nvml.h): after a mode change, or a GPU that
    could not be read, it is the driver's again."""
    a100 = (await uuids(backend))[0]
    assert "1g.10gb" in profile_names((await backend.observe()).gpus[0])
    drop_profile(gpus, 0, "1g.10gb")
    if event.startswith("another tool"):
        other = over(nvml)
        await other.set_mig_mode(a100, True)
        await other.close()
    else:
        simstate.set_lost(gpus, 0, True)
        assert [u.uuid for u in (await backend.observe()).unreadable] == [a100]
        simstate.set_lost(gpus, 0, False)
    gpu = (await backend.observe()).gpus[0]
    assert gpu.uuid == a100
    assert "1g.10gb" not in profile_names(gpu)


async def test_a_gpu_at_another_index_is_read_afresh(backend: NvmlBackend, gpus: Path) -> None:
    """A UUID found at another index (the GPUs enumerated in another order) is read again there:
    the bus id and the minor number are the slot's, and changes reach the GPU that has the UUID."""
    a100, h100, _ = await uuids(backend)
    with simstate.editing(gpus) as state:
        first, second = state["gpus"][0], state["gpus"][1]
        first["uuid"], second["uuid"] = second["uuid"], first["uuid"]
    node = await backend.observe()
    assert [(g.uuid, g.product, g.pci_bus_id) for g in node.gpus[:2]] == [
        (h100, "NVIDIA A100-SXM4-40GB", "0000:10:00.0"),
        (a100, "NVIDIA H100 80GB HBM3", "0000:11:00.0"),
    ]
    await backend.set_mig_mode(a100, True)
    assert [g.mig_enabled for g in (await backend.observe()).gpus[:2]] == [False, True]


async def test_failing_to_count_the_gpus_fails_the_observation(gpus: Path, nvml: Nvml) -> None:
    def no_count() -> int:
        raise nvml.NVMLError(999)

    backend = over(replaced(nvml, nvmlDeviceGetCount=no_count))
    try:
        with pytest.raises(BackendError, match="counting the GPUs on this node"):
            await backend.observe()
    finally:
        await backend.close()


async def test_health_events(backend: NvmlBackend, gpus: Path) -> None:
    state = gpus
    a100 = (await uuids(backend))[0]
    await backend.set_mig_mode(a100, True)
    made = await backend.create_instance(a100, "7g.40gb", 0)
    mig = made.compute_instances[0].uuid
    events = backend.health_events()
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0)  # the watch's first step hands its registration to the NVML worker ...
    await backend.observe()  # ... which runs it before this (one worker, in order): registered now
    simstate.inject_xid(state, mig, 13)  # an application error: ignored
    simstate.inject_xid(state, mig, 94)
    simstate.inject_xid(state, a100, 79)
    got = [await asyncio.wait_for(first, scaled(5)), await asyncio.wait_for(anext(events), scaled(5))]
    await events.aclose()
    assert got == [
        HealthEvent(a100, healthy=False, xid=94, mig_uuid=mig),
        HealthEvent(a100, healthy=False, xid=79, mig_uuid=None),
    ]


async def test_nvml_calls_run_on_one_worker_thread(gpus: Path, nvml: Nvml) -> None:
    seen: set[str] = set()

    def count() -> int:
        seen.add(threading.current_thread().name)
        return nvml.nvmlDeviceGetCount()

    backend = over(replaced(nvml, nvmlDeviceGetCount=count))
    try:
        await asyncio.gather(*(backend.observe() for _ in range(3)))
    finally:
        await backend.close()
    assert len(seen) == 1
    assert next(iter(seen)).startswith("nvml")
    assert threading.current_thread().name not in seen


async def test_nvml_that_cannot_load_says_what_to_check(gpus: Path, nvml: Nvml) -> None:
    def broken() -> None:
        raise nvml.NVMLError(12)

    backend = over(replaced(nvml, nvmlInit=broken))
    try:
        with pytest.raises(NvmlUnavailableError, match="is the NVIDIA driver installed"):
            await backend.observe()
    finally:
        await backend.close()


def test_a_driver_root_without_the_library_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(
        NvmlUnavailableError, match=rf"no libnvidia-ml.so.1 under the driver root {tmp_path} .*usr/lib64"
    ):
        open_backend("nvml", CATALOG, driver_root=tmp_path)
    with pytest.raises(BackendError, match="unknown GPU backend"):
        open_backend("sim", CATALOG)


def test_the_library_under_the_driver_root_is_the_one_pynvml_uses(
    node_root: Path, state: Path, nvml: Nvml
) -> None:
    """pynvml opens libnvidia-ml.so.1 by name; the dynamic loader hands it the one loaded by path."""
    import pynvml  # noqa: PLC0415  (what the backend imports, looked at from outside)

    # Its own GPUs: with none (no state yet in a process that ran no test before) the driver is
    # "not loaded", as when the kernel module is missing.
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "T4")])
    nvml.nvmlInit()
    try:
        loaded = ctypes.CDLL(str(node_root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"))
        assert pynvml.nvmlLib._handle == loaded._handle
        assert 1 == nvml.nvmlDeviceGetCount()
    finally:
        nvml.nvmlShutdown()


def test_device_files_are_the_driver_roots(node_root: Path, nvml: Nvml) -> None:
    backend = open_backend("nvml", CATALOG, driver_root=node_root)
    files = backend.device_files
    assert isinstance(files, DriverFiles)
    assert (files.dev, files.caps) == (node_root / "dev", node_root / "proc/driver/nvidia/capabilities")


async def test_the_nvml_worker_thread_is_named_for_top_and_proc(backend: NvmlBackend) -> None:
    """`top -H` and /proc/PID/task/TID/comm show it (the fleet bench tells NVML's CPU apart so)."""
    await backend.observe()
    assert "nvml" in {(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}
