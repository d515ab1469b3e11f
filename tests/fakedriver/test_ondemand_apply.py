"""A dynamic rule through the real applier on the fake NVIDIA driver: MIG on and nothing made ahead,
static rules beside it, and an instance made for a claim never touched; the observed GPUs as the
partitionable pool publishes them."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sharing.config.spec import MigMode, Rule, Selector, SharingConfig
from sharing.dra.partitions import partitionable_slices
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.mig.catalog import default_catalog
from sharing.rollout.apply import apply_config
from sharing.store.journal import Journal
from tests.fakedriver.conftest import make_gpu_instance

CATALOG = default_catalog()
A100 = CATALOG.product("A100-SXM4-40GB")
CONFIG = SharingConfig(
    "ondemand",
    rules=(
        Rule(Selector(indices=(0,)), MigMode.DYNAMIC),
        Rule(Selector(indices=(1,)), MigMode.ENABLED, (("3g.20gb", 2),)),
    ),
)


@pytest.fixture
def state(state: Path) -> Path:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")] * 2)
    return state


@pytest.fixture
async def backend(state: Path, nvml: Any) -> AsyncIterator[NvmlBackend]:
    b = NvmlBackend(nvml, CATALOG)
    yield b
    await b.close()


async def test_a_dynamic_gpu_gets_mig_on_and_no_instance_beside_a_static_one(
    backend: NvmlBackend, tmp_path: Path
) -> None:
    report = await apply_config(backend, CONFIG, catalog=CATALOG, journal=Journal(tmp_path / "j.jsonl"))
    assert [g.outcome.value for g in report.gpus] == ["applied", "applied"]
    assert [str(s) for s in report.gpus[0].steps] == ["enable MIG"]
    gpus = (await backend.observe()).gpus
    assert [(g.mig_enabled, Counter(gi.profile for gi in g.instances)) for g in gpus] == [
        (True, Counter()),
        (True, Counter({"3g.20gb": 2})),
    ]


async def test_an_instance_on_a_dynamic_gpu_is_never_destroyed(
    backend: NvmlBackend, nvml: Any, state: Path, tmp_path: Path
) -> None:
    journal = Journal(tmp_path / "j.jsonl")
    await apply_config(backend, CONFIG, catalog=CATALOG, journal=journal)
    make_gpu_instance(nvml, 0, A100.require_profile("1g.5gb").id, 6, 1)  # a claim's, half made
    before = simstate.counters(state)
    report = await apply_config(backend, CONFIG, catalog=CATALOG, journal=journal)
    assert [g.outcome.value for g in report.gpus] == ["unchanged", "unchanged"]
    assert simstate.counters(state) == before
    node = await backend.observe()
    assert [(gi.profile, gi.start) for gi in node.gpus[0].instances] == [("1g.5gb", 6)]
    # Published: GPU 0 only; held by no claim prepared here, the instance withdraws what overlaps it.
    specs = partitionable_slices("n", node, {node.gpus[0].uuid}, CATALOG)
    names = {d.name for s in specs for d in s.devices}
    assert [c.name for s in specs for c in s.shared_counters] == ["gpu-0-counters"]
    assert "gpu-0-mig-1g-5gb-at-5" in names
    assert names.isdisjoint({"gpu-0-mig-1g-5gb-at-6", "gpu-0-mig-3g-20gb-at-4", "gpu-0-mig-7g-40gb-at-0"})
    allocated = partitionable_slices(
        "n", node, {node.gpus[0].uuid}, CATALOG, prepared=["gpu-0-mig-1g-5gb-at-6"]
    )
    assert "gpu-0-mig-1g-5gb-at-6" in {d.name for s in allocated for d in s.devices}
