"""The applier on the fake driver: minimal change, zero calls when nothing changes, busy kept, journal."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sharing.config.spec import MigMode, Replicas, Rule, Selector, SharingConfig
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.mig.catalog import default_catalog
from sharing.mig.change import Outcome, Target
from sharing.model import Gpu, GpuUuid, NodeState
from sharing.rollout.apply import ApplyReport, apply_config
from sharing.store.journal import Journal
from tests.fakedriver.conftest import make_gpu_instance

CATALOG = default_catalog()


def mig(*indices: int, **profiles: int) -> Rule:
    """A rule: MIG on these GPUs with these instances (`mig(0, **{"1g.5gb": 2})`)."""
    return Rule(Selector(indices=indices), MigMode.ENABLED, tuple(sorted(profiles.items())))


def config(*rules: Rule) -> SharingConfig:
    return SharingConfig(name="test", rules=rules)


BALANCED = {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}
NO_MIG = Rule(Selector(all=True), MigMode.DISABLED, replicas=Replicas(4))


@pytest.fixture
def state(state: Path) -> Path:
    path = state
    simstate.init_state(
        path, [simstate.resolve_product(CATALOG, p) for p in ("A100-SXM4-40GB", "A100-SXM4-40GB", "T4")]
    )
    return path


@pytest.fixture
async def backend(state: Path, nvml: Any) -> AsyncIterator[NvmlBackend]:
    b = NvmlBackend(nvml, CATALOG)
    yield b
    await b.close()


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "journal.jsonl")


async def apply(backend: NvmlBackend, journal: Journal, cfg: SharingConfig, **kw: object) -> ApplyReport:
    return await apply_config(backend, cfg, catalog=CATALOG, journal=journal, **kw)  # type: ignore[arg-type]


def layout(gpu: Gpu) -> Counter[str]:
    return Counter(gi.profile for gi in gpu.instances)


def mig_uuids(gpu: Gpu) -> set[str]:
    return {ci.uuid for _, ci in gpu.mig_devices}


def outcomes(report: ApplyReport) -> list[str]:
    return [g.outcome.value for g in report.gpus]


async def test_fresh_node_is_partitioned_and_verified(backend: NvmlBackend, journal: Journal) -> None:
    report = await apply(backend, journal, config(mig(0, **BALANCED), mig(1, **{"7g.40gb": 1}), NO_MIG))
    assert outcomes(report) == ["applied", "applied", "unchanged"]
    assert report.ok
    gpus = (await backend.observe()).gpus
    assert [layout(g) for g in gpus] == [Counter(BALANCED), Counter({"7g.40gb": 1}), Counter()]
    assert all(len(gi.compute_instances) == 1 for g in gpus for gi in g.instances)
    assert not journal.path.exists()


async def test_applying_the_current_config_makes_no_mutating_call(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    cfg = config(mig(0, **BALANCED), mig(1, **{"1g.5gb": 7}), NO_MIG)
    await apply(backend, journal, cfg)
    before = simstate.counters(state)
    report = await apply(backend, journal, cfg)
    assert outcomes(report) == ["unchanged"] * 3
    assert simstate.counters(state) == before


async def test_a_config_differing_in_one_gpu_touches_only_that_gpu(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    await apply(backend, journal, config(mig(0, **BALANCED), mig(1, **BALANCED), NO_MIG))
    old = (await backend.observe()).gpus
    before = simstate.counters(state).mutations
    report = await apply(
        backend, journal, config(mig(0, **BALANCED), mig(1, **{"3g.20gb": 1, "1g.5gb": 4}), NO_MIG)
    )
    new = (await backend.observe()).gpus
    assert outcomes(report) == ["unchanged", "applied", "unchanged"]
    assert new[0] == old[0]
    assert layout(new[1]) == Counter({"3g.20gb": 1, "1g.5gb": 4})
    # The 3g and both 1g instances stay: destroy the 2g, create two 1g = 2 + 2 * 2 NVML changes.
    assert [str(s) for s in report.gpus[1].steps] == [
        "destroy 2g.10gb@0 (GPU instance 1)",
        "create 1g.5gb@0",
        "create 1g.5gb@1",
    ]
    assert simstate.counters(state).mutations - before == 6
    assert len(mig_uuids(old[1]) & mig_uuids(new[1])) == 3


async def test_busy_instances_are_kept_while_the_rest_changes(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    await apply(backend, journal, config(mig(0, **BALANCED), NO_MIG))
    gpu = (await backend.observe()).gpus[0]
    busy = next(gi for gi in gpu.instances if gi.profile == "2g.10gb")
    simstate.set_busy(state, busy.compute_instances[0].uuid, True)
    report = await apply(backend, journal, config(mig(0, **{"2g.10gb": 3, "1g.5gb": 1}), NO_MIG))
    assert outcomes(report)[0] == "applied"
    after = (await backend.observe()).gpus[0]
    kept = next(gi for gi in after.instances if gi.id == busy.id)
    assert (kept.profile, kept.start, kept.compute_instances[0].uuid, kept.busy) == (
        busy.profile,
        busy.start,
        busy.compute_instances[0].uuid,
        True,
    )
    assert layout(after) == Counter({"2g.10gb": 3, "1g.5gb": 1})


async def test_a_busy_instance_the_config_drops_blocks_that_gpu_only(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    await apply(backend, journal, config(mig(0, **BALANCED), mig(1, **BALANCED), NO_MIG))
    gpus = (await backend.observe()).gpus
    held = gpus[0].instances[0].compute_instances[0].uuid
    before = simstate.counters(state)
    report = await apply(
        backend,
        journal,
        config(mig(0, **{"7g.40gb": 1}), mig(1, **{"7g.40gb": 1}), NO_MIG),
        busy_uuids={held},
    )
    assert outcomes(report) == ["blocked", "applied", "unchanged"]
    assert "2g.10gb@0:busy" in report.gpus[0].reason
    assert (held,) == report.gpus[0].blockers
    assert not report.ok
    after = (await backend.observe()).gpus
    assert after[0] == gpus[0]
    assert layout(after[1]) == Counter({"7g.40gb": 1})
    assert simstate.counters(state).mutations - before.mutations == 4 * 2 + 2  # GPU 1 only


async def test_mig_mode_is_not_changed_on_a_gpu_with_processes(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    gpus = (await backend.observe()).gpus
    simstate.set_busy(state, gpus[0].uuid, True)
    report = await apply(backend, journal, config(mig(0, **BALANCED), NO_MIG))
    assert outcomes(report) == ["blocked", "unchanged", "unchanged"]
    assert "MIG mode only changes on an idle GPU" in report.gpus[0].reason
    assert (gpus[0].uuid,) == report.gpus[0].blockers
    assert simstate.counters(state) == simstate.Counters(0, 0)


async def test_mig_mode_is_not_changed_on_a_gpu_a_pod_holds(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    """A whole GPU allocated to a pod (per PodResources) may have no process yet: it is still in use."""
    gpus = (await backend.observe()).gpus
    report = await apply(backend, journal, config(mig(0, **BALANCED), NO_MIG), busy_uuids={gpus[0].uuid})
    assert outcomes(report) == ["blocked", "unchanged", "unchanged"]
    assert "a pod holds it" in report.gpus[0].reason
    assert simstate.counters(state) == simstate.Counters(0, 0)


async def test_disabling_mig_with_a_busy_device_is_refused(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    await apply(backend, journal, config(mig(0, **BALANCED), NO_MIG))
    gpu = (await backend.observe()).gpus[0]
    simstate.set_busy(state, gpu.instances[-1].compute_instances[0].uuid, True)
    before = simstate.counters(state)
    report = await apply(backend, journal, config(NO_MIG))
    assert outcomes(report)[0] == "blocked"
    assert "in use; MIG stays on" in report.gpus[0].reason
    assert simstate.counters(state) == before


async def test_disabling_mig_destroys_then_turns_it_off(backend: NvmlBackend, journal: Journal) -> None:
    await apply(backend, journal, config(mig(0, **BALANCED), NO_MIG))
    report = await apply(backend, journal, config(NO_MIG))
    assert [str(s) for s in report.gpus[0].steps][-1] == "disable MIG"
    gpu = (await backend.observe()).gpus[0]
    assert (gpu.mig_enabled, gpu.instances) == (False, ())


async def test_pending_mode_change_is_reported_never_reset(state: Path, nvml: Any, journal: Journal) -> None:
    path = state
    simstate.init_state(
        path, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")] * 2, pending_mode_changes=True
    )
    backend = NvmlBackend(nvml, CATALOG)
    try:
        report = await apply(backend, journal, config(mig(0, **BALANCED)))
        assert outcomes(report) == ["reset-required", "unchanged"]
        assert "nvidia-smi -r -i 0" in report.gpus[0].reason
        gpu = (await backend.observe()).gpus[0]
        assert (gpu.mig_enabled, gpu.mig_pending, gpu.instances) == (False, True, ())
        # Asking again changes nothing: no new SetMigMode, no journal written, on every reconcile.
        before = simstate.counters(path)
        report = await apply(backend, journal, config(mig(0, **BALANCED)))
        assert outcomes(report) == ["reset-required", "unchanged"]
        assert () == report.gpus[0].steps
        assert before == simstate.counters(path)
        assert not journal.path.exists()
        simstate.reset(path)  # what a person does; then the same apply finishes the job
        report = await apply(backend, journal, config(mig(0, **BALANCED)))
        assert outcomes(report) == ["applied", "unchanged"]
    finally:
        await backend.close()


async def test_a_gpu_in_use_by_the_time_its_mig_mode_changes_waits_for_idle_not_for_a_reset(
    state: Path, nvml: Any, journal: Journal
) -> None:
    class Raced(NvmlBackend):
        """A process starts on the GPU between the plan (idle) and its MIG mode step, once."""

        raced = False

        async def set_mig_mode(self, gpu: GpuUuid, enabled: bool) -> bool:
            if not self.raced:
                self.raced = True
                simstate.set_busy(state, gpu, True)
            return await super().set_mig_mode(gpu, enabled)

    backend = Raced(nvml, CATALOG)
    try:
        report = await apply(backend, journal, config(mig(0, **BALANCED)))
        assert "blocked" == outcomes(report)[0]
        assert "in use" in report.gpus[0].reason
        gpu = (await backend.observe()).gpus[0]
        assert (gpu.mig_enabled, gpu.mig_pending) == (False, False)  # no reset asked for
        report = await apply(backend, journal, config(mig(0, **BALANCED)))
        assert "blocked" == outcomes(report)[0]  # still in use
        simstate.set_busy(state, gpu.uuid, False)
        report = await apply(backend, journal, config(mig(0, **BALANCED)))
        assert "applied" == outcomes(report)[0]
    finally:
        await backend.close()


async def test_gpus_without_mig(backend: NvmlBackend, journal: Journal) -> None:
    report = await apply(backend, journal, config(mig(2, **{"1g.5gb": 1})))
    assert outcomes(report) == ["unchanged", "unchanged", "failed"]
    assert "has no MIG" in report.gpus[2].reason


async def test_infeasible_layout_is_a_failure_with_the_planners_reason(
    backend: NvmlBackend, journal: Journal
) -> None:
    report = await apply(backend, journal, config(mig(0, **{"4g.20gb": 1, "3g.20gb": 2})))
    assert report.gpus[0].outcome is Outcome.FAILED
    assert "A100-SXM4-40GB" in report.gpus[0].reason


async def test_dry_run_changes_nothing(backend: NvmlBackend, journal: Journal, state: Path) -> None:
    report = await apply(backend, journal, config(mig(0, **BALANCED), NO_MIG), dry_run=True)
    assert outcomes(report) == ["planned", "unchanged", "unchanged"]
    assert str(report.gpus[0].steps[0]) == "enable MIG"
    assert len(report.gpus[0].steps) == 5
    assert simstate.counters(state) == simstate.Counters(0, 0)
    assert not journal.path.exists()


async def test_a_crashed_run_is_rolled_forward_even_without_a_rule(
    backend: NvmlBackend, journal: Journal, state: Path, nvml: Any
) -> None:
    # A crash left GPU 1 with MIG on and a 3g GPU instance without its compute instance.
    gpus = (await backend.observe()).gpus
    await backend.set_mig_mode(gpus[1].uuid, True)
    make_gpu_instance(nvml, 1, 9, 4, 4)
    journal.begin({gpus[1].uuid: Target(True, (("3g.20gb", 2),))})
    journal.step(gpus[1].uuid, "create 3g.20gb@4")
    before = simstate.counters(state).mutations
    report = await apply(backend, journal, config(mig(0, **BALANCED)))  # GPU 1 is no longer in the config
    assert report.resumed
    assert outcomes(report) == ["applied", "applied", "unchanged"]
    assert [str(s) for s in report.gpus[1].steps] == ["complete 3g.20gb@4", "create 3g.20gb@0"]
    gpu1 = (await backend.observe()).gpus[1]
    assert layout(gpu1) == Counter({"3g.20gb": 2})
    assert all(gi.compute_instances for gi in gpu1.instances)
    assert simstate.counters(state).mutations - before == (1 + 4 * 2) + (1 + 2)
    assert not journal.path.exists()


async def test_a_crashed_runs_target_that_can_never_be_reached_is_dropped_not_retried_forever(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    """A crashed run wanted 7 x 1g.5gb on the T4, which has no MIG: no rule can ever get there."""
    gpus = (await backend.observe()).gpus
    journal.begin({gpus[2].uuid: Target(True, (("1g.5gb", 7),))})
    report = await apply(backend, journal, config(mig(0, **BALANCED)))
    assert outcomes(report) == ["applied", "unchanged", "failed"]
    assert not journal.path.exists()
    report = await apply(backend, journal, config(mig(0, **BALANCED)))
    assert outcomes(report) == ["unchanged", "unchanged", "unchanged"]


async def test_a_crashed_runs_target_blocked_by_a_busy_gpu_waits_without_rewriting_the_journal(
    backend: NvmlBackend, journal: Journal, state: Path
) -> None:
    gpus = (await backend.observe()).gpus
    simstate.set_busy(state, gpus[1].uuid, True)
    journal.begin({gpus[1].uuid: Target(True, (("3g.20gb", 2),))})
    written = journal.path.read_bytes()
    report = await apply(backend, journal, config(mig(0, **BALANCED)))
    assert outcomes(report) == ["applied", "blocked", "unchanged"]
    assert written == journal.path.read_bytes()  # kept, the target still applies once it is idle
    mtime = journal.path.stat().st_mtime_ns
    report = await apply(backend, journal, config(mig(0, **BALANCED)))
    assert outcomes(report) == ["unchanged", "blocked", "unchanged"]
    assert mtime == journal.path.stat().st_mtime_ns  # not rewritten on every pass
    simstate.set_busy(state, gpus[1].uuid, False)
    report = await apply(backend, journal, config(mig(0, **BALANCED)))
    assert outcomes(report) == ["unchanged", "applied", "unchanged"]
    assert not journal.path.exists()


def destroy_all_and_recreate(old: NodeState, want: dict[int, dict[str, int]]) -> int:
    """NVML changes mig-parted makes: a changed GPU's instances destroyed (CI, GI), all created (GI, CI)."""
    count = 0
    for gpu in old.gpus:
        if gpu.index in want and layout(gpu) != Counter(want[gpu.index]):
            count += 2 * len(gpu.instances) + 2 * sum(want[gpu.index].values())
    return count


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(BALANCED, {"3g.20gb": 1, "1g.5gb": 4}, id="2g-to-two-1g"),
        pytest.param(BALANCED, {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 1}, id="drop-one-1g"),
        pytest.param({"1g.5gb": 7}, {"3g.20gb": 1, "1g.5gb": 4}, id="merge-three-1g"),
        pytest.param({"3g.20gb": 2}, {"3g.20gb": 1, "2g.10gb": 2}, id="split-one-3g"),
    ],
)
async def test_fewer_nvml_changes_than_destroy_all_and_recreate(
    backend: NvmlBackend, journal: Journal, state: Path, before: dict[str, int], after: dict[str, int]
) -> None:
    await apply(backend, journal, config(mig(0, **before)))
    old = await backend.observe()
    start = simstate.counters(state).mutations
    await apply(backend, journal, config(mig(0, **after)))
    ours = simstate.counters(state).mutations - start
    theirs = destroy_all_and_recreate(old, {0: after})
    assert layout((await backend.observe()).gpus[0]) == Counter(after)
    assert ours < theirs


def test_journal_records_the_step_in_flight(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.jsonl")
    assert journal.unfinished() is None
    gpu = GpuUuid("GPU-5f1c3a52-0c1d-4d3e-9f00-2b8a1e6c7d90")
    journal.begin({gpu: Target(True, (("1g.5gb", 2),))})
    journal.done(journal.step(gpu, "create 1g.5gb@0"))
    journal.step(gpu, "create 1g.5gb@1")
    with open(journal.path, "a") as out:
        out.write('{"event": "step", "n": 3, "gpu"')  # torn by the crash: that step never started
    unfinished = journal.unfinished()
    assert unfinished is not None
    assert unfinished.targets == {gpu: Target(True, (("1g.5gb", 2),))}
    assert unfinished.in_flight == f"{gpu}: create 1g.5gb@1"
    journal.finish()
    assert journal.unfinished() is None
