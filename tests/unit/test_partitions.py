"""On-demand MIG as partitionable devices: the counters of each catalog GPU, a device for every placement,
no two overlapping placements allocatable together, the 1.35+ slice rules, and the placement policy as
the kube-scheduler's first-fit allocator applies it (modelled here on
k8s.io/dynamic-resource-allocation structured/internal/incubating `allocateOne` and
`checkAvailableCounters`; tests/integration/test_ondemand_scheduling.py runs the real one)."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterator, Sequence

import pytest

from sharing.dra.counters import counters
from sharing.dra.names import DRIVER, ondemand_device_name, parse_ondemand_name
from sharing.dra.partitions import MAX_COUNTER_SETS, partitionable_slices, pool, withdrawn_static
from sharing.dra.placements import held_by, named
from sharing.dra.slices import MAX_DEVICES_WITH_TAINTS
from sharing.kube.api import CounterSet, SliceDevice, SliceSpec
from sharing.mig import Placement, Product, Profile, default_catalog
from sharing.mig.policy import Fit, fit, fragmented, placements, plain, ranked
from sharing.model import ComputeInstance, DriverInfo, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState

CATALOG = default_catalog()
MIG_PRODUCTS = [p for p in CATALOG.products if p.profiles]
CHECKED = ["A100-SXM4-40GB", "A100-SXM4-80GB", "H100-80GB-HBM3", "A30", "RTX-PRO-6000"]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 10**3, "M": 10**6}


def quantity(text: str) -> int:
    for suffix, factor in _UNITS.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def values(counter_set: CounterSet) -> Counter[str]:
    return Counter({name: quantity(v) for name, v in counter_set.counters})


def gpu(index: int, product: Product, instances: tuple[GpuInstance, ...] = ()) -> Gpu:
    name = "NVIDIA " + (product.nvml_names or (product.name,))[0].removeprefix("NVIDIA ")
    return Gpu(index, GpuUuid(f"GPU-{index}"), name, product.memory_mib, True, True, True, instances,
               compute_capability=(8, 0), profiles=product)  # fmt: skip


def node_of(*gpus: Gpu) -> NodeState:
    return NodeState(gpus, driver=DriverInfo("550.107.02", 12040))


def layouts(product: Product) -> Iterator[tuple[Placement, ...]]:
    """Every set of placements the hardware allows together: disjoint, within each maximum count."""
    options = [Placement(p.name, s, p.size) for p in product.profiles for s in p.placements]
    limit = {p.name: p.max_count for p in product.profiles}

    def walk(i: int, mask: int, chosen: tuple[Placement, ...]) -> Iterator[tuple[Placement, ...]]:
        yield chosen
        for j in range(i, len(options)):
            o = options[j]
            span = ((1 << o.size) - 1) << o.start
            if mask & span or sum(c.profile == o.profile for c in chosen) >= limit[o.profile]:
                continue
            yield from walk(j + 1, mask | span, (*chosen, o))

    yield from walk(0, 0, ())


def devices_of(specs: Sequence[SliceSpec]) -> dict[str, SliceDevice]:
    return {d.name: d for s in specs for d in s.devices}


class FirstFit:
    """The allocator's choice for one-device requests: the first device in pool order (slices, then
    devices as listed) that is not allocated, matches the profile, and whose counters still fit."""

    def __init__(self, specs: Sequence[SliceSpec]) -> None:
        self.specs = specs
        self.allocated: list[str] = []

    def available(self) -> Counter[str]:
        left: Counter[str] = Counter()
        for s in self.specs:
            for c in s.shared_counters:
                left.update({f"{c.name}/{k}": v for k, v in values(c).items()})
        devices = devices_of(self.specs)
        for name in self.allocated:
            for c in devices[name].consumes_counters:
                left.subtract({f"{c.name}/{k}": v for k, v in values(c).items()})
        return left

    def allocate(self, profile: str) -> str | None:
        left = self.available()
        for s in self.specs:
            for d in s.devices:
                if d.name in self.allocated or dict(d.attributes).get("profile") != profile:
                    continue
                need = Counter(
                    {f"{c.name}/{k}": v for c in d.consumes_counters for k, v in values(c).items()}
                )
                if all(left[k] >= v for k, v in need.items()):
                    self.allocated.append(d.name)
                    return d.name
        return None


@pytest.mark.parametrize("name", CHECKED)
def test_no_two_overlapping_placements_fit_the_counters_and_every_valid_layout_does(name: str) -> None:
    product = CATALOG.product(name)
    specs = partitionable_slices("n", node_of(gpu(0, product)), {"GPU-0"}, CATALOG)
    have = values(specs[0].shared_counters[0])
    offered = {p.name for p in named(product).values()}
    use = {
        (dict(d.attributes)["profile"], dict(d.attributes)["placementStart"]): values(d.consumes_counters[0])
        for d in specs[1].devices
    }
    for a, b in itertools.combinations(sorted(use), 2):
        pa, pb = product.require_profile(a[0]), product.require_profile(b[0])
        overlap = a[1] < b[1] + pb.size and b[1] < a[1] + pa.size
        capped = a[0] == b[0] and pa.max_count < 2
        together = use[a] + use[b]
        fits = all(together[k] <= have[k] for k in together)
        assert fits is not (overlap or capped), (a, b)
    count = 0
    for layout in layouts(product):
        if any(p.profile not in offered for p in layout):
            continue
        total: Counter[str] = sum((use[(p.profile, p.start)] for p in layout), Counter())
        assert all(total[k] <= have[k] for k in total), layout
        count += 1
    assert count > 50


@pytest.mark.parametrize(
    ("name", "memory", "sms", "capped"),
    [
        ("A100-SXM4-40GB", "40192Mi", "98", ["1g-5gb-me-instances"]),
        ("A100-SXM4-80GB", "79Gi", "98", ["1g-10gb-me-instances"]),
        ("H100-80GB-HBM3", "81152Mi", "132", ["1g-10gb-me-instances"]),
    ],
)
def test_the_counters_of_a_gpu(name: str, memory: str, sms: str, capped: list[str]) -> None:
    found = counters(CATALOG.product(name), 3)
    assert found == CounterSet(
        "gpu-3-counters",
        tuple(
            sorted(
                [("memory", memory), ("multiprocessors", sms)]
                + [(f"memory-slice-{n}", "1") for n in range(8)]
                + [(c, "1") for c in capped]
            )
        ),
    )


@pytest.mark.parametrize("product", MIG_PRODUCTS, ids=lambda p: p.name)
def test_every_placement_the_driver_reports_is_one_device(product: Product) -> None:
    specs = partitionable_slices("n", node_of(gpu(0, product)), {"GPU-0"}, CATALOG)
    assert [len(s.shared_counters) for s in specs] == [1] + [0] * (len(specs) - 1)
    names = [d.name for s in specs[1:] for d in s.devices]
    offered = {p.name for p in named(product).values()}
    expected = {
        ondemand_device_name(0, p.profile, p.start) for p in placements(product) if p.profile in offered
    }
    assert sorted(names) == sorted(expected)
    assert all(DNS_LABEL.match(n) for n in names)
    assert all(len(s.devices) <= MAX_DEVICES_WITH_TAINTS for s in specs)
    assert all(len(c.counters) <= 32 for s in specs for c in s.shared_counters)


def test_the_attributes_are_nvidias_plus_the_placement() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    device = devices_of(partitionable_slices("n", node_of(gpu(1, product)), {"GPU-1"}, CATALOG))[
        "gpu-1-mig-3g-20gb-at-4"
    ]
    attributes = dict(device.attributes)
    assert {k: attributes[k] for k in ("type", "profile", "parentUUID", "parentIndex", "productName")} == {
        "type": "mig",
        "profile": "3g.20gb",
        "parentUUID": "GPU-1",
        "parentIndex": 1,
        "productName": "NVIDIA A100-SXM4-40GB",
    }
    assert (attributes["placementStart"], attributes["placementSize"]) == (4, 4)
    assert dict(device.capacity)["memory"].value == "19968Mi"
    assert values(device.consumes_counters[0]) == Counter(
        {"memory": 19968 << 20, "multiprocessors": 42} | {f"memory-slice-{n}": 1 for n in range(4, 8)}
    )


def test_the_whole_gpu_consumes_everything() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    specs = partitionable_slices("n", node_of(gpu(0, product)), {"GPU-0"}, CATALOG, whole_gpu=True)
    whole = devices_of(specs)["gpu-0"]
    assert dict(whole.attributes)["type"] == "gpu"
    assert whole.consumes_counters == specs[0].shared_counters


def test_counter_sets_and_devices_are_never_in_one_slice_and_the_pool_agrees() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    gpus = tuple(gpu(i, product) for i in range(MAX_COUNTER_SETS + 1))
    specs = partitionable_slices("n", node_of(*gpus), {g.uuid for g in gpus}, CATALOG, generation=5)
    assert [len(s.shared_counters) for s in specs[:2]] == [MAX_COUNTER_SETS, 1]
    assert all(not (s.devices and s.shared_counters) for s in specs)
    assert len(specs) == 2 + len(gpus)
    assert {(s.generation, s.slice_count, s.driver, s.pool) for s in specs} == {(5, len(specs), DRIVER, "n")}


def test_more_placements_than_a_slice_holds_are_chunked() -> None:
    profiles = tuple(Profile(f"1g.{n}gb", n, n, 1, 1, 24, 1024, tuple(range(24))) for n in (1, 2, 3))
    wide = Product("WIDE", ("WIDE",), (), 1 << 20, 24, 24, profiles)
    specs = partitionable_slices("n", node_of(gpu(0, wide)), {"GPU-0"}, CATALOG)
    assert [len(s.devices) for s in specs] == [0, MAX_DEVICES_WITH_TAINTS, 72 - MAX_DEVICES_WITH_TAINTS]


def test_a_gpu_with_mig_off_or_not_dynamic_offers_nothing() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    off = Gpu(0, GpuUuid("GPU-0"), "NVIDIA A100-SXM4-40GB", 40960, True, False, True, profiles=product)
    assert partitionable_slices("n", node_of(off, gpu(1, product)), {"GPU-0"}, CATALOG) == ()


def whole(gi: int, profile: str, start: int, size: int, slices: int) -> GpuInstance:
    """A GPU instance with one compute instance spanning its `slices` compute slices."""
    return GpuInstance(gi, profile, start, size, (ComputeInstance(0, MigUuid(f"MIG-{gi}"), slices=slices),))


def overlapping(name: str, start: int, size: int) -> bool:
    """Whether the on-demand device `name` of an A100-SXM4-40GB overlaps the slots [start, start+size)."""
    parsed = parse_ondemand_name(name)
    assert parsed is not None
    length = named(CATALOG.product("A100-SXM4-40GB"))[parsed[1]].size
    return parsed[2] < start + size and start < parsed[2] + length


def test_a_foreign_instance_is_offered_first_as_itself_and_nothing_that_overlaps_it_is_offered() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    made = whole(1, "1g.5gb", 6, 1, 1)
    foreign = whole(2, "3g.20gb", 0, 4, 3)
    allocated = ["gpu-0-mig-1g-5gb-at-6", "gpu-0-mig-2g-10gb-at-4", "gpu-7-mig-1g-5gb-at-0", "other"]
    node = node_of(gpu(0, product, (made, foreign)))
    specs = partitionable_slices("n", node, {"GPU-0"}, CATALOG, prepared=allocated, whole_gpu=True,
                                 held={("GPU-0", "1g.5gb", 6)})  # fmt: skip
    names = [d.name for s in specs for d in s.devices]
    assert {"gpu-0-mig-1g-5gb-at-6", "gpu-0-mig-2g-10gb-at-4"} <= set(names)  # the scheduler counts these
    assert "gpu-0-mig-3g-20gb-at-0" == names[0]  # there already: it takes no more room
    assert [n for n in names if overlapping(n, 0, 4)] == ["gpu-0-mig-3g-20gb-at-0"]
    assert "gpu-0" not in names
    # Unclaimed, nothing the scheduler allocates beside it overlaps it; claimed, it is the one given.
    for claims in (("1g.5gb",) * 4 + ("2g.10gb", "4g.20gb", "7g.40gb"), ("3g.20gb",) * 2 + ("1g.5gb",) * 4):
        fit = FirstFit(specs)
        fit.allocated += allocated[:2]
        for profile in claims:
            fit.allocate(profile)
        got = [n for n in fit.allocated if overlapping(n, 0, 4)]
        assert got == (["gpu-0-mig-3g-20gb-at-0"] if "3g.20gb" in claims else [])


TWO_SMALL = tuple(ComputeInstance(i, MigUuid(f"MIG-{i}"), slices=1) for i in (0, 1))


@pytest.mark.parametrize(
    ("instance", "held"),
    [
        (GpuInstance(2, "3g.20gb", 0, 4), ()),
        (whole(2, "3g.20gb", 0, 4, 1), ()),
        (GpuInstance(2, "3g.20gb", 0, 4, TWO_SMALL), ()),
        (whole(2, "3g.20gb", 0, 4, 3), (("GPU-0", "3g.20gb", 0),)),
    ],
    ids=["no-compute-instance", "smaller-compute-instance", "two-compute-instances", "held-by-a-claim"],
)  # fmt: skip
def test_an_instance_that_is_not_one_free_whole_mig_device_withdraws_everything_that_overlaps_it(
    instance: GpuInstance, held: tuple[tuple[str, str, int], ...]
) -> None:
    """A claim just deallocated and not unprepared yet holds its instance (`held`) until its unprepare."""
    specs = partitionable_slices("n", node_of(gpu(0, CATALOG.product("A100-SXM4-40GB"), (instance,))),
                                 {"GPU-0"}, CATALOG, held=held)  # fmt: skip
    names = [d.name for s in specs for d in s.devices]
    assert [n for n in names if overlapping(n, 0, 4)] == []
    assert "gpu-0-mig-3g-20gb-at-4" in names


def test_a_foreign_instance_of_a_counted_profile_withdraws_the_others_of_that_profile() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    assert product.require_profile("1g.5gb+me").max_count == 1
    specs = partitionable_slices(
        "n", node_of(gpu(0, product, (whole(1, "1g.5gb+me", 6, 1, 1),))), {"GPU-0"}, CATALOG
    )
    names = [d.name for s in specs for d in s.devices]
    assert [n for n in names if "1g-5gb-me" in n] == ["gpu-0-mig-1g-5gb-me-at-6"]
    assert "gpu-0-mig-1g-5gb-at-0" in names


def test_an_xid_taints_every_on_demand_device_of_its_gpu() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    specs = partitionable_slices("n", node_of(gpu(0, product)), {"GPU-0"}, CATALOG, xids={"GPU-0": 48})
    assert {(t.key, t.value, t.effect) for d in devices_of(specs).values() for t in d.taints} == {
        ("gpu.nvidia.com/xid", "48", "NoSchedule")
    }


def test_a_gpu_the_health_overlay_marks_taints_its_on_demand_devices_and_recovery_clears_them() -> None:
    product = CATALOG.product("A100-SXM4-40GB")
    node = node_of(gpu(0, product), gpu(1, product))
    sick = partitionable_slices("n", node, {"GPU-0", "GPU-1"}, CATALOG, unhealthy={"GPU-1"})
    tainted = {n for n, d in devices_of(sick).items() if d.taints}
    assert tainted == {n for n in devices_of(sick) if n.startswith("gpu-1-")}
    assert tainted
    assert {(t.key, t.value, t.effect) for d in devices_of(sick).values() for t in d.taints} == {
        ("gpu.nvidia.com/xid", "", "NoSchedule")
    }
    healthy = partitionable_slices("n", node, {"GPU-0", "GPU-1"}, CATALOG)
    assert not any(d.taints for d in devices_of(healthy).values())


def test_static_devices_of_a_dynamic_gpu_leave_the_static_slices() -> None:
    static = (
        SliceSpec(DRIVER, "n", "n", 1, 1, (SliceDevice("gpu-0-mig-1", (("parentUUID", "GPU-0"),)),
                                            SliceDevice("gpu-1", (("uuid", "GPU-1"),)))),
    )  # fmt: skip
    kept = withdrawn_static(static, {"GPU-0"})
    assert [d.name for s in kept for d in s.devices] == ["gpu-1"]
    both = pool(kept, partitionable_slices("n", node_of(gpu(0, CATALOG.product("A30"))), {"GPU-0"}, CATALOG))
    assert {(s.generation, s.slice_count) for s in both} == {(1, 3)}


# The placement policy, as the first-fit allocator applies it to the published order.


def publish(product: Product, n: int, allocated: Sequence[str], order: str = "ranked") -> list[SliceSpec]:
    gpus = tuple(gpu(i, product) for i in range(n))
    specs = list(
        partitionable_slices("n", node_of(*gpus), {g.uuid for g in gpus}, CATALOG, prepared=allocated)
    )
    if order == "plain":
        for k, s in enumerate(specs):
            if s.devices:
                by_name = {d.name: d for d in s.devices}
                gpu_index = int(s.devices[0].name.split("-")[1])
                specs[k] = SliceSpec(
                    s.driver, s.node, s.pool, s.generation, s.slice_count,
                    tuple(by_name[ondemand_device_name(gpu_index, p.profile, p.start)]
                          for p in placements(product)
                          if ondemand_device_name(gpu_index, p.profile, p.start) in by_name),
                )  # fmt: skip
    return specs


def run(product: Product, n: int, steps: Sequence[str], order: str = "ranked") -> list[str | None]:
    """Allocate (`+profile`) and release (`-device`) in turn, re-publishing after each change."""
    allocated: list[str] = []
    chosen: list[str | None] = []
    for step in steps:
        if step.startswith("-"):
            allocated.remove(step[1:])
            continue
        allocator = FirstFit(publish(product, n, allocated, order))
        allocator.allocated = list(allocated)
        got = allocator.allocate(step[1:])
        chosen.append(got)
        if got is not None:
            allocated.append(got)
    return chosen


A100 = CATALOG.product("A100-SXM4-40GB")


def test_seven_small_slices_pack_one_gpu_and_the_largest_fits_the_other() -> None:
    chosen = run(A100, 2, ["+1g.5gb"] * 7 + ["+7g.40gb"])
    assert chosen == [f"gpu-0-mig-1g-5gb-at-{s}" for s in (6, 5, 4, 3, 2, 1, 0)] + ["gpu-1-mig-7g-40gb-at-0"]


def test_after_four_leave_a_3g_lands_at_a_valid_placement() -> None:
    first = run(A100, 2, ["+1g.5gb"] * 7)
    released = [f"-{d}" for d in first[:4] if d]
    chosen = run(A100, 2, ["+1g.5gb"] * 7 + released + ["+3g.20gb"])
    assert chosen[-1] == "gpu-0-mig-3g-20gb-at-4"


@pytest.mark.parametrize(
    ("steps", "ours", "plain_order"),
    [
        pytest.param(
            ["+3g.20gb", "+1g.5gb", "+2g.10gb", "+1g.5gb"],
            [
                "gpu-0-mig-3g-20gb-at-4",
                "gpu-0-mig-1g-5gb-at-3",
                "gpu-0-mig-2g-10gb-at-0",
                "gpu-0-mig-1g-5gb-at-2",
            ],
            ["gpu-0-mig-3g-20gb-at-0", "gpu-0-mig-1g-5gb-at-4", None, "gpu-0-mig-1g-5gb-at-5"],
            id="3g-1g-2g-1g",
        ),
        pytest.param(
            ["+1g.5gb", "+1g.5gb", "+3g.20gb", "+4g.20gb"],
            ["gpu-0-mig-1g-5gb-at-6", "gpu-0-mig-1g-5gb-at-5", "gpu-0-mig-3g-20gb-at-0", None],
            ["gpu-0-mig-1g-5gb-at-0", "gpu-0-mig-1g-5gb-at-1", "gpu-0-mig-3g-20gb-at-4", None],
            id="1g-1g-3g-then-no-4g",
        ),
        pytest.param(
            ["+1g.5gb", "+4g.20gb"],
            ["gpu-0-mig-1g-5gb-at-6", "gpu-0-mig-4g-20gb-at-0"],
            ["gpu-0-mig-1g-5gb-at-0", None],
            id="a-1g-leaves-the-4g",
        ),
    ],
)
def test_the_policy_against_plain_placement_order(
    steps: list[str], ours: list[str | None], plain_order: list[str | None]
) -> None:
    assert run(A100, 1, steps) == ours
    assert run(A100, 1, steps, order="plain") == plain_order


def test_the_free_placements_of_a_profile_come_first_and_smaller_profiles_before_larger() -> None:
    occupied = [Placement("1g.5gb", 6, 1)]
    order = ranked(A100, occupied)
    assert sorted(str(r.placement) for r in order) == sorted(str(p) for p in placements(A100))
    sizes = [A100.require_profile(r.placement.profile).size for r in order]
    assert sizes == sorted(sizes)
    for profile in A100.profiles:
        free = [r.free for r in order if r.placement.profile == profile.name]
        assert free == sorted(free, reverse=True)
    assert [r.free for r in plain(A100, occupied) if r.placement.profile == "7g.40gb"] == [False]


@pytest.mark.parametrize(
    ("occupied", "profile", "expected"),
    [
        pytest.param([], "7g.40gb", Fit.FITS, id="empty"),
        pytest.param([("1g.5gb", s) for s in (1, 3, 5)], "3g.20gb", Fit.FRAGMENTED, id="holes-block-3g"),
        pytest.param([("1g.5gb", s) for s in (1, 3, 5)], "2g.10gb", Fit.FRAGMENTED, id="holes-block-2g"),
        pytest.param([("1g.5gb", s) for s in (1, 3, 5)], "1g.10gb", Fit.FITS, id="1g-10gb-at-6"),
        pytest.param([("1g.5gb", s) for s in range(7)], "1g.5gb", Fit.FULL, id="full"),
        pytest.param([("3g.20gb", 0), ("3g.20gb", 4)], "1g.5gb", Fit.FULL, id="no-slice-left"),
        pytest.param([("1g.5gb+me", 0)], "1g.5gb+me", Fit.FULL, id="one-me-per-gpu"),
    ],
)
def test_fragmentation_is_free_memory_and_compute_without_a_placement(
    occupied: list[tuple[str, int]], profile: str, expected: Fit
) -> None:
    taken = [Placement(p, s, A100.require_profile(p).size) for p, s in occupied]
    assert fit(A100, taken, profile) is expected
    assert (profile in fragmented(A100, taken)) is (expected is Fit.FRAGMENTED)


def test_an_allocated_on_demand_device_holds_its_instance_or_the_whole_gpu_until_it_is_made() -> None:
    made = GpuInstance(1, "1g.5gb", 6, 1, (ComputeInstance(0, MigUuid("MIG-a")),))
    other = GpuInstance(2, "3g.20gb", 0, 4, (ComputeInstance(0, MigUuid("MIG-b")),))
    node = node_of(gpu(0, A100, (made, other)))
    assert held_by("gpu-0-mig-1g-5gb-at-6", node) == {"GPU-0", "MIG-a"}
    assert held_by("gpu-0-mig-2g-10gb-at-4", node) == {"GPU-0", "MIG-a", "MIG-b"}
    assert held_by("gpu-0-mig-1", node) is None  # a static device's name: not ours to resolve
    assert held_by("gpu-5-mig-1g-5gb-at-0", node) == frozenset()


def test_every_instance_withdraws_what_it_overlaps_but_its_own_device() -> None:
    """A claim prepared here and released before its unprepare keeps its instance: its own device stays
    (it may still be allocated, and the scheduler counts it only while listed), what overlaps it goes,
    so no claim is allocated a placement that cannot be made until the instance is gone."""
    product = CATALOG.product("A100-SXM4-40GB")
    made = whole(1, "2g.10gb", 4, 2, 2)
    node = node_of(gpu(0, product, (made,)))
    specs = partitionable_slices("n", node, {"GPU-0"}, CATALOG, prepared=["gpu-0-mig-2g-10gb-at-4"],
                                 whole_gpu=True, held={("GPU-0", "2g.10gb", 4)})  # fmt: skip
    names = {d.name for s in specs for d in s.devices}
    assert "gpu-0-mig-2g-10gb-at-4" in names
    assert [] == sorted(n for n in names if overlapping(n, 4, 2) and n != "gpu-0-mig-2g-10gb-at-4")
    assert "gpu-0" not in names
    assert {"gpu-0-mig-1g-5gb-at-0", "gpu-0-mig-3g-20gb-at-0", "gpu-0-mig-1g-5gb-at-6"} <= names
