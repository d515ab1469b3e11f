"""The simulated NVML: the driver's rules, pynvml's shapes, the state file and the test hooks."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sharing.errors import BackendError
from sharing.gpu import simstate
from sharing.gpu.simnvml import SimNvml
from sharing.mig.catalog import default_catalog

CATALOG = default_catalog()
REPO = Path(__file__).resolve().parents[2]


def make(tmp_path: Path, *products: str, pending: bool = False) -> tuple[SimNvml, Path]:
    path = tmp_path / "gpus.json"
    simstate.init_state(
        path, [simstate.resolve_product(CATALOG, p) for p in products], pending_mode_changes=pending
    )
    nvml = SimNvml(path, CATALOG, event_poll_s=0.001)
    nvml.nvmlInit()
    return nvml, path


def profile_id(product: str, name: str) -> int:
    return CATALOG.product(product).require_profile(name).id


def create(nvml: SimNvml, dev: int, product: str, profile: str, start: int) -> int:
    placement = nvml.c_nvmlGpuInstancePlacement_t()
    placement.start = start
    placement.size = CATALOG.product(product).require_profile(profile).size
    return int(
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            dev, profile_id(product, profile), ctypes.byref(placement)
        )
    )


def full_ci(nvml: SimNvml, gi: int, slices: int) -> int:
    enum = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices]
    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, enum, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    return int(nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id))


def test_uuids_look_real_and_are_stable_per_seed(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB", "A100-SXM4-40GB")
    first = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    simstate.init_state(path, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")] * 2)
    again = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    assert first == again
    assert len(set(first)) == 2
    for text in first:
        assert text.startswith("GPU-")
        uuid.UUID(text.removeprefix("GPU-"))


def test_calls_before_init_fail_as_in_nvml(tmp_path: Path) -> None:
    _, path = make(tmp_path, "A100-SXM4-40GB")
    fresh = SimNvml(path, CATALOG)
    with pytest.raises(fresh.NVMLError_Uninitialized):
        fresh.nvmlDeviceGetCount()


def test_bare_metal_mode_change_is_immediate_on_an_idle_gpu(tmp_path: Path) -> None:
    nvml, _ = make(tmp_path, "A100-SXM4-40GB")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceSetMigMode(dev, nvml.NVML_DEVICE_MIG_ENABLE) == nvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(dev) == [1, 1]


def test_vm_mode_change_stays_pending_until_reset(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB", pending=True)
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    # The activation status comes back as a value, not an exception.
    assert nvml.nvmlDeviceSetMigMode(dev, nvml.NVML_DEVICE_MIG_ENABLE) == nvml.NVML_ERROR_RESET_REQUIRED
    assert nvml.nvmlDeviceGetMigMode(dev) == [0, 1]
    simstate.reset(path)
    assert nvml.nvmlDeviceGetMigMode(dev) == [1, 1]


def test_mode_change_on_a_busy_gpu_is_in_use_and_pending(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    simstate.set_busy(path, nvml.nvmlDeviceGetUUID(dev), True)
    assert nvml.nvmlDeviceSetMigMode(dev, nvml.NVML_DEVICE_MIG_ENABLE) == nvml.NVML_ERROR_IN_USE
    assert nvml.nvmlDeviceGetMigMode(dev) == [0, 1]
    with pytest.raises(BackendError, match="has processes"):
        simstate.reset(path)


@pytest.mark.parametrize("product", ["T4", "Tesla T4", "NVIDIA L4"])
def test_gpus_without_mig_answer_not_supported(tmp_path: Path, product: str) -> None:
    nvml, _ = make(tmp_path, product)
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigMode(dev)
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceSetMigMode(dev, nvml.NVML_DEVICE_MIG_ENABLE)
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(dev, 0)


def test_creating_needs_mig_on(tmp_path: Path) -> None:
    nvml, _ = make(tmp_path, "A100-SXM4-40GB")
    with pytest.raises(nvml.NVMLError_NotSupported):
        create(nvml, nvml.nvmlDeviceGetHandleByIndex(0), "A100-SXM4-40GB", "3g.20gb", 0)


@pytest.mark.parametrize(
    ("first", "second", "error"),
    [
        pytest.param(("3g.20gb", 0), ("4g.20gb", 0), "NVMLError_InsufficientResources", id="overlap"),
        pytest.param(("2g.10gb", 2), ("3g.20gb", 0), "NVMLError_InsufficientResources", id="overlap-partial"),
        pytest.param(("1g.5gb+me", 0), ("1g.5gb+me", 1), "NVMLError_InsufficientResources", id="max-count"),
        pytest.param(("1g.5gb", 0), ("3g.20gb", 2), "NVMLError_InvalidArgument", id="not-a-placement"),
        pytest.param(("1g.5gb", 0), ("1g.5gb", 7), "NVMLError_InvalidArgument", id="past-the-end"),
    ],
)
def test_placement_rules(tmp_path: Path, first: tuple[str, int], second: tuple[str, int], error: str) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(dev, 1)
    create(nvml, dev, "A100-SXM4-40GB", *first)
    with pytest.raises(getattr(nvml, error)):
        create(nvml, dev, "A100-SXM4-40GB", *second)
    assert [(gi["profileId"], gi["start"]) for gi in simstate.read(path)["gpus"][0]["gpuInstances"]] == [
        (profile_id("A100-SXM4-40GB", first[0]), first[1])
    ]


def test_every_catalog_layout_maximum_fits(tmp_path: Path) -> None:
    # 7 x 1g on each eight-slice product and 4 x 1g on the A30: exactly what the catalog allows.
    nvml, _ = make(tmp_path, "A100-SXM4-40GB", "A30")
    for index, product in enumerate(["A100-SXM4-40GB", "A30"]):
        dev = nvml.nvmlDeviceGetHandleByIndex(index)
        nvml.nvmlDeviceSetMigMode(dev, 1)
        one = CATALOG.product(product).profiles[0]
        for start in one.placements:
            create(nvml, dev, product, one.name, start)
        with pytest.raises(nvml.NVMLError_InsufficientResources):
            create(nvml, dev, product, one.name, one.placements[0])


def test_caller_allocated_arrays(tmp_path: Path) -> None:
    nvml, _ = make(tmp_path, "H100-80GB-HBM3")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    profile = CATALOG.product("H100-80GB-HBM3").require_profile("1g.10gb")
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(dev, profile.id, None, ctypes.byref(count))
    assert count.value == 7
    small = (nvml.c_nvmlGpuInstancePlacement_t * 2)()
    count.value = 2
    with pytest.raises(nvml.NVMLError_InsufficientSize):
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(dev, profile.id, small, ctypes.byref(count))
    array = (nvml.c_nvmlGpuInstancePlacement_t * 7)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(dev, profile.id, array, ctypes.byref(count))
    assert [(p.start, p.size) for p in array[: count.value]] == [(s, 1) for s in profile.placements]


def test_destroy_order_and_busy_devices(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(dev, 1)
    gi = create(nvml, dev, "A100-SXM4-40GB", "3g.20gb", 4)
    ci = full_ci(nvml, gi, 3)
    with pytest.raises(nvml.NVMLError_InUse):  # a GPU instance with compute instances
        nvml.nvmlGpuInstanceDestroy(gi)
    mig_uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlComputeInstanceGetInfo(ci).device)
    simstate.set_busy(path, mig_uuid, True)
    with pytest.raises(nvml.NVMLError_InUse):  # a compute instance with processes
        nvml.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(nvml.NVMLError_InUse):  # MIG mode with instances
        nvml.nvmlDeviceSetMigMode(dev, 0)
    simstate.set_busy(path, mig_uuid, False)
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
    assert simstate.read(path)["gpus"][0]["gpuInstances"] == []


def test_mig_device_handles_are_sparse_and_typed_as_in_pynvml(tmp_path: Path) -> None:
    nvml, _ = make(tmp_path, "A100-SXM4-40GB")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(dev, 1)
    cis = [full_ci(nvml, create(nvml, dev, "A100-SXM4-40GB", "1g.5gb", s), 1) for s in range(3)]
    nvml.nvmlComputeInstanceDestroy(cis[1])
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(dev) == 7
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(dev, 1)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(dev, 2)
    flag = nvml.nvmlDeviceIsMigDeviceHandle(mig)
    assert isinstance(flag, ctypes.c_uint)
    assert flag.value == 1
    assert nvml.nvmlDeviceIsMigDeviceHandle(dev).value == 0
    assert (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig)) == (2, 0)
    assert nvml.nvmlDeviceGetUUID(mig).startswith("MIG-")


def test_mutations_are_counted_and_failed_calls_are_attempts_only(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceGetMigMode(dev)
    assert simstate.counters(path) == simstate.Counters(0, 0)
    nvml.nvmlDeviceSetMigMode(dev, 1)
    create(nvml, dev, "A100-SXM4-40GB", "7g.40gb", 0)
    with pytest.raises(nvml.NVMLError_InsufficientResources):
        create(nvml, dev, "A100-SXM4-40GB", "1g.5gb", 0)
    assert simstate.counters(path) == simstate.Counters(mutating_calls=3, mutations=2)


def test_state_is_shared_between_library_instances(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB")
    nvml.nvmlDeviceSetMigMode(nvml.nvmlDeviceGetHandleByIndex(0), 1)
    other = SimNvml(path, CATALOG)
    other.nvmlInit()
    assert other.nvmlDeviceGetMigMode(other.nvmlDeviceGetHandleByIndex(0)) == [1, 1]


def test_xid_events_with_mig_attribution(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB", "T4")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(dev, 1)
    ci = full_ci(nvml, create(nvml, dev, "A100-SXM4-40GB", "3g.20gb", 0), 3)
    mig_uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlComputeInstanceGetInfo(ci).device)
    events = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(dev, nvml.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(nvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait(events, 0)
    t4 = nvml.nvmlDeviceGetHandleByIndex(1)
    simstate.inject_xid(path, nvml.nvmlDeviceGetUUID(t4), 79)  # not registered: not delivered
    simstate.inject_xid(path, mig_uuid, 94)
    simstate.inject_xid(path, nvml.nvmlDeviceGetUUID(dev), 48)
    first = nvml.nvmlEventSetWait(events, 100)
    second = nvml.nvmlEventSetWait(events, 100)
    assert (first.device, first.eventType, first.eventData, first.gpuInstanceId, first.computeInstanceId) == (
        dev,
        0x8,
        94,
        0,
        0,
    )
    assert (second.eventData, second.gpuInstanceId, second.computeInstanceId) == (48, 0xFFFFFFFF, 0xFFFFFFFF)
    with pytest.raises(nvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait(events, 10)
    nvml.nvmlEventSetFree(events)


def test_crash_after_n_hardware_changes(tmp_path: Path) -> None:
    _, path = make(tmp_path, "A100-SXM4-40GB")
    script = (
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "from sharing.gpu.simnvml import SimNvml\n"
        "n = SimNvml(Path(sys.argv[1])); n.nvmlInit(); d = n.nvmlDeviceGetHandleByIndex(0)\n"
        "n.nvmlDeviceSetMigMode(d, 1)\n"
        "p = n.c_nvmlGpuInstancePlacement_t(); p.start, p.size = 0, 1\n"
        "n.nvmlDeviceCreateGpuInstanceWithPlacement(d, 19, ctypes.byref(p))\n"
        "print('not reached')\n"
    )
    env = {**os.environ, "SHARING_SIM_CRASH_AFTER": "2", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (137, "")
    state = simstate.read(path)
    assert state["mutations"] == 2
    assert len(state["gpus"][0]["gpuInstances"]) == 1  # the change before the crash is on disk


def test_unknown_devices_and_products_are_clear_errors(tmp_path: Path) -> None:
    _, path = make(tmp_path, "A100-SXM4-40GB")
    with pytest.raises(BackendError, match="no simulated GPU or MIG device"):
        simstate.set_busy(path, "GPU-nope", True)
    with pytest.raises(BackendError, match="cannot play"):
        simstate.resolve_product(CATALOG, "GeForce 256")
    with pytest.raises(BackendError, match="sharing sim init"):
        simstate.read(tmp_path / "missing.json")


def test_a_lost_gpu_answers_gpu_is_lost_and_the_others_still_answer(tmp_path: Path) -> None:
    nvml, path = make(tmp_path, "A100-SXM4-40GB", "A30")
    simstate.set_lost(path, 0, True)
    lost, fine = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(nvml.NVMLError) as caught:
        nvml.nvmlDeviceGetUUID(lost)
    assert nvml.NVML_ERROR_GPU_IS_LOST == caught.value.value
    assert "NVIDIA A30" == nvml.nvmlDeviceGetName(fine)
    assert 2 == nvml.nvmlDeviceGetCount()


def test_the_simulated_driver_reports_identity_and_the_twelve_slot_grid(tmp_path: Path) -> None:
    nvml, _ = make(tmp_path, "RTX-PRO-6000")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    assert (0x2BB510DE, (12, 0)) == (
        nvml.nvmlDeviceGetPciInfo(dev).pciDeviceId,
        nvml.nvmlDeviceGetCudaComputeCapability(dev),
    )
    info = nvml.nvmlPciInfoExt_v1_t()
    info.version = nvml.nvmlPciInfoExt_v1
    nvml.nvmlDeviceGetPciInfoExt(dev, ctypes.byref(info))
    assert (3, 2) == (info.baseClass, info.subClass)
    profile = nvml.nvmlDeviceGetGpuInstanceProfileInfo(dev, 0xF)  # 1_SLICE_ALL_ME: 1g.24gb+me.all
    assert (65, 1, 24192, 46, 4) == (
        profile.id,
        profile.instanceCount,
        profile.memorySizeMB,
        profile.multiprocessorCount,
        profile.decoderCount,
    )
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(dev, 5, None, ctypes.byref(count))
    array = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(dev, 5, array, ctypes.byref(count))
    assert [(0, 6), (6, 6)] == [(p.start, p.size) for p in array]
    assert ("580.65.06", 13000) == (nvml.nvmlSystemGetDriverVersion(), nvml.nvmlSystemGetCudaDriverVersion())
