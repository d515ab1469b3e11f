"""Where on-demand MIG instances go: every placement of a GPU ranked so that large profiles stay
possible for as long as possible, and which profiles free space cannot hold because of its shape (pure).

The kube-scheduler does not choose: its DRA allocator takes the first device that fits, in a fixed
order — pools sorted by driver and pool name, a pool's device slices by object name, then the devices
in the order a slice lists them (k8s.io/dynamic-resource-allocation v0.36.3,
structured/internal/incubating/pools_incubating.go `GatherPools` -> `sortPoolsByID` and `buildPool`
-> `sortSlicesByName` "Because the allocator uses a first-fit search, this allows driver authors to
influence prioritization through their naming conventions"; allocator_incubating.go `allocateOne`,
which walks pools, slices and devices in that order and stops at the first solution: "Without
scoring, we stop and use the first solution". That is the allocator a 1.36 scheduler picks with its
default gates (`NewAllocator` in structured/allocator.go takes the most stable one that supports the
enabled features, and DRAConsumableCapacity, beta and on, needs "incubating"); the "stable" one
walks the devices of a slice in the same order but does not sort the slices). Devices allocated
already are skipped (`deviceInUse`), and one whose counters no longer fit is skipped
(`checkAvailableCounters`). So the order a slice lists a GPU's devices in is the placement policy.

`ranked` orders them best fit first, by the exact planner (`sharing.mig.plan`): of the placements of
one profile that are free now, the first is the one after which the most instances of each larger
profile can still be added (compared from the largest profile down), then the one that takes away
the fewest placements of larger profiles, then the highest start. NVIDIA's driver lists them in
plain placement order instead (lowest start first), which leaves holes that block large profiles
later (kubernetes-sigs/dra-driver-nvidia-gpu#933). Smaller profiles come before larger ones, so a
claim that accepts several profiles (by memory, say) gets the smallest that fits.
"""

from __future__ import annotations

import enum
import functools
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from sharing.mig.catalog import Product, Profile
from sharing.mig.plan import Existing, Placement, Plan, plan_gpu


class Fit(enum.Enum):
    """Whether one more instance of a profile fits a GPU as it is occupied."""

    FITS = "fits"
    """A free placement exists."""
    FRAGMENTED = "fragmented"
    """Enough memory slices and compute slices are free, but no placement is: the free space has the
    wrong shape (it would fit after the instances around it moved, which nobody does)."""
    FULL = "full"
    """Not enough free memory or compute, or the profile's maximum count is reached."""


@dataclass(frozen=True, slots=True)
class Ranked:
    """A placement in publishing order, and whether it can be allocated now."""

    placement: Placement
    free: bool
    """No occupied placement overlaps it and its profile's maximum count is not reached."""


def placements(product: Product) -> tuple[Placement, ...]:
    """Every (profile, start) the GPU can hold, as its driver reports them (plain placement order)."""
    return tuple(Placement(p.name, s, p.size) for p in _by_size(product.profiles) for s in p.placements)


def ranked(product: Product, occupied: Collection[Placement]) -> tuple[Ranked, ...]:
    """Every placement of the GPU, the free ones of each profile best first (see the module)."""
    return _ranked(product, tuple(sorted(set(occupied))))


@functools.lru_cache(maxsize=4096)
def _ranked(product: Product, occupied: tuple[Placement, ...]) -> tuple[Ranked, ...]:
    """`ranked`, remembered: a node re-publishes its pool on every allocation, mostly in states
    seen before."""
    taken = _mask_of(occupied)
    counts = Counter(p.profile for p in occupied)
    out: list[Ranked] = []
    for profile in _by_size(product.profiles):
        free = [s for s in profile.placements if _usable(profile, s, taken, counts)]
        scored = sorted(free, key=lambda s: _score(product, occupied, profile, s), reverse=True)
        out += [Ranked(Placement(profile.name, s, profile.size), True) for s in scored]
        out += [
            Ranked(Placement(profile.name, s, profile.size), False)
            for s in profile.placements
            if s not in free
        ]
    return tuple(out)


def plain(product: Product, occupied: Collection[Placement]) -> tuple[Ranked, ...]:
    """Every placement in plain placement order (lowest start first), as NVIDIA's driver lists them."""
    taken = _mask_of(occupied)
    counts = Counter(p.profile for p in occupied)
    return tuple(
        Ranked(Placement(p.name, s, p.size), _usable(p, s, taken, counts))
        for p in _by_size(product.profiles)
        for s in p.placements
    )


def fit(product: Product, occupied: Collection[Placement], profile: str) -> Fit:
    """Whether one more `profile` fits; FRAGMENTED when memory and compute are free but no placement."""
    wanted = product.require_profile(profile)
    taken = _mask_of(occupied)
    counts = Counter(p.profile for p in occupied)
    if any(_usable(wanted, s, taken, counts) for s in wanted.placements):
        return Fit.FITS
    free_slices = product.slots - taken.bit_count()
    used_compute = sum(product.require_profile(p.profile).compute_slices for p in occupied)
    if (
        counts[profile] < wanted.max_count
        and free_slices >= wanted.size
        and product.compute_slices - used_compute >= wanted.compute_slices
    ):
        return Fit.FRAGMENTED
    return Fit.FULL


def fragmented(product: Product, occupied: Collection[Placement]) -> tuple[str, ...]:
    """The profiles one more of which would fit the GPU's free memory and compute but no placement."""
    return tuple(
        p.name for p in _by_size(product.profiles) if fit(product, occupied, p.name) is Fit.FRAGMENTED
    )


def addable(product: Product, occupied: Collection[Placement], profile: str) -> int:
    """How many more `profile` instances the exact planner can place around `occupied` (kept where
    they are), up to the profile's maximum count."""
    fixed = [Existing(p.profile, p.start, busy=True) for p in occupied]
    base = Counter(p.profile for p in occupied)
    room = product.require_profile(profile).max_count - base[profile]
    found = 0
    for k in range(1, room + 1):
        if not isinstance(plan_gpu(product, fixed, base + Counter({profile: k})), Plan):
            break
        found = k
    return found


def _score(
    product: Product, occupied: Collection[Placement], profile: Profile, start: int
) -> tuple[tuple[int, ...], int, int]:
    """Higher is better: (larger profiles still addable, largest first; minus the placements of larger
    profiles this one takes away; the start)."""
    after = (*occupied, Placement(profile.name, start, profile.size))
    larger = [q for q in _by_size(product.profiles) if _rank(q) > _rank(profile)][::-1]
    still = tuple(addable(product, after, q.name) for q in larger)
    span = _mask(start, profile.size)
    before = _mask_of(occupied)
    lost = sum(
        1 for q in larger for s in q.placements if not before & _mask(s, q.size) and span & _mask(s, q.size)
    )
    return still, -lost, start


def _usable(profile: Profile, start: int, taken: int, counts: Counter[str]) -> bool:
    return not taken & _mask(start, profile.size) and counts[profile.name] < profile.max_count


def _rank(profile: Profile) -> tuple[int, int, int]:
    return profile.size, profile.compute_slices, profile.memory_mib


def _by_size(profiles: Iterable[Profile]) -> list[Profile]:
    """Smallest first: placement size, compute slices, memory, then name."""
    return sorted(profiles, key=lambda p: (*_rank(p), p.name))


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def _mask_of(occupied: Iterable[Placement]) -> int:
    mask = 0
    for p in occupied:
        mask |= _mask(p.start, p.size)
    return mask
