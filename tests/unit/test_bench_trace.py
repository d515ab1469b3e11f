"""The pure parts of the trace bench: the seeded trace, placements, static layouts, the replay."""

from __future__ import annotations

import random

import pytest
from bench import trace, tracesim
from bench.tracesim import Outcome, TracePod, TraceSpec

from sharing.config import parse_config
from sharing.dra.names import parse_ondemand_name
from sharing.mig import default_catalog
from sharing.mig.plan import Placement, Plan, plan_gpu

A100 = default_catalog().product("A100-SXM4-40GB")
MIX = ["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"]


def slots(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    assert tracesim.generate(TraceSpec(7)) == tracesim.generate(TraceSpec(7))
    assert tracesim.generate(TraceSpec(7)) != tracesim.generate(TraceSpec(8))


def test_a_trace_has_its_pods_in_arrival_order_from_the_mix() -> None:
    pods = tracesim.generate(TraceSpec(3, pods=150))
    assert len(pods) == 150
    assert [p.arrival for p in pods] == sorted(p.arrival for p in pods)
    assert set(tracesim.mix_counts(pods)) == set(MIX)
    assert all(p.lifetime >= 1 and p.patience == 20.0 for p in pods)


def test_the_largest_placeable_profile_follows_the_used_slots() -> None:
    assert tracesim.largest_placeable(A100, [0, 0], MIX).name == "7g.40gb"
    # A 1g.5gb at slot 0 of each GPU: 3g.20gb still fits at slot 4.
    assert tracesim.largest_placeable(A100, [slots(0, 1)] * 2, MIX).name == "3g.20gb"
    # ... and one at slot 4 too: only 2g.10gb (at slot 2) is left.
    assert tracesim.largest_placeable(A100, [slots(0, 1) | slots(4, 1)] * 2, MIX).name == "2g.10gb"
    assert tracesim.largest_placeable(A100, [slots(0, 8)] * 2, MIX) is None


def test_the_policy_keeps_the_large_placements_that_plain_order_takes() -> None:
    empty: list[list[Placement]] = [[], []]
    plain = tracesim.choose(A100, "plain", empty, "1g.5gb")
    chosen = tracesim.choose(A100, "policy", empty, "1g.5gb")
    assert plain == (0, 0)
    assert chosen is not None
    # 4g.20gb has one placement (slot 0): plain order's first 1g.5gb takes it, the policy's does not.
    four = A100.require_profile("4g.20gb")
    assert tracesim.free_placements(A100, four, slots(chosen[1], 1)) == (0,)
    assert tracesim.free_placements(A100, four, slots(plain[1], 1)) == ()


def test_a_gpu_with_no_free_placement_is_passed_over() -> None:
    full = [[Placement("7g.40gb", 0, 8)], []]
    assert (tracesim.choose(A100, "policy", full, "3g.20gb") or (-1, -1))[0] == 1
    assert tracesim.choose(A100, "plain", [[Placement("7g.40gb", 0, 8)]], "1g.5gb") is None


def test_the_random_yardstick_takes_a_free_placement_drawn_from_its_seed() -> None:
    taken = [[Placement("3g.20gb", 0, 4)]]
    draws = {tracesim.choose(A100, "random", taken, "1g.5gb", random.Random(n)) for n in range(40)}
    assert {(0, s) for s in (4, 5, 6)} == draws  # every free 1g.5gb placement of the GPU, no other
    pods = tracesim.generate(TraceSpec(5))
    once = tracesim.Replay(A100, 4, "random", seed=5).run(pods)
    assert once == tracesim.Replay(A100, 4, "random", seed=5).run(pods)


def test_against_plain_order_a_way_is_compared_seed_by_seed() -> None:
    specs = [TraceSpec(s, pods=40) for s in (1, 2)]
    same = tracesim.vs_plain(A100, 4, "plain", specs)
    assert (1.0, 1.0, 0) == (same.mean, same.worst, same.losing)
    ratios = []
    for spec in specs:
        pods = tracesim.generate(spec)
        served = {way: tracesim.replay(A100, 4, way, pods).served for way in ("policy", "plain")}
        ratios.append(served["policy"] / served["plain"])
    policy = tracesim.vs_plain(A100, 4, "policy", specs)
    assert (sum(ratios) / 2, min(ratios), sum(r < 1 for r in ratios)) == (
        policy.mean,
        policy.worst,
        policy.losing,
    )


def test_static_layouts_are_every_maximal_layout_the_planner_accepts() -> None:
    layouts = tracesim.gpu_layouts(A100, MIX)
    assert (("7g.40gb", 1),) in layouts
    assert (("1g.5gb", 7),) in layouts
    assert (("3g.20gb", 2),) in layouts
    for layout in layouts:
        assert isinstance(plan_gpu(A100, (), dict(layout)), Plan)
        for profile in MIX:  # maximal: one more of any profile does not fit
            more = {**dict(layout), profile: dict(layout).get(profile, 0) + 1}
            assert not isinstance(plan_gpu(A100, (), more), Plan)


def test_a_node_advertises_the_sum_of_its_gpu_layouts() -> None:
    layouts = ((("1g.5gb", 7),), (("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)))
    assert tracesim.node_counts(layouts) == {"1g.5gb": 9, "2g.10gb": 1, "3g.20gb": 1}


def test_summary_counts_served_and_withdrawn_pods_and_their_waits() -> None:
    pods = [TracePod(n, float(n), "1g.5gb", 5.0, 3.0) for n in range(4)]
    outcomes = [Outcome(pods[0], 0.0), Outcome(pods[1], 3.0), Outcome(pods[2], None), Outcome(pods[3], 4.0)]
    summary = tracesim.summarize(outcomes, [7, 3, 0, 1], biggest_g=7, product=A100)
    assert (summary.served, summary.served_g, summary.withdrawn) == (3, 3, 1)
    assert summary.wait_mean == pytest.approx(1.0)
    assert summary.wait_p95 == pytest.approx(2.0)
    assert (summary.largest_mean_g, summary.largest_7g_share) == (pytest.approx(2.75), 0.25)


def test_a_static_node_without_the_profile_serves_none_of_its_pods() -> None:
    pods = [TracePod(n, float(n), "7g.40gb", 2.0, 1.0) for n in range(3)]
    assert tracesim.replay(A100, 3, "static", pods, {"1g.5gb": 21}).served == 0
    assert tracesim.replay(A100, 3, "policy", pods).served == 3


def test_a_pod_waits_for_a_slice_until_its_patience_ends() -> None:
    # One GPU, a 7g.40gb held for 10 units: the next waits 10 (patience 12), the third gives up (patience 5).
    pods = [
        TracePod(0, 0.0, "7g.40gb", 10.0, 1.0),
        TracePod(1, 0.5, "7g.40gb", 10.0, 12.0),
        TracePod(2, 1.0, "7g.40gb", 10.0, 5.0),
    ]
    outcomes, _ = tracesim.Replay(A100, 1, "plain").run(pods)
    assert [o.wait for o in outcomes] == [0.0, 9.5, None]


def test_the_best_static_layout_serves_at_least_any_other_in_the_replay() -> None:
    pods = tracesim.generate(TraceSpec(5, pods=60))
    layouts, summary, tried = tracesim.best_static(A100, 2, pods)
    assert tried == len(tracesim.node_layouts(A100, MIX, 2))
    for other in random.Random(0).sample(tracesim.node_layouts(A100, MIX, 2), 10):
        assert tracesim.replay(A100, 2, "static", pods, tracesim.node_counts(other)).served <= summary.served
    assert tracesim.replay(A100, 2, "static", pods, tracesim.node_counts(layouts)) == summary


def test_plain_order_lists_each_gpus_devices_by_profile_then_start() -> None:
    state = trace.ondemand_node("n", A100)
    specs = trace.ondemand_slices("n", state, "plain", A100)
    devices = [d.name for d in specs[1].devices]
    assert devices[:3] == ["gpu-0-mig-1g-5gb-at-0", "gpu-0-mig-1g-5gb-at-1", "gpu-0-mig-1g-5gb-at-2"]
    # The same devices as the policy's pool, only in another order; no devices with the counters.
    policy = trace.ondemand_slices("n", state, "policy", A100)
    assert [sorted(s.devices, key=lambda d: d.name) for s in specs] == [
        sorted(s.devices, key=lambda d: d.name) for s in policy
    ]
    assert [d.name for d in policy[1].devices] != devices
    assert specs[0].shared_counters
    assert not specs[0].devices


def test_the_policy_pool_follows_the_allocations() -> None:
    state = trace.ondemand_node("n", A100)
    before = trace.ondemand_slices("n", state, "policy", A100)
    after = trace.ondemand_slices("n", state, "policy", A100, ["gpu-0-mig-1g-5gb-at-6"])
    assert [d.name for d in before[1].devices] != [d.name for d in after[1].devices]
    assert before[2:] == after[2:]  # the other GPUs' order is unchanged


def test_occupancy_is_the_slots_of_the_allocated_devices() -> None:
    assert trace.occupancy(A100, ["gpu-1-mig-3g-20gb-at-4", "gpu-0-mig-1g-5gb-at-0", "other"]) == [
        slots(0, 1),
        slots(4, 4),
        0,
        0,
    ]
    assert {parse_ondemand_name(n) for n in ("gpu-1-mig-3g-20gb-at-4",)} == {(1, "3g-20gb", 4)}


def test_the_timeline_shows_the_smallest_largest_profile_of_each_window() -> None:
    assert tracesim.timeline([7, 7, 3, 7, 1, 2, 0], every=3) == "310"


def preset(name: str) -> tracesim.Preset:
    text = (trace.PRESETS / f"{name}.yaml").read_text()
    (config,) = parse_config(name, text, products=[A100.name], catalog=default_catalog())
    return tracesim.preset_on(config, A100, 4)


def test_a_shipped_preset_advertises_its_instances_or_whole_gpus_on_four_a100s() -> None:
    assert preset("all-balanced").resources == {
        "nvidia.com/mig-1g.5gb": 8,
        "nvidia.com/mig-2g.10gb": 4,
        "nvidia.com/mig-3g.20gb": 4,
    }
    assert preset("all-1g").mig_counts == {"1g.5gb": 28}
    assert preset("all-disabled").resources == {"nvidia.com/gpu": 4}
    assert preset("all-replicas-4").resources == {"nvidia.com/gpu": 16}
    assert preset("all-enabled").resources == {}


def test_whole_gpus_serve_no_pod_that_asks_for_a_mig_profile() -> None:
    pods = [TracePod(n, float(n), "7g.40gb", 2.0, 1.0) for n in range(3)]
    assert preset("all-disabled").mig_counts == {}
    assert tracesim.replay(A100, 4, "static", pods, preset("all-disabled").mig_counts).served == 0


def test_the_shipped_presets_on_an_a100_are_nine_with_balanced_twice_named() -> None:
    names = [p.name for p in trace.shipped_presets(A100)]
    assert "a100-mig-h100-time-sliced=all-balanced" in names
    assert len(names) == len(set(names)) == 9


def test_the_best_preset_serves_the_most_pods_of_the_trace() -> None:
    ones = [TracePod(n, float(n), "1g.5gb", 50.0, 1.0) for n in range(20)]
    presets = [preset(n) for n in ("all-1g", "all-2g", "all-balanced", "all-disabled")]
    best, summary = tracesim.best_preset(A100, 4, ones, presets)
    assert (best.name, summary.served) == ("all-1g", 20)
    threes = [TracePod(n, float(n), "3g.20gb", 50.0, 1.0) for n in range(20)]
    best, summary = tracesim.best_preset(A100, 4, threes, [*presets, preset("all-3g")])
    assert (best.name, summary.served) == ("all-3g", 8)


def test_the_best_preset_of_a_trace_serves_no_more_than_the_hindsight_layout() -> None:
    pods = tracesim.generate(TraceSpec(5, pods=60))
    # shipped_presets resolves each preset for the bench's four GPUs: the same four here.
    _, hindsight, _ = tracesim.best_static(A100, 4, pods)
    _, summary = tracesim.best_preset(A100, 4, pods, trace.shipped_presets(A100))
    assert summary.served <= hindsight.served


def test_equal_presets_are_merged_under_both_names() -> None:
    a = tracesim.Preset("b", {"nvidia.com/gpu": 4})
    b = tracesim.Preset("a", {"nvidia.com/gpu": 4})
    c = tracesim.Preset("c", {})
    assert tracesim.merge_same([a, b, c]) == (tracesim.Preset("a=b", {"nvidia.com/gpu": 4}), c)
