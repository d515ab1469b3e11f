"""Partitions the agent did not make: the MIG instances on a dynamic GPU that were there before it (a
static config, mig-parted, a person with nvidia-smi) or were made beside it. Pure: no I/O, no clock.

NVIDIA's DRA driver destroys them when its plugin starts (`DynamicMIG`;
https://github.com/kubernetes-sigs/dra-driver-nvidia-gpu/blob/main/site/content/docs/concepts/gpu-allocation.md);
this agent never destroys one unless the GPU's rule says `reclaimForeign: idle`, and then only one that
is idle (no processes: NVML IN_USE) and that no claim holds or is allocated.

Each is offered as the on-demand device of its profile at its placement, under the on-demand name
(`gpu-0-mig-3g-20gb-at-4`, `sharing.dra.names`), not a name of its own: the scheduler's counters, the
placement policy and the claims' bookkeeping already read that name as that placement, and it stays
the device's name when the instance is reclaimed and its room becomes on-demand room again. A second
name for the same placement would be a second device the scheduler could allocate beside it. A claim
allocated the device is prepared with the instance that is there (adopted: the checkpoint records it
as `foreign`), nothing is made, and its unprepare leaves it (`sharing.dra.instances`).

Only an instance that is one whole MIG device is offered: one compute instance spanning all of the GPU
instance's compute slices (nvmlComputeInstanceGetInfo, `placement.size`; nvml.h
`nvmlComputeInstanceInfo_t`). A smaller compute instance is not the profile's device, and a GPU
instance with none or several is not one device: those only block, as every instance no allocated
device accounts for does (`sharing.dra.partitions`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from sharing.dra.names import ondemand_device_name, profile_slug
from sharing.dra.placements import allocated_placements, named
from sharing.mig import Catalog, Placement, Product, Profile, default_catalog, geometry
from sharing.model import Gpu, GpuInstance, NodeState
from sharing.store import PreparedClaim

Held = tuple[str, str, int]
"""An instance a claim of the checkpoint holds: (GPU UUID, profile, start)."""


@dataclass(frozen=True, slots=True)
class Foreign:
    """A MIG instance on a dynamic GPU that the agent did not make."""

    gpu: Gpu
    instance: GpuInstance
    device: str | None
    """The on-demand device that offers it; None when it is not one whole MIG device (it only blocks)."""
    claim: str = ""
    """`namespace/name` of the claim that adopted it, "" when none has."""


def offered_as(gpu: Gpu, gi: GpuInstance, product: Product) -> str | None:
    """The on-demand device that offers an existing instance, None when it is not one whole MIG device
    whose name parses back to its profile and placement."""
    profile = named(product).get(profile_slug(gi.profile))
    if profile is None or profile.name != gi.profile or gi.start not in profile.placements:
        return None
    return ondemand_device_name(gpu.index, gi.profile, gi.start) if whole_device(gi, profile) else None


def whole_device(gi: GpuInstance, profile: Profile) -> bool:
    """Whether a GPU instance of `profile` is one MIG device: one compute instance spanning it all."""
    return len(gi.compute_instances) == 1 and gi.compute_instances[0].slices == profile.compute_slices


def held(claims: Iterable[PreparedClaim]) -> frozenset[Held]:
    """The instances the claims of the checkpoint hold (made or adopted for them)."""
    return frozenset(
        (d.instance.gpu_uuid, d.instance.profile, d.instance.start)
        for c in claims
        for d in c.devices
        if d.instance is not None
    )


def foreign_instances(
    node: NodeState, dynamic: Collection[str], claims: Iterable[PreparedClaim], catalog: Catalog | None = None
) -> tuple[Foreign, ...]:
    """The instances on the dynamic GPUs of `node` that the agent did not make: none of the checkpoint's
    claims holds them, or one adopted them."""
    catalog = catalog if catalog is not None else default_catalog()
    made: set[Held] = set()
    adopted: dict[Held, str] = {}
    for c in claims:
        for d in c.devices:
            i = d.instance
            if i is not None and i.foreign:
                adopted[(i.gpu_uuid, i.profile, i.start)] = f"{c.namespace}/{c.name}"
            elif i is not None:
                made.add((i.gpu_uuid, i.profile, i.start))
    found = []
    for gpu in node.gpus:
        product = geometry(gpu, catalog) if gpu.uuid in dynamic and gpu.mig_enabled else None
        if product is None:
            continue
        for gi in gpu.instances:
            key = (gpu.uuid, gi.profile, gi.start)
            if key not in made:
                found.append(Foreign(gpu, gi, offered_as(gpu, gi, product), adopted.get(key, "")))
    return tuple(found)


def reclaimable(
    node: NodeState,
    reclaim: Collection[str],
    claims: Iterable[PreparedClaim],
    allocated: Iterable[str],
    catalog: Catalog | None = None,
) -> tuple[Foreign, ...]:
    """The foreign instances of the GPUs in `reclaim` (dynamic, `reclaimForeign: idle`) that may be
    destroyed now: idle (no compute instance with processes), no claim of the checkpoint holds them,
    and no claim is allocated their placement (`allocated`: the device names the claims of the node's
    pods are allocated; its prepare adopts them)."""
    catalog = catalog if catalog is not None else default_catalog()
    claims = tuple(claims)
    allocated = tuple(allocated)
    holding = held(claims)
    found = []
    for f in foreign_instances(node, reclaim, claims, catalog):
        product = geometry(f.gpu, catalog)
        gi = f.instance
        taken = () if product is None else allocated_placements(product, f.gpu.index, allocated)
        if (f.gpu.uuid, gi.profile, gi.start) in holding or gi.busy:
            continue
        if Placement(gi.profile, gi.start, gi.size) in taken:
            continue
        found.append(f)
    return tuple(found)


__all__ = ["Foreign", "Held", "foreign_instances", "held", "offered_as", "reclaimable", "whole_device"]
