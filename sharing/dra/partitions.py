"""On-demand MIG as partitionable devices: per dynamic GPU a counter set and one device per placement
its driver reports, so the kube-scheduler itself picks profile and placement (pure: no I/O, no clock).

KEP-4815 (partitionable devices, beta and on by default in Kubernetes 1.36;
https://github.com/kubernetes/enhancements/tree/master/keps/sig-scheduling/4815-dra-partitionable-devices)
models a MIG GPU the way NVIDIA's DRA driver does for `DynamicMIG`
(kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/partitions.go): one counter set per GPU,
and a device per (profile, placement) that consumes from it what the placement occupies, so the
scheduler can never allocate two overlapping placements, nor more than the GPU holds (the counters and
what each device takes: `sharing.dra.counters`). Placements come from the GPU's driver (`Gpu.profiles`,
read with NVML's `nvmlDeviceGetGpuInstancePossiblePlacements_v2`); the catalog only fills in for a GPU
read without.

The 1.35+ slice rules (k8s.io/api resource/v1 types.go, `ResourceSliceSpec`): a slice holds devices
or counter sets, never both; at most 8 counter sets per slice, 32 counters per set; at most 64
devices in a slice where any consumes counters. Every slice of the pool has the same generation and
`resourceSliceCount` (`pool` sets them).

What the node knows decides what is offered and in what order: the claims prepared here (the plugin's
checkpoint) and the instances on the GPU. Every instance withdraws the devices of the placements it
overlaps but its own. Its own device stays published: a claim prepared here may still be allocated it,
and the scheduler counts what an allocated device consumes only while the slices list it
(k8s.io/dynamic-resource-allocation v0.37.2, structured/internal/incubating/allocator_incubating.go
`checkAvailableCounters`: it subtracts the `consumesCounters` of every listed device that is
allocated), so withdrawing it would hand its memory slices to the next claim. A claim allocated a
device and not prepared yet is not known here, but its placement has no instance, so its device stays
published too. A claim released and not unprepared yet keeps its instance, and so its device: the
scheduler may allocate it to a new claim, whose prepare then waits for the old one's unprepare
(`sharing.dra.ondemand.SlotHandover`). A GPU instance no prepared claim accounts for (made by
someone else) is invisible to the scheduler, since only allocated devices consume counters: every
device that overlaps it is withdrawn until it is gone, and while it is there no other device of a
profile with a count counter is offered either (the counter does not count it). One exception: an
instance the agent did not make and no claim holds (`sharing.dra.foreign`) that is one whole MIG
device keeps the device of its own placement, listed first, so a claim can be allocated it (and is
prepared with it) whether or not it is claimed: that device overlaps only itself. One being reclaimed
(`reclaimForeign: idle`) is passed as `held` and keeps nothing.

The order a slice lists a GPU's devices in is the placement policy (`sharing.mig.policy.ranked`):
the scheduler takes the first that fits, so the order is published again when what the node knows
changes (a prepare, an unprepare, an instance made or destroyed by someone else; a stale order is
still safe, only less good). The slices of different GPUs are ordered by their object names, which
the API server makes up (generateName): the first GPU in that order fills first, which packs small
claims onto as few GPUs as possible and leaves the others whole. Choosing the GPU by best fit instead
(where a claim leaves the node the largest profiles placeable, empty GPUs last) served the same pods
and compute in the trace bench's offline replay (hack/bench `trace_offline_bestfit_vs_plain_*`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from sharing.dra.counters import MEMORY, consumption, count_counter, counters
from sharing.dra.foreign import Held, offered_as
from sharing.dra.names import DRIVER, ondemand_device_name
from sharing.dra.placements import allocated_placements, named, occupied_placements
from sharing.dra.slices import (
    MAX_DEVICES_WITH_TAINTS,
    NO_SCHEDULE,
    TAINT_GPU_LOST,
    TAINT_XID,
    _bytes,
    _gpu_attributes,
    _mig_capacity,
)
from sharing.kube.api import AttributeValue, Capacity, CounterSet, DeviceTaint, SliceDevice, SliceSpec
from sharing.mig import Catalog, Placement, Product, default_catalog, geometry
from sharing.mig.policy import ranked
from sharing.model import Gpu, NodeState

MAX_COUNTER_SETS = 8
"""Counter sets per ResourceSlice (types.go, `ResourceSliceMaxCounterSets`)."""


@dataclass(frozen=True, slots=True)
class OnDemandGpu:
    """What one dynamic GPU offers: its counters and its devices in publishing order."""

    gpu_index: int
    counters: CounterSet
    devices: tuple[SliceDevice, ...]
    occupied: tuple[Placement, ...]
    """Placements taken now: held by claims prepared here, or by instances that exist."""
    withdrawn: tuple[str, ...] = ()
    """Devices not published because they overlap an instance no allocated device accounts for."""


def ondemand_gpu(
    gpu: Gpu,
    product: Product,
    node: NodeState,
    *,
    prepared: Iterable[str] = (),
    taint: DeviceTaint | None = None,
    whole_gpu: bool = False,
    held: Collection[Held] = (),
) -> OnDemandGpu:
    """The counters and devices of one dynamic GPU, given the device names of our pool the claims
    prepared here hold and the instances the claims of the checkpoint hold (`sharing.dra.foreign.held`)."""
    prepared = tuple(prepared)
    claimed = allocated_placements(product, gpu.index, prepared)
    present = [Placement(gi.profile, gi.start, gi.size) for gi in gpu.instances]
    unaccounted = [gi for gi in gpu.instances if Placement(gi.profile, gi.start, gi.size) not in claimed]
    standing = [Placement(gi.profile, gi.start, gi.size) for gi in unaccounted]
    adoptable = {
        Placement(gi.profile, gi.start, gi.size)
        for gi in unaccounted
        if (gpu.uuid, gi.profile, gi.start) not in held and offered_as(gpu, gi, product) is not None
    }
    occupied = occupied_placements(gpu, product, prepared)
    base = _gpu_attributes(gpu, node.driver) | {"parentUUID": gpu.uuid, "parentIndex": gpu.index}
    taints = (taint,) if taint is not None else ()
    devices: list[SliceDevice] = []
    withdrawn: list[str] = []
    whole = counters(product, gpu.index)
    if whole_gpu:
        name = device_name_of_gpu(gpu.index)
        if present:
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
    have = dict(whole.counters)
    limited = {p.profile for p in standing if count_counter(p.profile) in have}
    first: list[SliceDevice] = []
    for entry in ranked(product, occupied):
        p = entry.placement
        if p.profile not in offered:
            continue
        name = ondemand_device_name(gpu.index, p.profile, p.start)
        # Every instance withdraws the placements it overlaps but its own; one no prepared claim
        # accounts for (and no claim can adopt) its own too, and the count-limited profiles.
        crossed = any(_overlap(p, s) for s in present if s != p)
        blocked = any(_overlap(p, s) for s in standing) or p.profile in limited
        if crossed or (p not in claimed and p not in adoptable and blocked):
            withdrawn.append(name)
            continue
        profile = product.require_profile(p.profile)
        attributes = base | {
            "type": "mig",
            "profile": p.profile,
            "placementStart": p.start,
            "placementSize": p.size,
        }
        (first if p in adoptable else devices).append(
            SliceDevice(
                name,
                attributes=tuple(sorted(attributes.items())),
                capacity=tuple(sorted((k, Capacity(v)) for k, v in _mig_capacity(profile).items())),
                taints=taints,
                consumes_counters=(consumption(product, p, gpu.index, whole),),
            )
        )
    # An instance that is there takes no more room when a claim is allocated it: offered before any
    # placement that would make one.
    return OnDemandGpu(gpu.index, whole, (*first, *devices), occupied, tuple(withdrawn))


def device_name_of_gpu(gpu_index: int) -> str:
    """The whole-GPU device of a dynamic GPU: `gpu-<index>`, as for a static one."""
    return f"gpu-{gpu_index}"


def partitionable_slices(
    node_name: str,
    node: NodeState,
    dynamic: Collection[str],
    catalog: Catalog | None = None,
    *,
    prepared: Iterable[str] = (),
    xids: Mapping[str, int] | None = None,
    unhealthy: Collection[str] = (),
    whole_gpu: bool = False,
    generation: int = 1,
    held: Collection[Held] = (),
) -> tuple[SliceSpec, ...]:
    """The slices of the dynamic GPUs (by UUID) of `node`: counter sets first, then each GPU's devices.

    `prepared` names the devices of our pool that the claims prepared here hold (the checkpoint's
    `PreparedDevice.device`). A dynamic GPU
    offers nothing until MIG mode is on (the applier turns it on while the GPU is idle), nor when its
    MIG geometry is unknown. Its devices carry the health taints of `sharing.dra.slices`: `xids`
    names a GPU's last XID, `unhealthy` the GPUs the health overlay marks (an XID not known by value).
    `held` names the instances the claims of the checkpoint hold (`sharing.dra.foreign.held`).
    """
    catalog = catalog if catalog is not None else default_catalog()
    prepared = tuple(prepared)
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
                prepared=prepared,
                taint=_taint(gpu, node, xids or {}, unhealthy),
                whole_gpu=whole_gpu,
                held=held,
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


__all__ = [
    "OnDemandGpu",
    "device_name_of_gpu",
    "ondemand_gpu",
    "partitionable_slices",
    "pool",
    "withdrawn_static",
]
