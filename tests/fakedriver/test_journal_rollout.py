"""What the journal means to a rollout over the fake driver: an empty journal, or one whose targets
need nothing, is cleared and said at most once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sharing.config.spec import MigMode, Rule, Selector, SharingConfig
from sharing.deviceplugin import Fleet
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.mig.catalog import default_catalog
from sharing.mig.change import Target
from sharing.model import GpuUuid
from sharing.rollout import Rollout
from sharing.rollout.verdict import Verdict
from sharing.store.journal import Journal

CATALOG = default_catalog()
GPU = GpuUuid("GPU-5f1c3a52-0c1d-4d3e-9f00-2b8a1e6c7d90")


async def _roll_out_twice(nvml: Any, fleet: Fleet, journal: Journal) -> list[Verdict]:
    backend = NvmlBackend(nvml, CATALOG)
    rollout = Rollout(backend=backend, fleet=fleet, catalog=CATALOG, journal=journal, pod_resources=None)
    config = SharingConfig(
        name="all-1g", rules=(Rule(Selector(all=True), MigMode.ENABLED, (("1g.5gb", 7),)),)
    )

    async def pending() -> None:
        pass

    verdicts = []
    try:
        for _ in range(2):
            result, _ = await rollout.roll_out(config, await backend.observe(), pending)
            verdicts.append(result)
    finally:
        await backend.close()
    return verdicts


async def test_an_empty_journal_is_cleared_and_never_said_to_be_a_finished_change(
    tmp_path: Path, fleet: Fleet, state: Path, nvml: Any
) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")])
    await _roll_out_twice(nvml, fleet, journal)  # the GPU now has the config's layout
    journal.path.write_bytes(b"")
    first, second = await _roll_out_twice(nvml, fleet, journal)
    assert "interrupted" not in first.message
    assert not journal.path.exists()
    assert (first.reason, first.changed) == ("ConfigApplied", False)
    assert not second.changed


@pytest.mark.parametrize("gone", [False, True], ids=["target-reached", "gpu-gone"])
async def test_a_journal_whose_targets_need_nothing_is_cleared_and_said_once(
    tmp_path: Path, fleet: Fleet, state: Path, nvml: Any, gone: bool
) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")])
    await _roll_out_twice(nvml, fleet, journal)
    uuid = GPU if gone else GpuUuid(simstate.read(state)["gpus"][0]["uuid"])
    journal.begin({uuid: Target(True, (("1g.5gb", 7),))})
    with open(journal.path, "a") as out:
        out.write('{"event": "step", "n": 1, "gp')  # torn by a crash
    first, second = await _roll_out_twice(nvml, fleet, journal)
    assert not journal.path.exists()
    assert first.reason == second.reason == "ConfigApplied"
    assert not second.changed  # no second "interrupted change ... finished" Event
    assert "interrupted" not in second.message
