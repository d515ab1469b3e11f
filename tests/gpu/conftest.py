"""Tests on a real GPU through NVML, read-only: skipped where NVML or a GPU is missing.

These run on machines that others share: they only read (never change MIG mode, never create or
destroy an instance, never reset). Every test here is marked `gpu`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)


FAKE_MARK = b"FAKE_NVML_STATE"
"""The environment variable the fake driver (hack/fakedriver/src/state.c) reads: in its binary, not
in NVIDIA's."""


def loaded_fake() -> str:
    """Why the libnvidia-ml this process has mapped (/proc/self/maps) is not a real driver's, or ""
    (one whose file is gone cannot be told apart, so it counts as not real)."""
    with open("/proc/self/maps") as maps:
        mapped = [line.split(maxsplit=5) for line in maps if "libnvidia-ml.so" in line]
    for fields in mapped:
        name = fields[5].strip() if len(fields) == 6 else ""
        try:
            if FAKE_MARK in Path(name).read_bytes():
                return f"the fake NVIDIA driver is loaded in this process ({name}), not a real one"
        except OSError as err:
            return f"the libnvidia-ml loaded in this process cannot be read ({name}: {err.strerror})"
    return ""


@pytest.fixture(scope="session")
def nvml() -> Iterator[Any]:
    """The real pynvml, initialised; the test is skipped when NVML or a GPU is not there."""
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        pytest.skip("nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        pytest.skip(f"NVML cannot be loaded here: {err}")
    try:
        # pynvml keeps the library an earlier test in this process loaded, which may be the fake
        # driver installed under any driver root: what is mapped is looked at, not its name.
        if fake := loaded_fake():
            pytest.skip(fake)
        if pynvml.nvmlDeviceGetCount() == 0:
            pytest.skip("NVML sees no GPU")
        yield pynvml
    finally:
        pynvml.nvmlShutdown()
