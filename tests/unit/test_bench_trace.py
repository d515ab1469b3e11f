"""The pure parts of the trace bench: the seeded trace, placements, static layouts, the replay."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from bench import trace, tracesim
from bench.__main__ import main as bench_main
from bench.tracesim import Outcome, TracePod, TraceSpec

from sharing.config import parse_config
from sharing.dra.names import parse_ondemand_name
from sharing.mig import default_catalog
from sharing.mig.plan import Placement, Plan, plan_gpu

CATALOG = default_catalog()
A100 = CATALOG.product("A100-SXM4-40GB")
H100 = CATALOG.product("H100-80GB-HBM3")
MIX = ["1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"]
ONE, TWO, FOUR = (A100,), (A100, A100), (A100,) * 4


def slots(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    assert tracesim.generate(TraceSpec(7), A100) == tracesim.generate(TraceSpec(7), A100)
    assert tracesim.generate(TraceSpec(7), A100) != tracesim.generate(TraceSpec(8), A100)


def test_a_trace_has_its_pods_in_arrival_order_from_the_mix() -> None:
    pods = tracesim.generate(TraceSpec(3, pods=150), A100)
    assert len(pods) == 150
    assert [p.arrival for p in pods] == sorted(p.arrival for p in pods)
    assert set(tracesim.mix_counts(pods)) == set(MIX)
    assert all(p.lifetime >= 1 and p.patience == 20.0 for p in pods)


def test_the_largest_placeable_profile_follows_the_used_slots() -> None:
    assert tracesim.largest_placeable(TWO, [0, 0], MIX) == 7
    # A 1g.5gb at slot 0 of each GPU: 3g.20gb still fits at slot 4.
    assert tracesim.largest_placeable(TWO, [slots(0, 1)] * 2, MIX) == 3
    # ... and one at slot 4 too: only 2g.10gb (at slot 2) is left.
    assert tracesim.largest_placeable(TWO, [slots(0, 1) | slots(4, 1)] * 2, MIX) == 2
    assert tracesim.largest_placeable(TWO, [slots(0, 8)] * 2, MIX) == 0


def test_the_policy_keeps_the_large_placements_that_plain_order_takes() -> None:
    empty: list[list[Placement]] = [[], []]
    plain = tracesim.choose(TWO, "plain", empty, "1g.5gb")
    chosen = tracesim.choose(TWO, "policy", empty, "1g.5gb")
    assert plain == (0, 0)
    assert chosen is not None
    # 4g.20gb has one placement (slot 0): plain order's first 1g.5gb takes it, the policy's does not.
    assert tracesim.free_placements(A100, "4g.20gb", slots(chosen[1], 1)) == (0,)
    assert tracesim.free_placements(A100, "4g.20gb", slots(plain[1], 1)) == ()


def test_a_gpu_with_no_free_placement_is_passed_over() -> None:
    full = [[Placement("7g.40gb", 0, 8)], []]
    assert (tracesim.choose(TWO, "policy", full, "3g.20gb") or (-1, -1))[0] == 1
    assert tracesim.choose(ONE, "plain", [[Placement("7g.40gb", 0, 8)]], "1g.5gb") is None


def test_the_random_yardstick_takes_a_free_placement_drawn_from_its_seed() -> None:
    taken = [[Placement("3g.20gb", 0, 4)]]
    draws = {tracesim.choose(ONE, "random", taken, "1g.5gb", random.Random(n)) for n in range(40)}
    assert {(0, s) for s in (4, 5, 6)} == draws  # every free 1g.5gb placement of the GPU, no other
    pods = tracesim.generate(TraceSpec(5), A100)
    once = tracesim.Replay(FOUR, "random", seed=5).run(pods)
    assert once == tracesim.Replay(FOUR, "random", seed=5).run(pods)


def test_against_plain_order_a_way_is_compared_seed_by_seed() -> None:
    specs = [TraceSpec(s, pods=40) for s in (1, 2)]
    same = tracesim.vs_plain(FOUR, "plain", specs)
    assert (1.0, 1.0, 0, 1.0, 1.0, 0) == (
        same.mean, same.worst, same.losing, same.slice_mean, same.slice_worst, same.slice_losing
    )  # fmt: skip
    ratios, work = [], []
    for spec in specs:
        pods = tracesim.generate(spec, A100)
        got = {way: tracesim.replay(FOUR, way, pods) for way in ("policy", "plain")}
        ratios.append(got["policy"].served / got["plain"].served)
        work.append(got["policy"].slice_seconds / got["plain"].slice_seconds)
    policy = tracesim.vs_plain(FOUR, "policy", specs)
    assert (sum(ratios) / 2, min(ratios), sum(r < 1 for r in ratios)) == (
        policy.mean,
        policy.worst,
        policy.losing,
    )
    assert (sum(work) / 2, min(work)) == (pytest.approx(policy.slice_mean), pytest.approx(policy.slice_worst))


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
    samples = tracesim.Samples((7, 3, 0, 1), (0.5, 0.25))
    summary = tracesim.summarize(outcomes, samples, biggest_g=7, gpus=FOUR)
    assert (summary.served, summary.served_g, summary.withdrawn) == (3, 3, 1)
    # One compute slice for 5 s, three served of four offered.
    assert (summary.slice_seconds, summary.offered_slice_seconds, summary.slice_share) == (15, 20, 0.75)
    assert summary.stranded_share == pytest.approx(0.375)
    assert summary.waits == (("1g.5gb", pytest.approx(1.0), 2.0, 3, 4),)
    assert summary.wait_mean == pytest.approx(1.0)
    assert summary.wait_p95 == pytest.approx(2.0)
    assert (summary.largest_mean_g, summary.largest_7g_share) == (pytest.approx(2.75), 0.25)


def test_a_static_node_without_the_profile_serves_none_of_its_pods() -> None:
    pods = [TracePod(n, float(n), "7g.40gb", 2.0, 1.0) for n in range(3)]
    assert tracesim.replay((A100,) * 3, "static", pods, {"1g.5gb": 21}).served == 0
    assert tracesim.replay((A100,) * 3, "policy", pods).served == 3


def test_a_pod_waits_for_a_slice_until_its_patience_ends() -> None:
    # One GPU, a 7g.40gb held for 10 units: the next waits 10 (patience 12), the third gives up (patience 5).
    pods = [
        TracePod(0, 0.0, "7g.40gb", 10.0, 1.0),
        TracePod(1, 0.5, "7g.40gb", 10.0, 12.0),
        TracePod(2, 1.0, "7g.40gb", 10.0, 5.0),
    ]
    outcomes, _ = tracesim.Replay(ONE, "plain").run(pods)
    assert [o.wait for o in outcomes] == [0.0, 9.5, None]


def test_the_best_static_layout_serves_at_least_any_other_in_the_replay() -> None:
    pods = tracesim.generate(TraceSpec(5, pods=60), A100)
    layouts, summary, tried = tracesim.best_static(TWO, pods)
    assert tried == len(tracesim.node_layouts(TWO, MIX))
    for other in random.Random(0).sample(tracesim.node_layouts(TWO, MIX), 10):
        mine = tracesim.replay(TWO, "static", pods, tracesim.node_counts(other))
        assert tracesim.better(mine) >= tracesim.better(summary)
    assert tracesim.replay(TWO, "static", pods, tracesim.node_counts(layouts)) == summary


def test_plain_order_lists_each_gpus_devices_by_profile_then_start() -> None:
    state = trace.ondemand_node("n", FOUR)
    specs = trace.ondemand_slices("n", state, "plain", FOUR)
    devices = [d.name for d in specs[1].devices]
    assert devices[:3] == ["gpu-0-mig-1g-5gb-at-0", "gpu-0-mig-1g-5gb-at-1", "gpu-0-mig-1g-5gb-at-2"]
    # The same devices as the policy's pool, only in another order; no devices with the counters.
    policy = trace.ondemand_slices("n", state, "policy", FOUR)
    assert [sorted(s.devices, key=lambda d: d.name) for s in specs] == [
        sorted(s.devices, key=lambda d: d.name) for s in policy
    ]
    assert [d.name for d in policy[1].devices] != devices
    assert specs[0].shared_counters
    assert not specs[0].devices


def test_the_policy_pool_follows_the_allocations() -> None:
    state = trace.ondemand_node("n", FOUR)
    before = trace.ondemand_slices("n", state, "policy", FOUR)
    after = trace.ondemand_slices("n", state, "policy", FOUR, ["gpu-0-mig-1g-5gb-at-6"])
    assert [d.name for d in before[1].devices] != [d.name for d in after[1].devices]
    assert before[2:] == after[2:]  # the other GPUs' order is unchanged


def test_occupancy_is_the_slots_of_the_allocated_devices() -> None:
    assert trace.occupancy(FOUR, ["gpu-1-mig-3g-20gb-at-4", "gpu-0-mig-1g-5gb-at-0", "gpu-3", "other"]) == [
        slots(0, 1),
        slots(4, 4),
        0,
        slots(0, 8),
    ]
    assert {parse_ondemand_name(n) for n in ("gpu-1-mig-3g-20gb-at-4",)} == {(1, "3g-20gb", 4)}


def test_the_timeline_shows_the_smallest_largest_profile_of_each_window() -> None:
    assert tracesim.timeline([7, 7, 3, 7, 1, 2, 0], every=3) == "310"


def preset(name: str) -> tracesim.Preset:
    text = (trace.PRESETS / f"{name}.yaml").read_text()
    (config,) = parse_config(name, text, products=[A100.name], catalog=default_catalog())
    return tracesim.preset_on(config, FOUR)


def test_a_shipped_preset_advertises_its_instances_or_whole_gpus_on_four_a100s() -> None:
    assert preset("all-balanced").resources == {
        "nvidia.com/mig-1g.5gb": 8,
        "nvidia.com/mig-2g.10gb": 4,
        "nvidia.com/mig-3g.20gb": 4,
    }
    assert preset("all-1g").counts == {"1g.5gb": 28}
    assert preset("all-disabled").resources == {"nvidia.com/gpu": 4}
    assert preset("all-replicas-4").resources == {"nvidia.com/gpu": 16}
    assert preset("all-enabled").resources == {}


def test_whole_gpus_serve_no_pod_that_asks_for_a_mig_profile() -> None:
    pods = [TracePod(n, float(n), "7g.40gb", 2.0, 1.0) for n in range(3)]
    assert preset("all-disabled").counts == {tracesim.WHOLE: 4}
    assert tracesim.replay(FOUR, "static", pods, preset("all-disabled").counts).served == 0


def test_the_shipped_presets_on_an_a100_are_nine_with_balanced_twice_named() -> None:
    names = [p.name for p in trace.shipped_presets(FOUR)]
    assert "a100-mig-h100-time-sliced=all-balanced" in names
    assert len(names) == len(set(names)) == 9


def test_the_best_preset_serves_the_most_pods_of_the_trace() -> None:
    ones = [TracePod(n, float(n), "1g.5gb", 50.0, 1.0) for n in range(20)]
    presets = [preset(n) for n in ("all-1g", "all-2g", "all-balanced", "all-disabled")]
    best, summary = tracesim.best_preset(FOUR, ones, presets)
    assert (best.name, summary.served) == ("all-1g", 20)
    threes = [TracePod(n, float(n), "3g.20gb", 50.0, 1.0) for n in range(20)]
    best, summary = tracesim.best_preset(FOUR, threes, [*presets, preset("all-3g")])
    assert (best.name, summary.served) == ("all-3g", 8)


def test_the_best_preset_of_a_trace_serves_no_more_than_the_hindsight_layout() -> None:
    pods = tracesim.generate(TraceSpec(5, pods=60), A100)
    # shipped_presets resolves each preset for the bench's four GPUs: the same four here.
    _, hindsight, _ = tracesim.best_static(FOUR, pods)
    _, summary = tracesim.best_preset(FOUR, pods, trace.shipped_presets(FOUR))
    assert tracesim.better(summary) >= tracesim.better(hindsight)


def test_equal_presets_are_merged_under_both_names() -> None:
    a = tracesim.Preset("b", {"nvidia.com/gpu": 4})
    b = tracesim.Preset("a", {"nvidia.com/gpu": 4})
    c = tracesim.Preset("c", {})
    assert tracesim.merge_same([a, b, c]) == (tracesim.Preset("a=b", {"nvidia.com/gpu": 4}), c)


def test_a_trace_file_reads_back_what_was_written_in_arrival_order(tmp_path: Path) -> None:
    pods = tracesim.generate(TraceSpec.shifting(4, pods=30), A100)
    path = tmp_path / "trace.csv"
    tracesim.write_trace(reversed(pods), path)
    assert tracesim.read_trace(path, FOUR) == pods


def test_a_trace_file_without_patience_gives_every_pod_the_default(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("profile,arrival,lifetime\n3g.20gb,2,10\n\ngpu,1.5,4\n")
    assert tracesim.read_trace(path, FOUR, patience=9) == (
        TracePod(0, 1.5, tracesim.WHOLE, 4.0, 9),
        TracePod(1, 2.0, "3g.20gb", 10.0, 9),
    )
    assert {p.patience for p in tracesim.read_trace(path, FOUR)} == {tracesim.PATIENCE}


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("", "t.csv: empty"),
        ("arrival,lifetime\n1,2\n", "t.csv:1: the header lacks profile"),
        ("arrival,lifetime,profile,owner\n", "t.csv:1: column 4: 'owner' is not one of"),
        ("arrival,lifetime,profile\n", "t.csv: no rows after the header"),
        ("arrival,lifetime,profile\n1,2,1g.5gb\n1,2\n", "t.csv:3: 2 fields, the header has 3"),
        (
            "arrival,lifetime,profile\n1,x,1g.5gb\n",
            "t.csv:2: column 2 (lifetime): 'x' is not a number above 0",
        ),
        (
            "arrival,lifetime,profile\n1,0,1g.5gb\n",
            "t.csv:2: column 2 (lifetime): '0' is not a number above 0",
        ),
        (
            "arrival,lifetime,profile\n-1,2,1g.5gb\n",
            "t.csv:2: column 1 (arrival): '-1' is not a number at least 0",
        ),
        ("arrival,lifetime,profile\nnan,2,1g.5gb\n", "t.csv:2: column 1 (arrival): 'nan' is not a number"),
        (
            "arrival,lifetime,profile\n1,2,1g.18gb\n",
            "t.csv:2: column 3 (profile): no GPU here (A100-SXM4-40GB)",
        ),
        (
            "arrival,lifetime,profile,patience\n1,2,gpu,\n3,2,gpu,soon\n",
            "t.csv:3: column 4 (patience): 'soon' is not a number at least 0",
        ),
    ],
)
def test_a_malformed_trace_file_is_refused_naming_its_line_and_column(
    tmp_path: Path, text: str, where: str
) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(tracesim.TraceFileError) as raised:
        tracesim.read_trace(path, FOUR)
    assert str(raised.value).startswith(f"{tmp_path}/{where}")


def test_gpus_are_given_as_products_and_counts() -> None:
    assert tracesim.parse_gpus("A100-SXM4-40GB:2,H100-80GB-HBM3:1", CATALOG) == (A100, A100, H100)
    for bad, says in (("A100-SXM4-40GB", "not PRODUCT:N"), ("A100-SXM4-40GB:0", "not PRODUCT:N"),
                      ("L4:2", "no MIG-capable GPU"), ("Nope:1", "no MIG-capable GPU")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            tracesim.parse_gpus(bad, CATALOG)


def test_a_shifting_trace_draws_each_third_from_its_phase() -> None:
    pods = tracesim.generate(TraceSpec.shifting(2, pods=300), A100)
    first, middle, last = pods[:100], pods[100:200], pods[200:]
    assert "7g.40gb" not in tracesim.mix_counts(first)
    assert "2g.10gb" not in tracesim.mix_counts(middle)
    assert set(tracesim.mix_counts(last)) == set(MIX)
    assert tracesim.mix_counts(first)["1g.5gb"] > 50 > tracesim.mix_counts(middle).get("1g.5gb", 0)
    # Profiles are named on the product: an H100's 3g is 3g.40gb.
    assert set(tracesim.mix_counts(tracesim.generate(TraceSpec.shifting(2, 30), H100))) <= {
        "1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb",
    }  # fmt: skip


def test_a_whole_gpu_pod_takes_an_empty_gpu_and_nothing_shares_it() -> None:
    pods = [
        TracePod(0, 0.0, "1g.5gb", 10.0, 1.0),
        TracePod(1, 1.0, tracesim.WHOLE, 10.0, 1.0),
        TracePod(2, 2.0, tracesim.WHOLE, 10.0, 1.0),
        TracePod(3, 3.0, "1g.5gb", 10.0, 1.0),
    ]
    outcomes, _ = tracesim.Replay(TWO, "policy").run(pods)
    # GPU 0 holds a 1g.5gb: the first whole GPU is GPU 1, the second finds none free; the last 1g.5gb
    # goes next to the first, not onto the whole GPU.
    assert [o.wait for o in outcomes] == [0.0, 0.0, None, 0.0]
    summary = tracesim.replay(TWO, "policy", pods)
    assert summary.slice_seconds == 10 + 7 * 10 + 10
    assert tracesim.replay(TWO, "static", pods, {tracesim.WHOLE: 1, "1g.5gb": 7}).served == 3
    assert ((tracesim.WHOLE, 1),) in tracesim.gpu_layouts(A100, ["1g.5gb", tracesim.WHOLE])


def test_a_profile_is_placed_only_on_the_gpus_whose_product_has_it() -> None:
    gpus = (A100, H100)
    pods = [TracePod(0, 0.0, "3g.40gb", 10.0, 1.0), TracePod(1, 0.5, "3g.40gb", 10.0, 1.0),
            TracePod(2, 1.0, "3g.40gb", 10.0, 1.0), TracePod(3, 1.5, "3g.20gb", 10.0, 1.0)]  # fmt: skip
    outcomes, _ = tracesim.Replay(gpus, "plain").run(pods)
    assert [o.wait is not None for o in outcomes] == [True, True, False, True]  # two 3g.40gb fill the H100
    assert len(tracesim.node_layouts((A100, A100, H100), ["3g.20gb", "3g.40gb"])) == 1  # 2x 3g each
    assert tracesim.node_layouts((A100, A100, H100), ["3g.20gb", "3g.40gb"])[0] == (
        (("3g.20gb", 2),), (("3g.20gb", 2),), (("3g.40gb", 2),),
    )  # fmt: skip


def test_free_slots_no_waiting_pod_can_use_are_stranded() -> None:
    three = slots(0, 4)  # a 3g.20gb at 0: slots 4-7 free
    assert tracesim.stranded_ondemand(ONE, [three], {"7g.40gb"}) == 4
    assert tracesim.stranded_ondemand(ONE, [three], {"7g.40gb", "3g.20gb"}) == 0
    assert tracesim.stranded_ondemand(ONE, [slots(0, 2) | slots(4, 2)], {"3g.20gb"}) == 4
    # Static: a free 3g.20gb instance while only 1g.5gb pods wait, and the slots a layout leaves empty.
    assert tracesim.stranded_static(ONE, {"3g.20gb": 2}, {"3g.20gb": 1}, {"1g.5gb"}) == 4
    assert tracesim.stranded_static(ONE, {"2g.10gb": 3}, {"2g.10gb": 0}, {"1g.5gb"}) == 2
    pods = [
        TracePod(0, 0.0, "3g.20gb", 10.0, 5.0),
        TracePod(1, 0.5, "7g.40gb", 5.0, 5.0),
        TracePod(2, 3.0, "7g.40gb", 5.0, 5.0),
    ]
    _, samples = tracesim.Replay(ONE, "policy").run(pods)
    assert samples.stranded
    assert set(samples.stranded) == {0.5}  # a 7g waits at 1, 2 and 3: 4 of 8 slots stranded


def test_the_bench_refuses_a_malformed_trace_file_before_it_starts_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("arrival,lifetime,profile\n1,2,3g.20gb\n2,x,gpu\n")
    with pytest.raises(SystemExit) as exited:
        bench_main(["--only", "trace", "--trace", str(path)])
    assert exited.value.code == 2
    assert (
        f"bench: error: {path}:3: column 2 (lifetime): 'x' is not a number above 0" in capsys.readouterr().err
    )
