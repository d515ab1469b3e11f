"""The planner against an independent brute force, on every catalog product.

Brute force here enumerates every assignment of catalog placements, with nothing but an overlap
check; the planner must agree with it on feasibility and on how many instances can be kept.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterator

import pytest

from sharing.mig.catalog import Product, default_catalog
from sharing.mig.plan import Existing, Infeasibility, Infeasible, Plan, plan_gpu

PRODUCTS = [p for p in default_catalog().products if p.profiles]
Layout = tuple[tuple[str, int], ...]


def all_multisets(product: Product) -> Iterator[Counter[str]]:
    """Every multiset of profiles within the max counts (the empty one included)."""
    ranges = [range(p.max_count + 1) for p in product.profiles]
    for counts in itertools.product(*ranges):
        yield Counter({p.name: n for p, n in zip(product.profiles, counts, strict=True) if n})


def brute_layouts(product: Product, want: Counter[str]) -> Iterator[Layout]:
    """Every valid layout of `want` (as sorted (profile, start) tuples), possibly repeated."""
    items = sorted(want.elements())
    compute = sum(product.require_profile(n).compute_slices for n in items)
    if compute > product.compute_slices or any(
        n > product.require_profile(p).max_count for p, n in want.items()
    ):
        return

    def place(i: int, used: set[int], acc: list[tuple[str, int]]) -> Iterator[Layout]:
        if i == len(items):
            yield tuple(sorted(acc))
            return
        profile = product.require_profile(items[i])
        for start in profile.placements:
            span = set(range(start, start + profile.size))
            if used & span:
                continue
            acc.append((profile.name, start))
            yield from place(i + 1, used | span, acc)
            acc.pop()

    yield from place(0, set(), [])


def assert_valid(product: Product, plan: Plan, want: Counter[str]) -> None:
    used: set[int] = set()
    for p in plan.layout:
        profile = product.require_profile(p.profile)
        assert p.start in profile.placements
        assert p.size == profile.size
        span = set(range(p.start, p.start + p.size))
        assert not used & span, plan.layout
        used |= span
    assert want == Counter(p.profile for p in plan.layout)


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_feasible_exactly_when_brute_force_finds_a_layout(product: Product) -> None:
    checked = 0
    for want in all_multisets(product):
        expected = next(brute_layouts(product, want), None) is not None
        result = plan_gpu(product, [], want)
        assert expected == isinstance(result, Plan), (dict(want), result)
        if isinstance(result, Plan):
            assert_valid(product, result, want)
            assert () == result.destroy
            assert () == result.keep
            assert sorted(result.layout) == sorted(result.create)
        checked += 1
    assert checked == len(list(all_multisets(product)))


def random_layout(rng: random.Random, product: Product) -> Layout:
    want = Counter(rng.choice(product.profiles).name for _ in range(rng.randint(0, 7)))
    layouts = list(dict.fromkeys(brute_layouts(product, want)))
    return rng.choice(layouts) if layouts else ()


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_transitions_keep_the_most_and_never_touch_busy(product: Product) -> None:
    rng = random.Random(product.name)
    for _ in range(150):
        current = random_layout(rng, product)
        existing = [Existing(name, start, busy=rng.random() < 0.3) for name, start in current]
        want = Counter(name for name, _ in random_layout(rng, product))
        busy = {(e.profile, e.start) for e in existing if e.busy}
        free = {(e.profile, e.start) for e in existing if not e.busy}
        candidates = [set(layout) for layout in brute_layouts(product, want) if busy <= set(layout)]
        result = plan_gpu(product, existing, want)
        if not candidates:
            assert isinstance(result, Infeasible), (current, dict(want), result)
            continue
        assert isinstance(result, Plan), (current, dict(want), result)
        assert_valid(product, result, want)
        best = max(len(layout & free) for layout in candidates)
        kept = {(p.profile, p.start) for p in result.keep}
        assert busy <= kept
        assert best == len(kept - busy)
        destroyed = {(p.profile, p.start) for p in result.destroy}
        assert not destroyed & busy
        assert destroyed == free - kept
        # Execute on a slot map: destroys first, then creates in the planned order.
        slots: dict[int, str] = {}
        for name, start in set(current) - destroyed:
            for i in range(start, start + product.require_profile(name).size):
                slots[i] = name
        for p in result.create:
            assert p.start in product.require_profile(p.profile).placements
            for i in range(p.start, p.start + p.size):
                assert i not in slots, (p, slots)
                slots[i] = p.profile


A100 = default_catalog().product("A100-SXM4-40GB")


@pytest.mark.parametrize(
    ("have", "want", "kind", "reason"),
    [
        (
            [],
            {"2g.10gb": 4},
            Infeasibility.TOO_MANY,
            "4 instances of 2g.10gb exceed the maximum of 3 on A100-SXM4-40GB",
        ),
        (
            [],
            {"3g.20gb": 1, "4g.20gb": 1, "1g.5gb": 1},
            Infeasibility.OVER_CAPACITY,
            "need 9 placement slots and 8 compute",
        ),
        (
            [],
            {"9g.99gb": 1},
            Infeasibility.UNKNOWN_PROFILE,
            "unknown MIG profile '9g.99gb' on A100-SXM4-40GB",
        ),
        (
            [Existing("3g.20gb", 0, busy=True)],
            {"7g.40gb": 1},
            Infeasibility.BUSY_NOT_WANTED,
            "3g.20gb@0:busy",
        ),
        (
            [Existing("1g.5gb", 6, busy=True)],
            {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2},
            Infeasibility.FRAGMENTED_BY_BUSY,
            "not around the busy instances 1g.5gb@6:busy",
        ),
    ],
    ids=["too-many", "over-capacity", "unknown-profile", "busy-not-wanted", "fragmented"],
)
def test_infeasible_answers_say_why(
    have: list[Existing], want: dict[str, int], kind: Infeasibility, reason: str
) -> None:
    result = plan_gpu(A100, have, want)
    assert isinstance(result, Infeasible)
    assert kind == result.kind
    assert reason in result.reason


def test_documented_ordering_trap_is_planned() -> None:
    """NVIDIA's guide: creating 1g,1g,2g,3g in that order fails with driver placement; we place explicitly."""
    result = plan_gpu(A100, [], {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})
    assert isinstance(result, Plan)
    assert "3g.20gb" == result.create[0].profile


def test_matching_gpu_needs_no_steps() -> None:
    have = [Existing("3g.20gb", 4), Existing("2g.10gb", 2), Existing("1g.5gb", 0), Existing("1g.5gb", 1)]
    result = plan_gpu(A100, have, {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2})
    assert isinstance(result, Plan)
    assert 0 == result.changes


def test_layouts_leave_room_to_grow() -> None:
    """A 3g goes to slices 4-7, so a later 1g fits without a rebuild (no 1g can start at slice 7)."""
    first = plan_gpu(A100, [], {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 1})
    assert isinstance(first, Plan)
    assert 4 == next(p.start for p in first.layout if p.profile == "3g.20gb")
    grown = plan_gpu(
        A100, [Existing(p.profile, p.start) for p in first.layout], {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}
    )
    assert isinstance(grown, Plan)
    assert 1 == grown.changes


RTX = default_catalog().product("RTX-PRO-6000")


@pytest.mark.parametrize(
    ("have", "want", "expected"),
    [
        pytest.param(
            [], {"2g.48gb": 1, "1g.24gb": 2}, ["2g.48gb@0", "1g.24gb@6", "1g.24gb@9"], id="half-and-quarters"
        ),
        pytest.param(
            [Existing("1g.24gb", 3, busy=True)],
            {"1g.24gb": 2, "2g.48gb": 1},
            ["1g.24gb@0", "1g.24gb@3", "2g.48gb@6"],
            id="around-a-busy-quarter",
        ),
        pytest.param([], {"4g.96gb+gfx": 1}, ["4g.96gb+gfx@0"], id="whole-card-with-graphics"),
    ],
)
def test_the_twelve_slot_grid_of_the_rtx_pro_6000(
    have: list[Existing], want: dict[str, int], expected: list[str]
) -> None:
    result = plan_gpu(RTX, have, want)
    assert isinstance(result, Plan)
    assert expected == [str(p) for p in result.layout]


def test_the_twelve_slot_grid_refuses_what_does_not_fit() -> None:
    busy = [Existing("1g.24gb", 3, busy=True), Existing("1g.24gb", 6, busy=True)]
    result = plan_gpu(RTX, busy, {"1g.24gb": 2, "2g.48gb": 1})
    assert isinstance(result, Infeasible)
    assert Infeasibility.FRAGMENTED_BY_BUSY == result.kind
    over = plan_gpu(RTX, [], {"2g.48gb": 2, "1g.24gb": 1})
    assert isinstance(over, Infeasible)
    assert "need 15 placement slots and 5 compute slices; RTX-PRO-6000 has 12 and 4" in over.reason
