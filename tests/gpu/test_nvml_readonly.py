"""The NVML backend on a real GPU, reading only: GPUs, MIG mode, the driver's profiles vs the catalog, labels.

The backend gets pynvml behind a guard that fails the test on any call that could change the
GPU, so these tests cannot change MIG mode, create or destroy instances, or reset anything.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sharing.devices.inventory import build_inventory
from sharing.gpu.nvml import NvmlBackend
from sharing.labels import node_labels, owned
from sharing.mig.catalog import Product, default_catalog, differences

CATALOG = default_catalog()
_CHANGES = ("Set", "Create", "Destroy", "Reset", "Clear", "Register")


class ReadOnly:
    """pynvml with every changing call refused."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def __getattr__(self, name: str) -> Any:
        if (
            name.startswith("nvml")
            and any(word in name for word in _CHANGES)
            and name != "nvmlEventSetCreate"
        ):
            raise AssertionError(f"a read-only GPU test called {name}")
        return getattr(self._nvml, name)


@pytest.fixture
async def backend(nvml: Any) -> AsyncIterator[NvmlBackend]:
    b = NvmlBackend(ReadOnly(nvml), CATALOG)
    yield b
    await b.close()


def test_the_guard_refuses_changes(nvml: Any) -> None:
    with pytest.raises(AssertionError, match="nvmlDeviceSetMigMode"):
        _ = ReadOnly(nvml).nvmlDeviceSetMigMode


async def test_observe_matches_nvml(backend: NvmlBackend, nvml: Any) -> None:
    gpus = (await backend.observe()).gpus
    assert len(gpus) == nvml.nvmlDeviceGetCount()
    for gpu in gpus:
        handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
        assert gpu.uuid == nvml.nvmlDeviceGetUUID(handle)
        assert gpu.uuid.startswith("GPU-")
        assert gpu.product == nvml.nvmlDeviceGetName(handle)
        assert gpu.memory_mib == nvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            assert (gpu.mig_capable, gpu.mig_enabled, gpu.instances) == (False, False, ())
            continue
        assert (gpu.mig_capable, gpu.mig_enabled, gpu.mig_pending) == (True, current == 1, pending == 1)
        for gi in gpu.instances:
            assert gi.size > 0
            assert all(ci.uuid.startswith("MIG-") for ci in gi.compute_instances)


async def test_the_drivers_profiles_agree_with_the_catalog(backend: NvmlBackend) -> None:
    """Where this GPU is in the catalog, the catalog must say what its driver says.

    Compared: profiles, memory and placements.
    """
    gpus = [g for g in (await backend.observe()).gpus if g.mig_capable]
    if not gpus:
        pytest.skip("no MIG-capable GPU here")
    compared = 0
    for gpu in gpus:
        table = await backend.profiles(gpu.uuid)
        if table is None:  # older drivers refuse profile queries while MIG is off
            pytest.skip(f"the driver does not list MIG profiles on GPU {gpu.index} now")
        product = CATALOG.for_gpu(gpu.product, gpu.pci_device_id)
        if not isinstance(product, Product):
            continue
        assert () == differences(table, product), f"GPU {gpu.index} {gpu.product} ({gpu.pci_device_id:#010x})"
        for gi in gpu.instances:
            known = table.profile(gi.profile)
            assert known is not None
            assert gi.start in known.placements
        compared += 1
    if compared == 0:
        pytest.skip("no MIG GPU here is in the catalog")


async def test_labels_from_a_real_gpu_are_valid_label_values(backend: NvmlBackend) -> None:
    node = await backend.observe()
    labels = node_labels(node, None, build_inventory(node, None), None)
    assert labels["nvidia.com/gpu.present"] == "true"
    assert node.driver is not None
    assert labels["nvidia.com/cuda.driver-version.full"] == node.driver.version
    for key, value in labels.items():
        assert owned(key), key
        assert re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?", value), (key, value)
