"""The pure half of the workload-trace bench: the seeded trace, the static layouts, an offline replay,
the largest profile still placeable, and the statistics. No I/O, deterministic by seed.

A trace is a stream of pods, each asking for one MIG profile: Poisson arrivals, exponential lifetimes,
a fixed patience (how long a pod waits for a slice before its owner gives up). Times are in simulated
units; the real run (``trace``) maps one unit to a short real interval.

The offline replay (on-demand ways: the agent's placement policy, `sharing.mig.policy`, or plain
order) serves two purposes: choosing the best static layout (every combination over the
GPUs of the maximal single-GPU layouts the catalog's placements allow, `layouts`), and a prediction
printed beside what the real kube-scheduler did. The real figures are the scheduler's, never these.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sharing.config.spec import MigMode, MigStrategy, SharingConfig
from sharing.mig import policy
from sharing.mig.catalog import Product, Profile
from sharing.mig.plan import Placement, Plan, plan_gpu

DEFAULT_MIX: tuple[tuple[str, float], ...] = (
    ("1g.5gb", 0.45),
    ("2g.10gb", 0.25),
    ("3g.20gb", 0.2),
    ("7g.40gb", 0.1),
)
"""Profiles and their weights (shares of the pods)."""


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """What a trace is drawn from. Times in simulated units."""

    seed: int
    pods: int = 120
    mix: tuple[tuple[str, float], ...] = DEFAULT_MIX
    arrival_rate: float = 0.5
    """Mean arrivals per unit (Poisson)."""
    mean_lifetime: float = 30.0
    """Mean of the exponential lifetime, counted from when a pod gets its slice."""
    patience: float = 20.0
    """How long a pod waits for a slice before it is withdrawn (not served)."""

    def describe(self) -> str:
        mix = ", ".join(f"{p} {w:.0%}" for p, w in self.mix)
        return (
            f"seed {self.seed}: {self.pods} pods, mix {mix}; Poisson arrivals {self.arrival_rate}/unit, "
            f"exponential lifetime mean {self.mean_lifetime} units, patience {self.patience} units"
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


def generate(spec: TraceSpec) -> tuple[TracePod, ...]:
    """The trace of `spec`: the same seed gives the same pods."""
    rng = random.Random(spec.seed)
    names = [p for p, _ in spec.mix]
    weights = [w for _, w in spec.mix]
    now = 0.0
    pods = []
    for index in range(spec.pods):
        now += rng.expovariate(spec.arrival_rate)
        profile = rng.choices(names, weights)[0]
        lifetime = max(1.0, rng.expovariate(1 / spec.mean_lifetime))
        pods.append(TracePod(index, round(now, 3), profile, round(lifetime, 3), spec.patience))
    return tuple(pods)


def mix_counts(pods: Iterable[TracePod]) -> dict[str, int]:
    return dict(sorted(Counter(p.profile for p in pods).items()))


# --- placements ------------------------------------------------------------------------------------


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def free_placements(product: Product, profile: Profile, occupied: int) -> tuple[int, ...]:
    """The starts of `profile` that overlap nothing in the `occupied` slot mask, in placement order."""
    return tuple(s for s in profile.placements if not _mask(s, profile.size) & occupied)


def largest_placeable(product: Product, occupied: Sequence[int], profiles: Iterable[str]) -> Profile | None:
    """The largest of `profiles` (by compute slices, then size) that has a free placement on some GPU,
    `occupied` being each GPU's mask of used slots; None when none fits anywhere."""
    candidates = sorted(
        (product.require_profile(p) for p in profiles),
        key=lambda p: (p.compute_slices, p.size),
        reverse=True,
    )
    for profile in candidates:
        if any(free_placements(product, profile, mask) for mask in occupied):
            return profile
    return None


def largest_free_count(free: Mapping[str, int], product: Product) -> Profile | None:
    """Static layouts: the largest profile with a free pre-made instance; None when none is free."""
    held = [product.require_profile(p) for p, n in free.items() if n > 0]
    return max(held, key=lambda p: (p.compute_slices, p.size), default=None)


def choose(
    product: Product,
    way: str,
    placed: Sequence[Sequence[Placement]],
    profile: str,
    rng: random.Random | None = None,
) -> tuple[int, int] | None:
    """(GPU, start) the scheduler's first fit takes for `profile` when each GPU lists its devices in
    the agent's policy order (`policy.ranked`), in plain order (`policy.plain`) or, for `random`, in
    an order drawn from `rng` (a yardstick: what placement alone is worth), GPUs in index order;
    `placed` holds each GPU's placements in use. None when no GPU has a free placement."""
    order = policy.ranked if way == "policy" else policy.plain
    for gpu, held in enumerate(placed):
        free = [e.placement.start for e in order(product, held) if e.free and e.placement.profile == profile]
        if free:
            return gpu, (rng.choice(free) if way == "random" and rng is not None else free[0])
    return None


# --- static layouts --------------------------------------------------------------------------------


Layout = tuple[tuple[str, int], ...]
"""A static GPU layout: (profile, count) pairs, sorted, counts > 0."""


def gpu_layouts(product: Product, profiles: Sequence[str]) -> tuple[Layout, ...]:
    """Every maximal layout of one GPU in `profiles` that the catalog's placements allow (no further
    instance of any of the profiles could be added), by the exact planner."""
    kinds = [product.require_profile(p) for p in profiles]
    ranges = [range(k.max_count + 1) for k in kinds]
    feasible: set[tuple[int, ...]] = set()
    for counts in itertools.product(*ranges):
        if sum(counts) and isinstance(plan_gpu(product, (), dict(zip(profiles, counts, strict=True))), Plan):
            feasible.add(counts)
    maximal = [
        c for c in feasible if not any((*c[:i], c[i] + 1, *c[i + 1 :]) in feasible for i in range(len(c)))
    ]
    return tuple(sorted(tuple((p, n) for p, n in zip(profiles, c, strict=True) if n) for c in maximal))


def node_layouts(product: Product, profiles: Sequence[str], gpus: int) -> tuple[tuple[Layout, ...], ...]:
    """Every combination (with repetition) of maximal GPU layouts over `gpus` GPUs."""
    return tuple(itertools.combinations_with_replacement(gpu_layouts(product, profiles), gpus))


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


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no samples."""
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def summarize(
    outcomes: Iterable[Outcome], largest: Sequence[int], biggest_g: int, product: Product
) -> Summary:
    """Pods served and withdrawn, wait of the served (mean, p95), and the largest-placeable samples
    (compute slices of the largest placeable profile at each sample, 0 for none)."""
    outcomes = list(outcomes)
    waits = [o.wait for o in outcomes if o.wait is not None]
    return Summary(
        served=len(waits),
        served_g=sum(
            product.require_profile(o.pod.profile).compute_slices for o in outcomes if o.wait is not None
        ),
        withdrawn=len(outcomes) - len(waits),
        wait_mean=sum(waits) / len(waits) if waits else math.nan,
        wait_p95=percentile(waits, 95),
        largest_mean_g=sum(largest) / len(largest) if largest else math.nan,
        largest_7g_share=sum(1 for g in largest if g >= biggest_g) / len(largest) if largest else math.nan,
    )


def timeline(samples: Sequence[int], every: int = 10) -> str:
    """The largest placeable profile over time as one digit (compute slices; 0: none) per `every`
    samples: the smallest in each window, so a moment with nothing large left shows."""
    return "".join(str(min(samples[i : i + every])) for i in range(0, len(samples), every))


Way = Literal["static", "policy", "plain", "random"]


@dataclass
class Replay:
    """A discrete-event replay of a trace on `gpus` GPUs: pods wait in arrival order and any pod
    that fits is placed at once (what a scheduler retrying pending pods on every change does)."""

    product: Product
    gpus: int
    way: Way
    static: Mapping[str, int] = field(default_factory=dict)
    sample_every: float = 1.0
    seed: int = 0
    """Draws the `random` way's placements."""
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def run(self, pods: Sequence[TracePod]) -> tuple[list[Outcome], list[int]]:
        profiles = sorted({p.profile for p in pods})
        kinds = {p: self.product.require_profile(p) for p in profiles}
        occupied = [0] * self.gpus
        placed_on: list[list[Placement]] = [[] for _ in range(self.gpus)]
        free = dict(self.static)
        events: list[tuple[float, int, int, int]] = []  # (time, order, kind, pod): 0 leave, 1 arrive
        seq = itertools.count()
        for pod in pods:
            heapq.heappush(events, (pod.arrival, next(seq), 1, pod.index))
        held: dict[int, tuple[int, int]] = {}
        waiting: list[TracePod] = []
        placed: dict[int, float] = {}
        samples: list[int] = []
        next_sample = 0.0
        end = max((p.arrival for p in pods), default=0.0)

        def place(pod: TracePod, now: float) -> bool:
            kind = kinds[pod.profile]
            if self.way == "static":
                if free.get(pod.profile, 0) <= 0:
                    return False
                free[pod.profile] -= 1
                held[pod.index] = (-1, 0)
            else:
                spot = choose(self.product, self.way, placed_on, pod.profile, self.rng)
                if spot is None:
                    return False
                occupied[spot[0]] |= _mask(spot[1], kind.size)
                placed_on[spot[0]].append(Placement(pod.profile, spot[1], kind.size))
                held[pod.index] = spot
            placed[pod.index] = now
            heapq.heappush(events, (now + pod.lifetime, next(seq), 0, pod.index))
            return True

        def largest_now() -> int:
            if self.way == "static":
                top = largest_free_count(free, self.product)
            else:
                top = largest_placeable(self.product, occupied, profiles)
            return 0 if top is None else top.compute_slices

        while events:
            now, _, kind, index = heapq.heappop(events)
            while next_sample <= min(now, end):
                samples.append(largest_now())
                next_sample += self.sample_every
            pod = pods[index]
            if kind == 0:
                gpu, start = held.pop(index)
                if self.way == "static":
                    free[pod.profile] += 1
                else:
                    occupied[gpu] &= ~_mask(start, kinds[pod.profile].size)
                    placed_on[gpu].remove(Placement(pod.profile, start, kinds[pod.profile].size))
            else:
                waiting.append(pod)
            waiting = [w for w in waiting if w.arrival + w.patience >= now]
            waiting = [w for w in waiting if not place(w, now)]
        return [Outcome(p, placed.get(p.index)) for p in pods], samples


def replay(
    product: Product, gpus: int, way: Way, pods: Sequence[TracePod], static: Mapping[str, int] | None = None
) -> Summary:
    outcomes, samples = Replay(product, gpus, way, static or {}).run(pods)
    biggest = max(product.require_profile(p.profile).compute_slices for p in pods) if pods else 0
    return summarize(outcomes, samples, biggest, product)


@dataclass(frozen=True, slots=True)
class VsPlain:
    """Pods served by one on-demand way over those served in plain order, across seeds."""

    mean: float
    worst: float
    losing: int
    """Seeds on which it served fewer than plain order."""


def vs_plain(product: Product, gpus: int, way: Way, specs: Sequence[TraceSpec]) -> VsPlain:
    """`way` against plain order in the offline replay, over the traces of `specs`."""
    ratios = []
    for spec in specs:
        pods = generate(spec)
        plain = replay(product, gpus, "plain", pods).served
        outcomes, _ = Replay(product, gpus, way, seed=spec.seed).run(pods)
        ratios.append(sum(1 for o in outcomes if o.placed_at is not None) / max(1, plain))
    return VsPlain(sum(ratios) / len(ratios), min(ratios), sum(1 for r in ratios if r < 1))


def best_static(
    product: Product, gpus: int, pods: Sequence[TracePod]
) -> tuple[tuple[Layout, ...], Summary, int]:
    """The static layout of `gpus` GPUs that serves the most pods of the trace in the offline replay
    (ties: lower mean wait, then the first in order); with its summary and how many were tried."""
    profiles = sorted({p.profile for p in pods})
    candidates = node_layouts(product, profiles, gpus)
    best: tuple[tuple[int, float], tuple[Layout, ...], Summary] | None = None
    for layouts in candidates:
        summary = replay(product, gpus, "static", pods, node_counts(layouts))
        wait = summary.wait_mean if not math.isnan(summary.wait_mean) else math.inf
        key = (-summary.served, wait)
        if best is None or key < best[0]:
            best = (key, layouts, summary)
    if best is None:
        raise ValueError(f"no static layout of {', '.join(profiles)} fits {product.name}")
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
    def mig_counts(self) -> dict[str, int]:
        """Pre-made MIG instances per profile: what a pod asking `nvidia.com/mig-<profile>: 1` can get.
        Whole GPUs (`nvidia.com/gpu`) serve none of them: a 7g.40gb pod would have to ask for
        `nvidia.com/gpu` instead, and the trace's pods do not."""
        prefix = "nvidia.com/mig-"
        return {k.removeprefix(prefix): n for k, n in sorted(self.resources.items()) if k.startswith(prefix)}

    def show(self) -> str:
        return ", ".join(f"{n}x {k}" for k, n in sorted(self.resources.items())) or "nothing"


def preset_on(config: SharingConfig, product: Product, gpus: int) -> Preset:
    """What the device plugin advertises under `config` on `gpus` GPUs of `product` with no
    instances yet (each GPU matched by its index and catalog name, as the agent does): a MIG rule's
    instances per profile, a rule with MIG off its GPU whole (times its replicas). A rule with MIG
    on and no instances, or no rule, advertises nothing for that GPU."""
    total: Counter[str] = Counter()
    for index in range(gpus):
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


def best_preset(
    product: Product, gpus: int, pods: Sequence[TracePod], presets: Iterable[Preset]
) -> tuple[Preset, Summary]:
    """The preset that serves the most pods of the trace in the offline replay (ties: lower mean
    wait, then the first by name), with its summary. Pods asking for a profile the preset lacks wait
    and are withdrawn, as on a real node."""
    best: tuple[tuple[int, float, str], Preset, Summary] | None = None
    for preset in presets:
        summary = replay(product, gpus, "static", pods, preset.mig_counts)
        wait = summary.wait_mean if not math.isnan(summary.wait_mean) else math.inf
        key = (-summary.served, wait, preset.name)
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
