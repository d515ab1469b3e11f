"""The pure half of the workload-trace bench: traces (drawn from a seed or read from a CSV file), the
static layouts, an offline replay, the largest profile still placeable, the stranded share and the
statistics. No I/O but reading a trace file, deterministic by seed.

A trace is a stream of pods, each asking for one MIG profile or a whole GPU (`WHOLE`): an arrival,
a lifetime (counted from when the pod gets its slice) and a patience (how long it waits for a slice
before its owner gives up). Times are in trace seconds; the real run (``trace``) replays a number of
trace seconds per real second. A drawn trace has Poisson arrivals and exponential lifetimes; its mix
of profiles is steady or, with `shifting`, changes between phases (1g-heavy, then 3g/7g-heavy, then
mixed), as a cluster's work does over a day.

The GPUs are a sequence of products, one per GPU (`parse_gpus`: `A100-SXM4-40GB:2,H100-80GB-HBM3:2`);
a pod's profile is served by the GPUs whose product has it.

The offline replay (on-demand ways: the agent's placement policy, `sharing.mig.policy`, or plain
order) serves two purposes: choosing the best static layout (every combination over the GPUs of the
maximal single-GPU layouts the catalog's placements allow, `node_layouts`), and a prediction printed
beside what the real kube-scheduler did. The real figures are the scheduler's, never these.

Yardsticks (`summarize`): pods served; compute-slice-seconds served (a pod's compute slices x its
lifetime, summed over the served pods: the work a way let run) and the share of what the trace
offered; the wait per profile; the largest profile placeable over time; and the stranded share, the
fragmentation measure of FGD (Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads
with Fragmentation Gradient Descent", USENIX ATC 2023): at each sample with a pod waiting, the free
memory slices of the GPUs that no waiting pod's profile could use at that moment, over all slices.
"""

from __future__ import annotations

import csv
import functools
import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sharing.config.spec import MigMode, MigStrategy, SharingConfig
from sharing.mig import Catalog, policy
from sharing.mig.catalog import Product
from sharing.mig.plan import Placement, Plan, plan_gpu

WHOLE = "gpu"
"""The profile of a pod that asks for a whole GPU (`nvidia.com/gpu`)."""

Gpus = tuple[Product, ...]
"""The product of each GPU, by index."""

Mix = tuple[tuple[str, float], ...]
"""Compute-slice classes (`1g`, `2g`, ...) and their weights; `resolve` names each class's profile
on a product."""

DEFAULT_MIX: Mix = (("1g", 0.45), ("2g", 0.25), ("3g", 0.2), ("7g", 0.1))
SHIFTING: tuple[tuple[str, Mix], ...] = (
    ("1g-heavy", (("1g", 0.7), ("2g", 0.2), ("3g", 0.1))),
    ("3g/7g-heavy", (("1g", 0.1), ("3g", 0.5), ("7g", 0.4))),
    ("mixed", DEFAULT_MIX),
)
"""The phases of a shifting mix, each over an equal share of the trace's pods."""


def parse_gpus(text: str, catalog: Catalog) -> Gpus:
    """`PRODUCT:N[,PRODUCT:N]` (catalog or NVML names) as one product per GPU; ValueError naming
    what is wrong."""
    gpus: list[Product] = []
    for part in text.split(","):
        name, _, count = part.strip().rpartition(":")
        if not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--gpus: {part.strip()!r} is not PRODUCT:N with N >= 1")
        product = catalog.find(name)
        if product is None or not product.profiles:
            raise ValueError(f"--gpus: {name!r} is no MIG-capable GPU of the catalog")
        gpus += [product] * int(count)
    return tuple(gpus)


def resolve(kind: str, product: Product) -> str:
    """The profile of compute-slice class `kind` (`3g`) on `product`: the one of that many compute
    slices with the least memory and no extra engines (`3g.20gb` on an A100-SXM4-40GB)."""
    slices = int(kind.removesuffix("g"))
    found = [p for p in product.profiles if p.compute_slices == slices and "+" not in p.name]
    if not found:
        raise ValueError(f"{product.name} has no {kind} profile")
    return min(found, key=lambda p: (p.size, p.memory_mib)).name


PATIENCE = 20.0
"""How long a pod waits for a slice before it is withdrawn, unless its trace says otherwise."""


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """What a trace is drawn from. Times in trace seconds."""

    seed: int
    pods: int = 120
    phases: tuple[tuple[str, Mix], ...] = (("steady", DEFAULT_MIX),)
    arrival_rate: float = 0.5
    """Mean arrivals per second (Poisson)."""
    mean_lifetime: float = 30.0
    """Mean of the exponential lifetime, counted from when a pod gets its slice."""
    patience: float = PATIENCE
    """How long a pod waits for a slice before it is withdrawn (not served)."""

    @classmethod
    def shifting(cls, seed: int, pods: int = 120) -> TraceSpec:
        return cls(seed, pods, SHIFTING)

    @property
    def kind(self) -> str:
        return "shift" if len(self.phases) > 1 else "steady"

    def describe(self) -> str:
        phases = "; ".join(
            f"{name} ({', '.join(f'{k} {w:.0%}' for k, w in mix)})" for name, mix in self.phases
        )
        return (
            f"seed {self.seed}: {self.pods} pods, mix {phases}; Poisson arrivals {self.arrival_rate}/s, "
            f"exponential lifetime mean {self.mean_lifetime} s, patience {self.patience} s"
        )


@dataclass(frozen=True, slots=True)
class TracePod:
    index: int
    arrival: float
    profile: str
    lifetime: float
    patience: float

    @property
    def name(self) -> str:
        return f"pod-{self.index:04d}"


def generate(spec: TraceSpec, product: Product) -> tuple[TracePod, ...]:
    """The trace of `spec`, its profiles named on `product`: the same seed gives the same pods. The
    pods are split in equal runs over the phases, in order."""
    rng = random.Random(spec.seed)
    now = 0.0
    pods = []
    for index in range(spec.pods):
        _, mix = spec.phases[index * len(spec.phases) // spec.pods]
        names = [resolve(kind, product) for kind, _ in mix]
        now += rng.expovariate(spec.arrival_rate)
        profile = rng.choices(names, [w for _, w in mix])[0]
        lifetime = max(1.0, rng.expovariate(1 / spec.mean_lifetime))
        pods.append(TracePod(index, round(now, 3), profile, round(lifetime, 3), spec.patience))
    return tuple(pods)


COLUMNS = ("arrival", "lifetime", "profile", "patience")
"""A trace file's columns; `patience` may be left out (then every pod has the default)."""


class TraceFileError(ValueError):
    """A trace file that cannot be replayed: the message names the file, line and column."""


def read_trace(path: Path, gpus: Gpus, patience: float = PATIENCE) -> tuple[TracePod, ...]:
    """The pods of a CSV trace file (header `arrival,lifetime,profile[,patience]`, seconds), in
    arrival order. Every row is checked before anything runs: a number that is not one (or negative,
    or a lifetime of 0), a profile none of `gpus` has, a row with too few or too many fields."""
    try:
        with path.open(newline="") as stream:
            rows = list(csv.reader(stream))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise TraceFileError(f"{path}: cannot be read: {err}") from None
    numbered = [(n, row) for n, row in enumerate(rows, 1) if any(cell.strip() for cell in row)]
    if not numbered:
        raise TraceFileError(
            f"{path}: empty; the first line is the header {','.join(COLUMNS[:3])}[,patience]"
        )
    line, header = numbered[0]
    names = [cell.strip() for cell in header]
    for column, name in enumerate(names, 1):
        if name not in COLUMNS or names.index(name) != column - 1:
            raise TraceFileError(
                f"{path}:{line}: column {column}: {name!r} is not one of {', '.join(COLUMNS)} (once each)"
            )
    missing = [c for c in COLUMNS[:3] if c not in names]
    if missing:
        raise TraceFileError(f"{path}:{line}: the header lacks {', '.join(missing)}")
    offered = {p.name for product in gpus for p in product.profiles} | {WHOLE}
    pods: list[tuple[float, int, str, float, float]] = []
    for line, row in numbered[1:]:
        if len(row) != len(names):
            raise TraceFileError(f"{path}:{line}: {len(row)} fields, the header has {len(names)}")
        cells = {
            name: (column, cell.strip())
            for column, (name, cell) in enumerate(zip(names, row, strict=True), 1)
        }

        def number(name: str, least: float, above: bool = False) -> float:
            column, cell = cells[name]  # noqa: B023 (used at once, in this iteration)
            try:
                value = float(cell)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < least or (above and value == least):
                bound = f"above {least:g}" if above else f"at least {least:g}"
                raise TraceFileError(
                    f"{path}:{line}: column {column} ({name}): {cell!r} is not a number {bound}"  # noqa: B023
                )
            return value

        arrival, lifetime = number("arrival", 0), number("lifetime", 0, above=True)
        column, profile = cells["profile"]
        if profile not in offered:
            products = ", ".join(sorted({p.name for p in gpus}))
            raise TraceFileError(
                f"{path}:{line}: column {column} (profile): no GPU here ({products}) has a profile "
                f"{profile!r}; use a MIG profile name or {WHOLE!r} for a whole GPU"
            )
        waits = number("patience", 0) if "patience" in cells and cells["patience"][1] else patience
        pods.append((arrival, len(pods), profile, lifetime, waits))
    if not pods:
        raise TraceFileError(f"{path}: no rows after the header")
    return tuple(
        TracePod(index, arrival, profile, lifetime, waits)
        for index, (arrival, _, profile, lifetime, waits) in enumerate(sorted(pods))
    )


def write_trace(pods: Iterable[TracePod], path: Path) -> None:
    """`pods` as a trace file `read_trace` reads back."""
    with path.open("w", newline="") as stream:
        out = csv.writer(stream)
        out.writerow(COLUMNS)
        out.writerows((p.arrival, p.lifetime, p.profile, p.patience) for p in pods)


def mix_counts(pods: Iterable[TracePod]) -> dict[str, int]:
    return dict(sorted(Counter(p.profile for p in pods).items()))


# --- profiles on the GPUs --------------------------------------------------------------------------


def has(product: Product, profile: str) -> bool:
    return profile == WHOLE or product.profile(profile) is not None


def size_on(product: Product, profile: str) -> int:
    """Memory slices (placement slots) `profile` takes on `product`: all of them for a whole GPU."""
    return product.slots if profile == WHOLE else product.require_profile(profile).size


def compute_slices(gpus: Gpus, profile: str) -> int:
    """A pod's compute slices: its profile's (the `<G>` of `<G>g.<GB>gb`), a whole GPU's all."""
    if profile == WHOLE:
        return max(p.compute_slices for p in gpus)
    return next(p.require_profile(profile).compute_slices for p in gpus if has(p, profile))


# --- placements ------------------------------------------------------------------------------------


def mask(start: int, size: int) -> int:
    """The slots `size` wide from `start`, as a bit mask."""
    return ((1 << size) - 1) << start


def free_placements(product: Product, profile: str, occupied: int) -> tuple[int, ...]:
    """The starts of `profile` that overlap nothing in the `occupied` slot mask, in placement order
    (a whole GPU: start 0 when nothing is used)."""
    if profile == WHOLE:
        return (0,) if not occupied else ()
    kind = product.require_profile(profile)
    return tuple(s for s in kind.placements if not mask(s, kind.size) & occupied)


def largest_placeable(gpus: Gpus, occupied: Sequence[int], profiles: Iterable[str]) -> int:
    """Compute slices of the largest of `profiles` that has a free placement on some GPU, `occupied`
    being each GPU's mask of used slots; 0 when none fits anywhere."""
    return max(
        (
            compute_slices(gpus, profile)
            for profile in profiles
            for product, used in zip(gpus, occupied, strict=True)
            if has(product, profile) and free_placements(product, profile, used)
        ),
        default=0,
    )


def largest_free_count(free: Mapping[str, int], gpus: Gpus) -> int:
    """Static layouts: compute slices of the largest profile with a free pre-made instance (0: none)."""
    return max((compute_slices(gpus, p) for p, n in free.items() if n > 0), default=0)


def stranded_ondemand(gpus: Gpus, occupied: Sequence[int], waiting: Iterable[str]) -> int:
    """Free slots that no placement of a waiting profile could use, over the GPUs."""
    waiting = set(waiting)
    stranded = 0
    for product, used in zip(gpus, occupied, strict=True):
        usable = 0
        for profile in waiting:
            if has(product, profile):
                size = size_on(product, profile)
                for start in free_placements(product, profile, used):
                    usable |= mask(start, size)
        stranded += bin(mask(0, product.slots) & ~used & ~usable).count("1")
    return stranded


def stranded_static(
    gpus: Gpus, layout: Mapping[str, int], free: Mapping[str, int], waiting: Iterable[str]
) -> int:
    """Slots of pre-made instances that are free and that no waiting pod asks for, plus the slots the
    layout leaves without an instance (nothing can ever use them)."""
    waiting = set(waiting)
    idle = sum(n * size_of(gpus, p) for p, n in free.items() if n > 0 and p not in waiting)
    return idle + unused_slots(gpus, layout)


def size_of(gpus: Gpus, profile: str) -> int:
    return next(size_on(p, profile) for p in gpus if has(p, profile))


def unused_slots(gpus: Gpus, layout: Mapping[str, int]) -> int:
    """Slots of the GPUs that a static layout gives no instance (time-sliced replicas of a GPU
    count as one GPU)."""
    whole = min(layout.get(WHOLE, 0), len(gpus)) * max(p.slots for p in gpus)
    mig = sum(n * size_of(gpus, p) for p, n in layout.items() if p != WHOLE)
    return max(0, sum(p.slots for p in gpus) - whole - mig)


def choose(
    gpus: Gpus,
    way: str,
    placed: Sequence[Sequence[Placement]],
    profile: str,
    rng: random.Random | None = None,
) -> tuple[int, int] | None:
    """(GPU, start) the scheduler's first fit takes for `profile` when each GPU lists its devices in
    the agent's policy order (`policy.ranked`), in plain order (`policy.plain`) or, for `random`, in
    an order drawn from `rng` (a yardstick: what placement alone is worth), GPUs in index order; for
    `bestfit`, the GPU too is chosen (`best_fit`, a yardstick: what choosing the GPU is worth);
    `placed` holds each GPU's placements in use. A whole GPU is its GPU with nothing placed (the
    agent lists it first). None when no GPU has a free placement."""
    if way == "bestfit" and profile != WHOLE:
        return best_fit(gpus, placed, profile)
    order = policy.ranked if way == "policy" else policy.plain
    for gpu, (product, held) in enumerate(zip(gpus, placed, strict=True)):
        if not has(product, profile):
            continue
        if profile == WHOLE:
            if not held:
                return gpu, 0
            continue
        if any(p.profile == WHOLE for p in held):
            continue
        free = [e.placement.start for e in order(product, held) if e.free and e.placement.profile == profile]
        if free:
            return gpu, (rng.choice(free) if way == "random" and rng is not None else free[0])
    return None


def best_fit(gpus: Gpus, placed: Sequence[Sequence[Placement]], profile: str) -> tuple[int, int] | None:
    """(GPU, start) for `profile` chosen across the GPUs: the free placement after which the node can
    still add the most instances of each larger placement size (compared from the largest down), GPUs
    with nothing placed last (whole-GPU and 7g pods need them), then the GPU's own policy order and
    its index. None when no GPU has a free placement."""
    best: tuple[tuple[object, ...], tuple[int, int]] | None = None
    for gpu, (product, held) in enumerate(zip(gpus, placed, strict=True)):
        if not has(product, profile) or any(p.profile == WHOLE for p in held):
            continue
        occupied = tuple(sorted(set(held)))
        ranked = [e.placement for e in policy.ranked(product, occupied) if e.free]
        for position, spot in enumerate(p for p in ranked if p.profile == profile):
            key = (not occupied, _loss(product, occupied, spot), position, gpu)
            if best is None or key < best[0]:
                best = (key, (gpu, spot.start))
    return None if best is None else best[1]


def _loss(product: Product, occupied: tuple[Placement, ...], spot: Placement) -> tuple[int, ...]:
    """How many fewer instances of each larger placement size the GPU can add once `spot` is taken."""
    before = _addable_by_size(product, occupied, spot.size)
    after = _addable_by_size(product, tuple(sorted((*occupied, spot))), spot.size)
    return tuple(b - a for b, a in zip(before, after, strict=True))


@functools.lru_cache(maxsize=8192)
def _addable_by_size(product: Product, occupied: tuple[Placement, ...], above: int) -> tuple[int, ...]:
    sizes = sorted({p.size for p in product.profiles if p.size > above}, reverse=True)
    return tuple(
        sum(policy.addable(product, occupied, p.name) for p in product.profiles if p.size == size)
        for size in sizes
    )


# --- static layouts --------------------------------------------------------------------------------


Layout = tuple[tuple[str, int], ...]
"""A static GPU layout: (profile, count) pairs, sorted, counts > 0."""


def gpu_layouts(product: Product, profiles: Sequence[str]) -> tuple[Layout, ...]:
    """Every maximal layout of one GPU in `profiles` that the catalog's placements allow (no further
    instance of any of the profiles could be added), by the exact planner; a whole GPU (MIG off) when
    `WHOLE` is among them."""
    names = [p for p in profiles if p != WHOLE and product.profile(p) is not None]
    kinds = [product.require_profile(p) for p in names]
    ranges = [range(k.max_count + 1) for k in kinds]
    feasible: set[tuple[int, ...]] = set()
    for counts in itertools.product(*ranges):
        if sum(counts) and isinstance(plan_gpu(product, (), dict(zip(names, counts, strict=True))), Plan):
            feasible.add(counts)
    maximal = [
        c for c in feasible if not any((*c[:i], c[i] + 1, *c[i + 1 :]) in feasible for i in range(len(c)))
    ]
    found = sorted(tuple((p, n) for p, n in zip(names, c, strict=True) if n) for c in maximal)
    return (*found, ((WHOLE, 1),)) if WHOLE in profiles else tuple(found)


def node_layouts(gpus: Gpus, profiles: Sequence[str]) -> tuple[tuple[Layout, ...], ...]:
    """Every combination over the GPUs of maximal GPU layouts (with repetition among GPUs of one
    product; GPUs of a product in index order)."""
    groups = [(product, sum(1 for g in gpus if g == product)) for product in dict.fromkeys(gpus)]
    per_group = [
        list(itertools.combinations_with_replacement(gpu_layouts(product, profiles), n))
        for product, n in groups
    ]
    return tuple(tuple(itertools.chain.from_iterable(choice)) for choice in itertools.product(*per_group))


def node_counts(layouts: Iterable[Layout]) -> dict[str, int]:
    """What a device plugin advertises for these GPU layouts: instances per profile."""
    total: Counter[str] = Counter()
    for layout in layouts:
        for profile, n in layout:
            total[profile] += n
    return dict(sorted(total.items()))


def show_layouts(layouts: Iterable[Layout]) -> str:
    return " | ".join("+".join(f"{n}x{p}" for p, n in layout) for layout in layouts)


# --- the offline replay ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one pod: when it got a slice (None: withdrawn after its patience)."""

    pod: TracePod
    placed_at: float | None

    @property
    def wait(self) -> float | None:
        return None if self.placed_at is None else self.placed_at - self.pod.arrival


@dataclass(frozen=True, slots=True)
class Samples:
    """What a way looked like once a second: the compute slices of the largest placeable profile
    (0: none), and, at the samples with a pod waiting, the share of all slots that was stranded."""

    largest: tuple[int, ...] = ()
    stranded: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Summary:
    served: int
    served_g: int
    """Compute slices of the served pods (a 7g.40gb pod counts 7)."""
    withdrawn: int
    wait_mean: float
    wait_p95: float
    largest_mean_g: float
    """Mean over the samples of the compute slices of the largest placeable profile (0: none)."""
    largest_7g_share: float
    """Share of the samples in which the biggest profile of the mix was still placeable."""
    slice_seconds: float = 0.0
    """Compute slices x lifetime, summed over the served pods."""
    offered_slice_seconds: float = 0.0
    """The same over every pod of the trace."""
    stranded_share: float = math.nan
    """Mean stranded share over the samples with a pod waiting (NaN: no pod ever waited)."""
    waits: tuple[tuple[str, float, float, int, int], ...] = ()
    """Per profile: (profile, wait mean, wait p95, served, pods)."""

    @property
    def slice_share(self) -> float:
        return self.slice_seconds / self.offered_slice_seconds if self.offered_slice_seconds else math.nan

    def show_waits(self) -> str:
        return ", ".join(
            f"{p} {served}/{pods} wait {mean:.1f}/{p95:.1f}" if served else f"{p} 0/{pods}"
            for p, mean, p95, served, pods in self.waits
        )


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no samples."""
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(outcomes: Iterable[Outcome], samples: Samples, biggest_g: int, gpus: Gpus) -> Summary:
    """Pods served and withdrawn, waits (all, and per profile), compute-slice-seconds served and
    offered, and the samples' means."""
    outcomes = list(outcomes)
    served = [o for o in outcomes if o.wait is not None]
    waits = [o.wait for o in served if o.wait is not None]

    def work(of: Iterable[Outcome]) -> float:
        return sum(compute_slices(gpus, o.pod.profile) * o.pod.lifetime for o in of)

    per_profile = []
    for profile in sorted({o.pod.profile for o in outcomes}):
        mine = [o.wait for o in served if o.pod.profile == profile and o.wait is not None]
        pods = sum(1 for o in outcomes if o.pod.profile == profile)
        per_profile.append((profile, _mean(mine), percentile(mine, 95), len(mine), pods))
    largest = samples.largest
    return Summary(
        served=len(served),
        served_g=sum(compute_slices(gpus, o.pod.profile) for o in served),
        withdrawn=len(outcomes) - len(served),
        wait_mean=_mean(waits),
        wait_p95=percentile(waits, 95),
        largest_mean_g=_mean(largest),
        largest_7g_share=sum(1 for g in largest if g >= biggest_g) / len(largest) if largest else math.nan,
        slice_seconds=round(work(served), 3),
        offered_slice_seconds=round(work(outcomes), 3),
        stranded_share=_mean(samples.stranded),
        waits=tuple(per_profile),
    )


def timeline(samples: Sequence[int], every: int = 10) -> str:
    """The largest placeable profile over time as one digit (compute slices; 0: none) per `every`
    samples: the smallest in each window, so a moment with nothing large left shows."""
    return "".join(str(min(samples[i : i + every])) for i in range(0, len(samples), every))


Way = Literal["static", "policy", "plain", "random", "bestfit"]


@dataclass
class Replay:
    """A discrete-event replay of a trace on `gpus`: pods wait in arrival order and any pod that
    fits is placed at once (what a scheduler retrying pending pods on every change does)."""

    gpus: Gpus
    way: Way
    static: Mapping[str, int] = field(default_factory=dict)
    sample_every: float = 1.0
    seed: int = 0
    """Draws the `random` way's placements."""
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def run(self, pods: Sequence[TracePod]) -> tuple[list[Outcome], Samples]:
        gpus, profiles = self.gpus, sorted({p.profile for p in pods})
        occupied = [0] * len(gpus)
        placed_on: list[list[Placement]] = [[] for _ in gpus]
        free = dict(self.static)
        events: list[tuple[float, int, int, int]] = []  # (time, order, kind, pod): 0 leave, 1 arrive
        seq = itertools.count()
        for pod in pods:
            heapq.heappush(events, (pod.arrival, next(seq), 1, pod.index))
        held: dict[int, tuple[int, int]] = {}
        waiting: list[TracePod] = []
        placed: dict[int, float] = {}
        largest: list[int] = []
        stranded: list[float] = []
        next_sample = 0.0
        end = max((p.arrival for p in pods), default=0.0)

        def place(pod: TracePod, now: float) -> bool:
            if self.way == "static":
                if free.get(pod.profile, 0) <= 0:
                    return False
                free[pod.profile] -= 1
                held[pod.index] = (-1, 0)
            else:
                spot = choose(gpus, self.way, placed_on, pod.profile, self.rng)
                if spot is None:
                    return False
                size = size_on(gpus[spot[0]], pod.profile)
                occupied[spot[0]] |= mask(spot[1], size)
                placed_on[spot[0]].append(Placement(pod.profile, spot[1], size))
                held[pod.index] = spot
            placed[pod.index] = now
            heapq.heappush(events, (now + pod.lifetime, next(seq), 0, pod.index))
            return True

        while events:
            now, _, kind, index = heapq.heappop(events)
            while next_sample <= min(now, end):
                top, lost = sample(
                    gpus, profiles, (w.profile for w in waiting), occupied=occupied,
                    static=self.static if self.way == "static" else None, free=free,
                )  # fmt: skip
                largest.append(top)
                if lost is not None:
                    stranded.append(lost)
                next_sample += self.sample_every
            pod = pods[index]
            if kind == 0:
                gpu, start = held.pop(index)
                if self.way == "static":
                    free[pod.profile] += 1
                else:
                    size = size_on(gpus[gpu], pod.profile)
                    occupied[gpu] &= ~mask(start, size)
                    placed_on[gpu].remove(Placement(pod.profile, start, size))
            else:
                waiting.append(pod)
            waiting = [w for w in waiting if w.arrival + w.patience >= now]
            waiting = [w for w in waiting if not place(w, now)]
        outcomes = [Outcome(p, placed.get(p.index)) for p in pods]
        return outcomes, Samples(tuple(largest), tuple(stranded))


def sample(
    gpus: Gpus,
    profiles: Iterable[str],
    waiting: Iterable[str],
    *,
    occupied: Sequence[int] = (),
    static: Mapping[str, int] | None = None,
    free: Mapping[str, int] | None = None,
) -> tuple[int, float | None]:
    """One sample of a way: compute slices of the largest of the trace's `profiles` placeable now
    (a static layout `static`: the largest of its `free` instances; on demand: with the `occupied`
    slots of each GPU), and the share of all slots stranded given the `waiting` pods' profiles (None
    when none waits)."""
    wanted = set(waiting)
    if static is not None:
        free = free if free is not None else static
        top = largest_free_count(free, gpus)
        lost = stranded_static(gpus, static, free, wanted) if wanted else 0
    else:
        top = largest_placeable(gpus, occupied, profiles)
        lost = stranded_ondemand(gpus, occupied, wanted) if wanted else 0
    return top, lost / sum(p.slots for p in gpus) if wanted else None


def biggest_g(gpus: Gpus, pods: Iterable[TracePod]) -> int:
    """Compute slices of the largest profile the trace asks for."""
    return max((compute_slices(gpus, p.profile) for p in pods), default=0)


def replay(
    gpus: Gpus, way: Way, pods: Sequence[TracePod], static: Mapping[str, int] | None = None
) -> Summary:
    outcomes, samples = Replay(gpus, way, static or {}).run(pods)
    return summarize(outcomes, samples, biggest_g(gpus, pods), gpus)


def better(summary: Summary) -> tuple[float, int, float]:
    """The order ways and layouts are ranked in: the most compute-slice-seconds served, then the
    most pods, then the lowest mean wait (a key: lower is better)."""
    wait = summary.wait_mean if not math.isnan(summary.wait_mean) else math.inf
    return (-summary.slice_seconds, -summary.served, wait)


@dataclass(frozen=True, slots=True)
class VsPlain:
    """One on-demand way over plain order, across seeds: pods served and compute-slice-seconds."""

    mean: float
    worst: float
    losing: int
    """Seeds on which it served fewer pods than plain order."""
    slice_mean: float = 1.0
    slice_worst: float = 1.0
    slice_losing: int = 0
    """Seeds on which it served fewer compute-slice-seconds than plain order."""


def vs_plain(gpus: Gpus, way: Way, specs: Sequence[TraceSpec]) -> VsPlain:
    """`way` against plain order in the offline replay, over the traces of `specs`."""
    served, work = [], []
    for spec in specs:
        pods = generate(spec, gpus[0])
        plain = replay(gpus, "plain", pods)
        outcomes, samples = Replay(gpus, way, seed=spec.seed).run(pods)
        mine = summarize(outcomes, samples, biggest_g(gpus, pods), gpus)
        served.append(mine.served / max(1, plain.served))
        work.append(mine.slice_seconds / max(1e-9, plain.slice_seconds))
    return VsPlain(
        _mean(served), min(served), sum(1 for r in served if r < 1),
        _mean(work), min(work), sum(1 for r in work if r < 1),
    )  # fmt: skip


def best_static(gpus: Gpus, pods: Sequence[TracePod]) -> tuple[tuple[Layout, ...], Summary, int]:
    """The static layout of the GPUs that ranks first (`better`) in the offline replay of the trace
    (ties: the first in order); with its summary and how many were tried."""
    profiles = sorted({p.profile for p in pods})
    candidates = node_layouts(gpus, profiles)
    best: tuple[tuple[float, int, float], tuple[Layout, ...], Summary] | None = None
    for layouts in candidates:
        summary = replay(gpus, "static", pods, node_counts(layouts))
        if best is None or better(summary) < best[0]:
            best = (better(summary), layouts, summary)
    if best is None:
        raise ValueError(f"no static layout of {', '.join(profiles)} fits the GPUs")
    return best[1], best[2], len(candidates)


# --- shipped presets -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Preset:
    """A shipped preset (profiles/<name>.yaml) on a node: the extended resources its device plugin
    advertises (`nvidia.com/mig-<profile>` per MIG instance with the mixed strategy, `nvidia.com/gpu`
    per whole GPU or time-sliced replica)."""

    name: str
    resources: Mapping[str, int]

    @property
    def counts(self) -> dict[str, int]:
        """What a trace pod can get, by its profile: pre-made MIG instances per profile, and `WHOLE`
        for `nvidia.com/gpu` (a time-sliced replica counts as a GPU, as the scheduler sees it: that
        favours the preset). A whole GPU serves no pod that asks for a MIG profile."""
        prefix = "nvidia.com/mig-"
        out = {k.removeprefix(prefix): n for k, n in sorted(self.resources.items()) if k.startswith(prefix)}
        if self.resources.get("nvidia.com/gpu"):
            out[WHOLE] = self.resources["nvidia.com/gpu"]
        return out

    def show(self) -> str:
        return ", ".join(f"{n}x {k}" for k, n in sorted(self.resources.items())) or "nothing"


def preset_on(config: SharingConfig, gpus: Gpus) -> Preset:
    """What the device plugin advertises under `config` on `gpus` with no instances yet (each GPU
    matched by its index and catalog name, as the agent does): a MIG rule's instances per profile, a
    rule with MIG off its GPU whole (times its replicas). A rule with MIG on and no instances, or no
    rule, advertises nothing for that GPU."""
    total: Counter[str] = Counter()
    for index, product in enumerate(gpus):
        rule = config.rule_for(index, product.name)
        if rule is None or rule.mig in (MigMode.UNCHANGED, MigMode.DYNAMIC):
            continue
        if rule.rename or config.rename_by_default:
            raise ValueError(f"preset {config.name}: renamed resources are not modelled by the trace bench")
        if rule.mig is MigMode.DISABLED:
            total["nvidia.com/gpu"] += rule.replicas.for_kind("gpu")
            continue
        if config.mig_strategy is not MigStrategy.MIXED:
            raise ValueError(
                f"preset {config.name}: only the mixed MIG strategy is modelled by the trace bench"
            )
        for profile, count in rule.instances:
            total[f"nvidia.com/mig-{profile}"] += count * rule.replicas.for_kind(profile)
    return Preset(config.name, dict(sorted(total.items())))


def best_preset(gpus: Gpus, pods: Sequence[TracePod], presets: Iterable[Preset]) -> tuple[Preset, Summary]:
    """The preset that ranks first (`better`) in the offline replay of the trace (ties: the first by
    name), with its summary. Pods asking for a profile the preset lacks wait and are withdrawn, as on
    a real node."""
    best: tuple[tuple[float, int, float, str], Preset, Summary] | None = None
    for preset in presets:
        summary = replay(gpus, "static", pods, preset.counts)
        key = (*better(summary), preset.name)
        if best is None or key < best[0]:
            best = (key, preset, summary)
    if best is None:
        raise ValueError("no presets to choose from")
    return best[1], best[2]


def merge_same(presets: Iterable[Preset]) -> tuple[Preset, ...]:
    """Presets that advertise the same resources as one, named `a=b` (names sorted), by name."""
    names: dict[tuple[tuple[str, int], ...], list[str]] = {}
    for preset in presets:
        names.setdefault(tuple(sorted(preset.resources.items())), []).append(preset.name)
    merged = [Preset("=".join(sorted(n)), dict(k)) for k, n in names.items()]
    return tuple(sorted(merged, key=lambda p: p.name))
