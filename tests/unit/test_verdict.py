"""Events people can read: one message per outcome, bounded, summarised, GPUs named once."""

from __future__ import annotations

import pytest

from sharing.config.spec import SharingConfig
from sharing.kubelet.holders import Holders
from sharing.mig.change import Outcome, Step, StepKind
from sharing.model import GpuUuid, Holding, NodeState, UnreadableGpu
from sharing.rollout.apply import ApplyReport, GpuReport
from sharing.rollout.verdict import EVENT_LIMIT, Retry, verdict
from sharing.text import summary

A100 = "NVIDIA A100-SXM4-40GB"
CONFIG = SharingConfig(name="all-1g")


def gpu(
    index: int, outcome: Outcome, steps: int = 0, reason: str = "", blockers: tuple[str, ...] = ()
) -> GpuReport:
    made = tuple(Step(StepKind.CREATE, "1g.5gb", n) for n in range(steps))
    return GpuReport(index, GpuUuid(f"GPU-{index}"), A100, outcome, made, reason, blockers)


def test_a_big_change_is_summarised_with_how_many_more_never_cut_mid_word() -> None:
    report = ApplyReport(tuple(gpu(i, Outcome.APPLIED, steps=14) for i in range(16)))
    result = verdict(CONFIG, report, Holders(), NodeState(()))
    assert result.message.startswith("config 'all-1g' applied: GPU 0: create 1g.5gb@0, create 1g.5gb@1, ")
    assert "and 9 more steps" in result.message
    assert result.message.endswith("more GPUs")
    assert len(result.message) <= EVENT_LIMIT
    assert result.changed


def test_a_blocked_change_names_its_gpu_once_and_the_pods_and_says_it_will_retry() -> None:
    report = ApplyReport(
        (
            gpu(0, Outcome.BLOCKED, reason="3g.20gb@4:busy is in use", blockers=("MIG-a",)),
            gpu(1, Outcome.APPLIED, 7),
        )
    )
    holders = Holders((Holding("ml", "trainer", "main", "nvidia.com/mig-3g.20gb", frozenset({"MIG-a"})),))
    result = verdict(CONFIG, report, holders, NodeState(()))
    assert (
        "config 'all-1g' waits: GPU 0 (NVIDIA A100-SXM4-40GB): 3g.20gb@4:busy is in use "
        "(held by pods ml/trainer); it is applied as soon as they are free (checked every few seconds); "
        "applied on GPU 1"
    ) == result.message
    assert (Retry.BLOCKED, frozenset({"MIG-a"})) == (result.retry, result.blockers)
    assert 1 == result.message.count("GPU 0")


@pytest.mark.parametrize(
    ("report", "after", "retry"),
    [
        pytest.param(
            ApplyReport((gpu(0, Outcome.FAILED, reason="no placement"),)),
            NodeState(()),
            Retry.NONE,
            id="infeasible",
        ),
        pytest.param(
            ApplyReport((gpu(0, Outcome.FAILED, steps=1, reason="create 1g.5gb@1: NVML error"),)),
            NodeState(()),
            Retry.BACKOFF,
            id="a-step-failed",
        ),
        pytest.param(
            ApplyReport(
                (
                    GpuReport(
                        0,
                        GpuUuid("GPU-0"),
                        A100,
                        Outcome.FAILED,
                        (),
                        "enable MIG: NVML error",
                        failed_step=Step(StepKind.ENABLE_MIG),
                    ),
                )
            ),
            NodeState(()),
            Retry.BACKOFF,
            id="the-first-step-failed",
        ),
        pytest.param(
            ApplyReport(()),
            NodeState((), (UnreadableGpu(3, GpuUuid("GPU-3"), "GPU is lost"),)),
            Retry.BACKOFF,
            id="lost",
        ),
    ],
)
def test_failures_retry_only_when_it_can_help(report: ApplyReport, after: NodeState, retry: Retry) -> None:
    result = verdict(CONFIG, report, Holders(), after)
    assert ("ConfigApplyFailed", retry) == (result.reason, result.retry)


def test_a_finished_interrupted_change_is_news() -> None:
    result = verdict(
        CONFIG, ApplyReport((gpu(0, Outcome.UNCHANGED),), resumed=True), Holders(), NodeState(())
    )
    assert ("ConfigApplied", True) == (result.reason, result.changed)
    assert "an interrupted change found in the journal was finished" in result.message


def test_summary_keeps_whole_parts_and_counts_the_rest() -> None:
    parts = [f"part number {n} with several words" for n in range(10)]
    text = summary(parts, 100)
    assert len(text) <= 100
    assert text.endswith("more")
    kept = text.rsplit("; and ", 1)[0].split("; ")
    assert all(p in parts for p in kept)
    assert f"; and {10 - len(kept)} more" in text
    assert "one short" == summary(["one short"], 100)
    cut = summary(["a very long single part " * 20], 50)
    assert len(cut) <= 50
    assert cut.endswith("part…")


def test_a_journal_target_that_cannot_be_reached_is_not_blamed_on_the_config() -> None:
    infeasible = gpu(1, Outcome.FAILED, reason="7 x 1g.5gb cannot be placed on a T4")
    report = ApplyReport(
        (gpu(0, Outcome.UNCHANGED), infeasible), resumed=True, inherited=frozenset({infeasible.uuid})
    )
    result = verdict(CONFIG, report, Holders(), NodeState(()))
    assert "could not be applied" not in result.message
    assert result.message.startswith("config 'all-1g' applied")
    assert (
        "GPU 1 (NVIDIA A100-SXM4-40GB): the interrupted change found in the journal cannot be finished "
        "(7 x 1g.5gb cannot be placed on a T4); it was dropped"
    ) in result.message
