"""What a dynamic GPU's devices share and take (KEP-4815 partitionable devices; pure: no I/O, no clock).

One counter set per GPU, as NVIDIA's DRA driver models a MIG GPU for `DynamicMIG`
(kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/partitions.go): a counter per capacity
(`memory`, `multiprocessors`) and one `memory-slice-<n>` counter of value 1 per memory slice. The
device of one (profile, placement) consumes the memory slices it occupies and its memory and
multiprocessors, so two placements that overlap share a memory slice and the scheduler can never
allocate both, nor more than the GPU holds. A profile the driver allows fewer times than it has
disjoint placements (the `+me` ones: one per GPU) gets a counter of its own with its maximum count.
The devices themselves, and the slices that carry them, are `sharing.dra.partitions`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sharing.dra.names import profile_slug
from sharing.dra.slices import _bytes, _count
from sharing.kube.api import CounterSet
from sharing.mig import Placement, Product

MAX_COUNTERS = 32
"""Counters per counter set (types.go, `ResourceSliceMaxCountersPerCounterSet`)."""
MEMORY = "memory"
MULTIPROCESSORS = "multiprocessors"


def counter_set_name(gpu_index: int) -> str:
    """The counter set of GPU `gpu_index`: `gpu-0-counters` (a DNS label, unique in the pool)."""
    return f"gpu-{gpu_index}-counters"


def memory_slice(n: int) -> str:
    """The counter of memory slice `n` (NVIDIA's name)."""
    return f"memory-slice-{n}"


def count_counter(profile: str) -> str:
    """The counter that caps how many instances of `profile` a GPU holds (`1g-5gb-me-instances`)."""
    return f"{profile_slug(profile)}-instances"


def counters(product: Product, gpu_index: int) -> CounterSet:
    """The counter set of a dynamic GPU: memory, multiprocessors (where every profile's is known), a
    counter per memory slice, and one per profile capped below its disjoint placements."""
    memory, sms = _most(product)
    values: dict[str, str] = {MEMORY: _bytes(memory)}
    if sms is not None:
        values[MULTIPROCESSORS] = _count(sms)
    values |= {memory_slice(n): "1" for n in range(product.slots)}
    for profile in product.profiles:
        if profile.max_count < _disjoint(profile.placements, profile.size):
            values[count_counter(profile.name)] = _count(profile.max_count)
    if len(values) > MAX_COUNTERS:
        raise ValueError(f"{product.name}: {len(values)} counters, more than {MAX_COUNTERS} in one set")
    return CounterSet(counter_set_name(gpu_index), tuple(sorted(values.items())))


def consumption(
    product: Product, placement: Placement, gpu_index: int, of: CounterSet | None = None
) -> CounterSet:
    """What one (profile, placement) takes from its GPU's counter set (`of`, when built already)."""
    profile = product.require_profile(placement.profile)
    have = dict((of or counters(product, gpu_index)).counters)
    values: dict[str, str] = {MEMORY: _bytes(profile.memory_mib)}
    if MULTIPROCESSORS in have and profile.multiprocessors is not None:
        values[MULTIPROCESSORS] = _count(profile.multiprocessors)
    values |= {memory_slice(n): "1" for n in range(placement.start, placement.start + placement.size)}
    if count_counter(profile.name) in have:
        values[count_counter(profile.name)] = "1"
    return CounterSet(counter_set_name(gpu_index), tuple(sorted(values.items())))


def _disjoint(starts: Sequence[int], size: int) -> int:
    """The most placements of one size that can be chosen without overlap (greedy by start is exact)."""
    end, found = -1, 0
    for start in sorted(starts):
        if start >= end:
            found, end = found + 1, start + size
    return found


@functools.cache
def _most(product: Product) -> tuple[int, int | None]:
    """At least the most memory (MiB) and multiprocessors any valid layout of the GPU uses together
    (more than the full profile's on some GPUs): the counters must never refuse a layout the hardware
    allows. Disjoint placements, maximum counts left out (so an upper bound; the memory-slice
    counters do the excluding), by the interval-scheduling recurrence over the slots."""
    sms_known = all(p.multiprocessors is not None for p in product.profiles)
    best: list[tuple[int, int]] = [(0, 0)] * (product.slots + 1)
    for slot in range(product.slots - 1, -1, -1):
        memory, sms = best[slot + 1]
        for p in product.profiles:
            if slot in p.placements and slot + p.size <= product.slots:
                rest = best[slot + p.size]
                memory = max(memory, p.memory_mib + rest[0])
                sms = max(sms, (p.multiprocessors or 0) + rest[1])
        best[slot] = (memory, sms)
    return best[0][0], best[0][1] if sms_known else None
