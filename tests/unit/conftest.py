"""Fixtures of the fast tests of the device-plugin side: a short socket directory, the Python fake
kubelet in it, and a fleet of plugin servers (tests/unit/fakekubelet.py says what the fake keeps of
the kubelet's rules; the real device manager runs in tests/integration and tests/e2e)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sharing.deviceplugin import Fleet, FleetSettings
from tests.unit.fakekubelet import FakeKubelet


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Short: unix socket paths are limited to 107 bytes, and pytest's tmp_path can be long.
    path = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    k = await FakeKubelet(plugin_dir).start()
    yield k
    await k.stop()


@pytest.fixture
async def fleet(plugin_dir: Path) -> AsyncIterator[Fleet]:
    f = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02, retry_min_s=0.02, retry_max_s=0.2))
    await f.start()
    yield f
    await f.stop()
