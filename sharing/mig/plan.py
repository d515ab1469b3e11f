"""The MIG placement planner: the smallest change that turns a GPU's instances into the wanted set.

Pure. Given a GPU's MIG geometry (what its driver reports, or the catalog's offline), the GPU
instances that exist (each free or busy) and the wanted multiset of profiles, it finds, by exact
search over the valid placements on the GPU's grid of slots, a target layout that keeps every
busy instance where it is and as many free ones as any valid layout allows. It answers with the
instances to keep, destroy and create (in an order that succeeds on hardware), or why it cannot.
mig-parted instead destroys everything and lets the driver pick slots, so feasible mixes can fail.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sharing.mig.catalog import Product, Profile


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """A GPU instance in a layout: its profile and the slots [start, start+size) of the grid."""

    profile: str
    start: int
    size: int

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True, slots=True)
class Existing:
    """A GPU instance that exists now; a busy one has work on it and must not be touched."""

    profile: str
    start: int
    busy: bool = False
    whole: bool = True
    """One MIG device of its profile (one compute instance spanning it, or none yet); False: split
    into smaller compute instances (`1c.3g.20gb`), which is no device of the profile, so it is never
    kept for one (destroyed when free, in the way when busy)."""

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}" + (":busy" if self.busy else "")


class Infeasibility(enum.Enum):
    """Why a wanted layout cannot be planned."""

    UNKNOWN_PROFILE = "unknown-profile"
    TOO_MANY = "too-many"
    OVER_CAPACITY = "over-capacity"
    NO_PLACEMENT = "no-placement"
    BUSY_NOT_WANTED = "busy-not-wanted"
    FRAGMENTED_BY_BUSY = "fragmented-by-busy"


@dataclass(frozen=True, slots=True)
class Plan:
    """A feasible answer. `create` is in execution order; `keep` includes every busy instance."""

    layout: tuple[Placement, ...]
    keep: tuple[Placement, ...]
    destroy: tuple[Placement, ...]
    create: tuple[Placement, ...]

    @property
    def changes(self) -> int:
        """Number of hardware steps: instances destroyed plus instances created."""
        return len(self.destroy) + len(self.create)


@dataclass(frozen=True, slots=True)
class Infeasible:
    """An infeasible answer, with a reason a person can act on."""

    kind: Infeasibility
    reason: str


def plan_gpu(product: Product, existing: Iterable[Existing], want: Mapping[str, int]) -> Plan | Infeasible:
    """Plan the change from `existing` instances to the `want` multiset of profiles on one GPU."""
    existing = tuple(existing)
    wanted = Counter({name: count for name, count in want.items() if count > 0})
    problem = _check_counts(product, existing, wanted)
    if problem is not None:
        return problem
    busy = [e for e in existing if e.busy]
    split = [e for e in busy if not e.whole]
    if split:
        return Infeasible(
            Infeasibility.BUSY_NOT_WANTED,
            f"{split[0]} on {product.name} is in use and split into compute instances smaller than it, "
            f"so it is no {split[0].profile} device; free it first",
        )
    busy_counts = Counter(e.profile for e in busy)
    for name, count in busy_counts.items():
        if count > wanted[name]:
            held = ", ".join(str(e) for e in busy if e.profile == name)
            return Infeasible(
                Infeasibility.BUSY_NOT_WANTED,
                f"{held} on {product.name} is in use and the wanted layout has "
                f"{wanted[name]} {name}; keep it in the config or free it first",
            )
    fixed_mask = 0
    for e in busy:
        span = _mask(e.start, product.require_profile(e.profile).size)
        if fixed_mask & span:
            return Infeasible(Infeasibility.NO_PLACEMENT, f"busy instances overlap at {e} on {product.name}")
        fixed_mask |= span
    free = {(e.profile, e.start) for e in existing if not e.busy and e.whole}
    to_place = _search_order(product, wanted - busy_counts)
    chosen = _best_layout(product, to_place, fixed_mask, free)
    if chosen is None:
        return _why_unplaceable(product, wanted, busy)
    kept_busy = [_placement(product, e.profile, e.start) for e in busy]
    kept_free = [p for p in chosen if (p.profile, p.start) in free]
    kept = {(p.profile, p.start) for p in kept_free}
    return Plan(
        layout=tuple(sorted(kept_busy + list(chosen), key=lambda p: p.start)),
        keep=tuple(sorted(kept_busy + kept_free, key=lambda p: p.start)),
        destroy=tuple(
            sorted(
                (
                    _placement(product, e.profile, e.start)
                    for e in existing
                    if not e.busy and (e.profile, e.start) not in kept
                ),
                key=lambda p: p.start,
            )
        ),
        # Largest first, then by start: with explicit placements any order of a non-overlapping
        # layout succeeds, and largest-first is also the order NVIDIA recommends.
        create=tuple(
            sorted((p for p in chosen if (p.profile, p.start) not in kept), key=lambda p: (-p.size, p.start))
        ),
    )


def _check_counts(
    product: Product, existing: tuple[Existing, ...], wanted: Counter[str]
) -> Infeasible | None:
    for name in list(wanted) + [e.profile for e in existing]:
        if product.profile(name) is None:
            known = ", ".join(p.name for p in product.profiles) or "none known"
            return Infeasible(
                Infeasibility.UNKNOWN_PROFILE,
                f"unknown MIG profile {name!r} on {product.name} (valid: {known})",
            )
    for name, count in wanted.items():
        profile = product.require_profile(name)
        if count > profile.max_count:
            return Infeasible(
                Infeasibility.TOO_MANY,
                f"{count} instances of {name} exceed the maximum of {profile.max_count} on {product.name}",
            )
    profiles = [(product.require_profile(name), count) for name, count in wanted.items()]
    slots = sum(p.size * n for p, n in profiles)
    compute = sum(p.compute_slices * n for p, n in profiles)
    if slots > product.slots or compute > product.compute_slices:
        return Infeasible(
            Infeasibility.OVER_CAPACITY,
            f"the wanted instances need {slots} placement slots and {compute} compute slices; "
            f"{product.name} has {product.slots} and {product.compute_slices}",
        )
    return None


def _search_order(product: Product, wanted: Counter[str]) -> tuple[Profile, ...]:
    # Most constrained first (fewest placements, then largest), identical profiles adjacent so the
    # search can break their symmetry.
    profiles = sorted(
        (product.require_profile(name) for name in wanted), key=lambda p: (len(p.placements), -p.size, p.name)
    )
    return tuple(p for p in profiles for _ in range(wanted[p.name]))


def _best_layout(
    product: Product, to_place: tuple[Profile, ...], fixed_mask: int, free: set[tuple[str, int]]
) -> tuple[Placement, ...] | None:
    """Exact search: a layout for `to_place` around `fixed_mask` keeping the most `free` instances.

    Among layouts that keep equally many, it prefers the one whose free slices can still hold the
    most small instances (a 3g at slices 4-7 rather than 0-3, since no 1g can start at slice 7), so
    a later addition does not force a rebuild.
    """
    smallest = min(product.profiles, key=lambda p: (p.size, len(p.placements)), default=None)
    growth_starts = 0 if smallest is None else _mask_of(smallest.placements)
    memo: dict[tuple[int, int, int], tuple[int, int, tuple[Placement, ...]] | None] = {}

    def best(index: int, mask: int, min_start: int) -> tuple[int, int, tuple[Placement, ...]] | None:
        if index == len(to_place):
            return (0, (growth_starts & ~mask).bit_count(), ())
        key = (index, mask, min_start)
        if key in memo:
            return memo[key]
        profile = to_place[index]
        same_next = index + 1 < len(to_place) and to_place[index + 1] == profile
        answer: tuple[int, int, tuple[Placement, ...]] | None = None
        for start in profile.placements:
            span = _mask(start, profile.size)
            if start < min_start or mask & span:
                continue
            rest = best(index + 1, mask | span, start + profile.size if same_next else 0)
            if rest is None:
                continue
            kept = rest[0] + ((profile.name, start) in free)
            if answer is None or (kept, rest[1]) > answer[:2]:
                answer = (kept, rest[1], (Placement(profile.name, start, profile.size), *rest[2]))
        memo[key] = answer
        return answer

    found = best(0, fixed_mask, 0)
    return None if found is None else found[2]


def _why_unplaceable(product: Product, wanted: Counter[str], busy: list[Existing]) -> Infeasible:
    wanted_text = ", ".join(f"{n}x{name}" for name, n in sorted(wanted.items()))
    if busy and _best_layout(product, _search_order(product, wanted), 0, set()) is not None:
        held = ", ".join(str(e) for e in busy)
        return Infeasible(
            Infeasibility.FRAGMENTED_BY_BUSY,
            f"{wanted_text} fits on an empty {product.name} but not around the busy instances {held}; "
            "free them or choose a layout that includes them where they are",
        )
    return Infeasible(Infeasibility.NO_PLACEMENT, f"{wanted_text} has no valid placement on {product.name}")


def _placement(product: Product, profile: str, start: int) -> Placement:
    return Placement(profile, start, product.require_profile(profile).size)


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def _mask_of(slices: tuple[int, ...]) -> int:
    return sum(1 << s for s in slices)
