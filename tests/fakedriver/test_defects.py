"""Where the NVML backend read NVIDIA's documentation wrong, shown on the fake driver (issue 23).

Each test failed on the backend before its fix: the Python simulator that the backend was tested
on shared each mistake, the fake driver plays what nvml.h documents.
"""

from __future__ import annotations

from pathlib import Path

from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend, load_pynvml
from sharing.mig.catalog import default_catalog

CATALOG = default_catalog()
A100 = simstate.resolve_product(CATALOG, "A100-SXM4-40GB")


def backend(root: Path) -> NvmlBackend:
    return NvmlBackend(load_pynvml(root), CATALOG)


async def test_a_compute_instance_without_a_mig_device_is_never_advertised_as_the_whole_gpu(
    state: Path, node_root: Path
) -> None:
    """nvmlComputeInstanceGetInfo's `device` is the PARENT GPU (nvml.h nvmlComputeInstanceInfo_st:
    "Parent device"): a compute instance not enumerated as a MIG device has no MIG UUID to give, and
    the GPU's own UUID must not stand in for it (a MIG-mode GPU handed out whole)."""
    simstate.init_state(state, [A100])
    nvml = backend(node_root)
    try:
        gpu = (await nvml.observe()).gpus[0].uuid
        await nvml.set_mig_mode(gpu, True)
        await nvml.create_instance(gpu, "3g.20gb", 4)
        with simstate.editing(state) as s:  # the fake driver's test hook: not enumerated
            s["gpus"][0]["gpuInstances"][0]["computeInstances"][0]["hidden"] = True
        node = await nvml.observe()
    finally:
        await nvml.close()
    assert gpu not in {ci.uuid for g in node.gpus for _, ci in g.mig_devices}
    assert [(u.index, u.uuid) for u in node.unreadable] == [(0, gpu)]  # fail closed: nothing of it used
    assert "no MIG device" in node.unreadable[0].error


async def test_mig_profiles_are_read_again_once_mig_is_on_where_the_driver_lists_none_while_off(
    state: Path, node_root: Path
) -> None:
    """R535 answers NOT_SUPPORTED for profile queries while MIG is off (hack/fakedriver/README.md,
    "Personalities"); the table must be read once MIG is on, not the empty answer kept."""
    simstate.init_state(state, [A100], personality="r535")
    nvml = backend(node_root)
    try:
        gpu = (await nvml.observe()).gpus[0]
        assert gpu.profiles is None
        await nvml.set_mig_mode(gpu.uuid, True)
        made = await nvml.create_instance(gpu.uuid, "3g.20gb", 4)
        observed = (await nvml.observe()).gpus[0]
    finally:
        await nvml.close()
    assert (made.profile, made.start) == ("3g.20gb", 4)
    assert observed.profiles is not None
    assert observed.profiles.profile("3g.20gb") is not None


async def test_mig_devices_whose_processes_cannot_be_read_count_as_in_use(
    state: Path, node_root: Path
) -> None:
    """An unprivileged container gets NO_PERMISSION for process lists in MIG mode (nvml.h,
    nvmlDeviceGetComputeRunningProcesses: aggregate information "only if the caller has appropriate
    privileges"): the GPU stays readable, and what cannot be seen is in use (never destroyed)."""
    simstate.init_state(state, [A100], unprivileged_processes=True)
    nvml = backend(node_root)
    try:
        gpu = (await nvml.observe()).gpus[0].uuid
        await nvml.set_mig_mode(gpu, True)
        made = await nvml.create_instance(gpu, "3g.20gb", 4)
        node = await nvml.observe()
    finally:
        await nvml.close()
    assert made.compute_instances[0].busy
    assert [g.uuid for g in node.gpus] == [gpu]
    assert node.unreadable == ()
    (instance,) = node.gpus[0].instances
    assert instance.busy
    assert node.gpus[0].busy
