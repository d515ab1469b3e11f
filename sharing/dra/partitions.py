"""On-demand MIG as partitionable devices: per dynamic GPU a counter set and one device per placement
its driver reports, so the kube-scheduler itself picks profile and placement (pure: no I/O, no clock).

KEP-4815 (partitionable devices, beta and on by default in Kubernetes 1.36;
https://github.com/kubernetes/enhancements/tree/master/keps/sig-scheduling/4815-dra-partitionable-devices)
models a MIG GPU the way NVIDIA's DRA driver does for `DynamicMIG`
(kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/partitions.go): one counter set per
GPU with a counter per capacity (`memory`, `multiprocessors`) and one `memory-slice-<n>` counter of
value 1 per memory slice; a device per (profile, placement) consumes the memory slices it occupies
and its memory and multiprocessors. Two placements that overlap share a memory slice, so the
scheduler can never allocate both, nor more than the GPU holds. A profile the driver allows fewer
times than it has disjoint placements (the `+me` ones: one per GPU) gets a counter of its own with
its maximum count. Placements come from the GPU's driver (`Gpu.profiles`, read with NVML's
`nvmlDeviceGetGpuInstancePossiblePlacements_v2`); the catalog only fills in for a GPU read without.

The 1.35+ slice rules (k8s.io/api resource/v1 types.go, `ResourceSliceSpec`): a slice holds devices
or counter sets, never both; at most 8 counter sets per slice, 32 counters per set; at most 64
devices in a slice where any consumes counters. Every slice of the pool has the same generation and
`resourceSliceCount` (`pool` sets them).

Devices allocated to claims stay published, whatever exists on the GPU: the scheduler counts what an
allocated device consumes from the device as the slices list it (k8s.io/dynamic-resource-allocation
v0.36.3, structured/internal/incubating/allocator_incubating.go `checkAvailableCounters`: it
subtracts the `consumesCounters` of every listed device that is allocated), so withdrawing one would
hand its memory slices to the next claim. A GPU instance that exists but that no allocated device
accounts for (one made outside the agent, or one of a claim just deallocated and not unprepared yet)
is invisible to the scheduler: every device that overlaps it is withdrawn until it is gone, so no
claim is allocated a placement that cannot be made.

The order a slice lists a GPU's devices in is the placement policy (`sharing.mig.policy.ranked`):
the scheduler takes the first that fits, so the order must be published again when allocations
change (the wiring re-builds on every allocation it sees; a stale order is still safe, only less
good). The slices of different GPUs are ordered by their object names, which the API server makes
up (generateName): the first GPU in that order fills first, which packs small claims onto as few
GPUs as possible and leaves the others whole.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from sharing.dra.names import DRIVER, ondemand_device_name, parse_ondemand_name, profile_slug
from sharing.dra.slices import (
    MAX_DEVICES_WITH_TAINTS,
    NO_SCHEDULE,
    TAINT_GPU_LOST,
    TAINT_XID,
    _bytes,
    _count,
    _gpu_attributes,
    _mig_capacity,
)
from sharing.kube.api import AttributeValue, Capacity, CounterSet, DeviceTaint, SliceDevice, SliceSpec
from sharing.mig import Catalog, Placement, Product, Profile, default_catalog, geometry
from sharing.mig.policy import Fit, fit, ranked
from sharing.model import Gpu, NodeState

MAX_COUNTER_SETS = 8
"""Counter sets per ResourceSlice (types.go, `ResourceSliceMaxCounterSets`)."""
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


@dataclass(frozen=True, slots=True)
class OnDemandGpu:
    """What one dynamic GPU offers: its counters and its devices in publishing order."""

    gpu_index: int
    counters: CounterSet
    devices: tuple[SliceDevice, ...]
    occupied: tuple[Placement, ...]
    """Placements taken now: allocated to claims, or held by instances that exist."""
    withdrawn: tuple[str, ...] = ()
    """Devices not published because they overlap an instance no allocated device accounts for."""


def named(product: Product) -> dict[str, Profile]:
    """{device-name slug: profile}: the profiles whose devices can be named. Two profiles can have
    one slug (`1g.24gb+me` and `1g.24gb-me` of an RTX PRO 6000 are both `1g-24gb-me`): the first of
    them, smallest first then by name, is offered and the others are not, so a name always parses
    back to one profile."""
    found: dict[str, Profile] = {}
    for profile in sorted(product.profiles, key=lambda p: (p.size, p.compute_slices, p.memory_mib, p.name)):
        found.setdefault(profile_slug(profile.name), profile)
    return found


def allocated_placements(product: Product, gpu_index: int, allocated: Iterable[str]) -> tuple[Placement, ...]:
    """The placements of GPU `gpu_index` that the allocated device names (of our pool) stand for."""
    slugs = named(product)
    found: list[Placement] = []
    for name in allocated:
        parsed = parse_ondemand_name(name)
        if parsed is None or parsed[0] != gpu_index or parsed[1] not in slugs:
            continue
        profile = slugs[parsed[1]]
        if parsed[2] in profile.placements:
            found.append(Placement(profile.name, parsed[2], profile.size))
    return tuple(sorted(set(found)))


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


def ondemand_gpu(
    gpu: Gpu,
    product: Product,
    node: NodeState,
    *,
    allocated: Iterable[str] = (),
    taint: DeviceTaint | None = None,
    whole_gpu: bool = False,
) -> OnDemandGpu:
    """The counters and devices of one dynamic GPU, given the device names allocated from our pool."""
    allocated = tuple(allocated)
    claimed = allocated_placements(product, gpu.index, allocated)
    existing = tuple(Placement(gi.profile, gi.start, gi.size) for gi in gpu.instances)
    foreign = [p for p in existing if p not in claimed]
    occupied = occupied_placements(gpu, product, allocated)
    base = _gpu_attributes(gpu, node.driver) | {"parentUUID": gpu.uuid, "parentIndex": gpu.index}
    taints = (taint,) if taint is not None else ()
    devices: list[SliceDevice] = []
    withdrawn: list[str] = []
    whole = counters(product, gpu.index)
    if whole_gpu:
        name = device_name_of_gpu(gpu.index)
        if foreign:
            withdrawn.append(name)
        else:
            attributes: dict[str, AttributeValue] = _gpu_attributes(gpu, node.driver) | {
                "type": "gpu",
                "uuid": gpu.uuid,
                "index": gpu.index,
            }
            if gpu.minor is not None:
                attributes["minor"] = gpu.minor
            devices.append(
                SliceDevice(
                    name,
                    attributes=tuple(sorted(attributes.items())),
                    capacity=((MEMORY, Capacity(_bytes(gpu.memory_mib))),),
                    taints=taints,
                    consumes_counters=(whole,),
                )
            )
    offered = {p.name for p in named(product).values()}
    for entry in ranked(product, occupied):
        p = entry.placement
        if p.profile not in offered:
            continue
        name = ondemand_device_name(gpu.index, p.profile, p.start)
        if p not in claimed and any(_overlap(p, f) for f in foreign):
            withdrawn.append(name)
            continue
        profile = product.require_profile(p.profile)
        attributes = base | {
            "type": "mig",
            "profile": p.profile,
            "placementStart": p.start,
            "placementSize": p.size,
        }
        devices.append(
            SliceDevice(
                name,
                attributes=tuple(sorted(attributes.items())),
                capacity=tuple(sorted((k, Capacity(v)) for k, v in _mig_capacity(profile).items())),
                taints=taints,
                consumes_counters=(consumption(product, p, gpu.index, whole),),
            )
        )
    return OnDemandGpu(gpu.index, whole, tuple(devices), occupied, tuple(withdrawn))


def held_by(device: str, node: NodeState) -> frozenset[str] | None:
    """The UUIDs an allocated on-demand device holds, for the safe change protocol; None when
    `device` is not an on-demand name. Always the whole GPU, so no other layout is made around a
    claim's instance (a static layout keeping it would advertise it a second time), plus the MIG
    devices of the GPU instance at its placement once it is made, or every MIG device of the GPU
    while it is not (fail closed)."""
    parsed = parse_ondemand_name(device)
    if parsed is None:
        return None
    gpu = next((g for g in node.gpus if g.index == parsed[0]), None)
    if gpu is None:
        return frozenset()
    for gi in gpu.instances:
        if profile_slug(gi.profile) == parsed[1] and gi.start == parsed[2] and gi.compute_instances:
            return frozenset({gpu.uuid, *(ci.uuid for ci in gi.compute_instances)})
    return frozenset({gpu.uuid, *(ci.uuid for _, ci in gpu.mig_devices)})


def occupied_placements(gpu: Gpu, product: Product, allocated: Iterable[str]) -> tuple[Placement, ...]:
    """The placements of a dynamic GPU taken now: allocated to claims, or held by an instance."""
    existing = {Placement(gi.profile, gi.start, gi.size) for gi in gpu.instances}
    return tuple(sorted(existing | set(allocated_placements(product, gpu.index, allocated))))


def request_fit(
    node: NodeState,
    dynamic: Collection[str],
    profile: str,
    catalog: Catalog | None = None,
    *,
    allocated: Iterable[str] = (),
) -> tuple[Fit, tuple[int, ...]]:
    """Whether one more `profile` fits a dynamic GPU of the node, and the GPUs that say so: FITS with
    the GPUs that have a free placement; else FRAGMENTED with the GPUs whose free memory and compute
    would hold it but no placement does (for `sharing status`, an Event and a metric); else FULL."""
    catalog = catalog if catalog is not None else default_catalog()
    allocated = tuple(allocated)
    found: dict[Fit, list[int]] = {Fit.FITS: [], Fit.FRAGMENTED: [], Fit.FULL: []}
    for gpu in node.gpus:
        product = geometry(gpu, catalog) if gpu.uuid in dynamic and gpu.mig_enabled else None
        if product is None or product.profile(profile) is None:
            continue
        found[fit(product, occupied_placements(gpu, product, allocated), profile)].append(gpu.index)
    for kind in (Fit.FITS, Fit.FRAGMENTED):
        if found[kind]:
            return kind, tuple(found[kind])
    return Fit.FULL, tuple(found[Fit.FULL])


def device_name_of_gpu(gpu_index: int) -> str:
    """The whole-GPU device of a dynamic GPU: `gpu-<index>`, as for a static one."""
    return f"gpu-{gpu_index}"


def partitionable_slices(
    node_name: str,
    node: NodeState,
    dynamic: Collection[str],
    catalog: Catalog | None = None,
    *,
    allocated: Iterable[str] = (),
    xids: Mapping[str, int] | None = None,
    unhealthy: Collection[str] = (),
    whole_gpu: bool = False,
    generation: int = 1,
) -> tuple[SliceSpec, ...]:
    """The slices of the dynamic GPUs (by UUID) of `node`: counter sets first, then each GPU's devices.

    `allocated` names the devices of our pool that claims are allocated now (their
    `status.allocation.devices.results[].device` where driver and pool are ours). A dynamic GPU
    offers nothing until MIG mode is on (the applier turns it on while the GPU is idle), nor when its
    MIG geometry is unknown. Its devices carry the health taints of `sharing.dra.slices`: `xids`
    names a GPU's last XID, `unhealthy` the GPUs the health overlay marks (an XID not known by value).
    """
    catalog = catalog if catalog is not None else default_catalog()
    allocated = tuple(allocated)
    gpus: list[OnDemandGpu] = []
    for gpu in node.gpus:
        product = geometry(gpu, catalog) if gpu.uuid in dynamic and gpu.mig_enabled else None
        if product is None or not product.profiles:
            continue
        gpus.append(
            ondemand_gpu(
                gpu,
                product,
                node,
                allocated=allocated,
                taint=_taint(gpu, node, xids or {}, unhealthy),
                whole_gpu=whole_gpu,
            )
        )
    sets = [g.counters for g in gpus]
    specs = [
        SliceSpec(DRIVER, node_name, node_name, generation, 0, (), tuple(sets[i : i + MAX_COUNTER_SETS]))
        for i in range(0, len(sets), MAX_COUNTER_SETS)
    ]
    for g in gpus:
        specs += [
            SliceSpec(DRIVER, node_name, node_name, generation, 0, g.devices[i : i + MAX_DEVICES_WITH_TAINTS])
            for i in range(0, len(g.devices), MAX_DEVICES_WITH_TAINTS)
        ]
    return pool(specs)


def pool(*parts: Sequence[SliceSpec]) -> tuple[SliceSpec, ...]:
    """The slices of several builders as one pool: the highest generation and the total count in each."""
    specs = [s for part in parts for s in part]
    generation = max((s.generation for s in specs), default=1)
    return tuple(replace(s, generation=generation, slice_count=len(specs)) for s in specs)


def withdrawn_static(specs: Sequence[SliceSpec], dynamic: Collection[str]) -> tuple[SliceSpec, ...]:
    """Static slices without any device of a dynamic GPU (its instances belong to claims)."""
    kept = []
    for spec in specs:
        devices = tuple(d for d in spec.devices if not _on(d, dynamic))
        if devices or spec.shared_counters:
            kept.append(replace(spec, devices=devices))
    return tuple(kept)


def _on(device: SliceDevice, gpus: Collection[str]) -> bool:
    attributes = dict(device.attributes)
    return attributes.get("uuid") in gpus or attributes.get("parentUUID") in gpus


def _taint(
    gpu: Gpu, node: NodeState, xids: Mapping[str, int], unhealthy: Collection[str]
) -> DeviceTaint | None:
    if any(u.uuid == gpu.uuid for u in node.unreadable):
        return DeviceTaint(TAINT_GPU_LOST, "", NO_SCHEDULE)
    if gpu.uuid in xids:
        return DeviceTaint(TAINT_XID, str(xids[gpu.uuid]), NO_SCHEDULE)
    if gpu.uuid in unhealthy:
        return DeviceTaint(TAINT_XID, "", NO_SCHEDULE)
    return None


def _overlap(a: Placement, b: Placement) -> bool:
    return a.start < b.start + b.size and b.start < a.start + a.size


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


__all__ = [
    "OnDemandGpu",
    "allocated_placements",
    "consumption",
    "count_counter",
    "counter_set_name",
    "counters",
    "device_name_of_gpu",
    "held_by",
    "memory_slice",
    "named",
    "occupied_placements",
    "ondemand_gpu",
    "partitionable_slices",
    "pool",
    "request_fit",
    "withdrawn_static",
]
