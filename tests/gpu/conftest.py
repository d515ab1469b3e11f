"""Tests on a real GPU through NVML, read-only: skipped where NVML or a GPU is missing.

These run on machines that others share: they only read (never change MIG mode, never create or
destroy an instance, never reset). Every test here is marked `gpu`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def nvml() -> Iterator[Any]:
    """The real pynvml, initialised; the test is skipped when NVML or a GPU is not there."""
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        pytest.skip("nvidia-ml-py (pynvml) is not installed")
    loaded = str(getattr(getattr(pynvml, "nvmlLib", None), "_name", "") or "")
    if "fakedriver" in loaded:  # pynvml keeps the library an earlier test in this process loaded
        pytest.skip(f"the fake NVIDIA driver is loaded in this process ({loaded}), not a real one")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        pytest.skip(f"NVML cannot be loaded here: {err}")
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            pytest.skip("NVML sees no GPU")
        yield pynvml
    finally:
        pynvml.nvmlShutdown()
