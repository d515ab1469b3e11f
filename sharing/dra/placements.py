"""Which placements of a dynamic GPU are taken, and what follows from that (pure: no I/O, no clock).

A placement is taken when a claim is allocated the device that stands for it (its name,
`gpu-0-mig-3g-20gb-at-4`, parsed back through the profiles whose devices can be named) or when a GPU
instance exists there. From that: what an allocated on-demand device holds for the safe change
protocol (`held_by`), and whether one more instance of a profile fits a dynamic GPU of the node, or
only its free memory and compute would hold it (`request_fit`: fragmentation made visible). The
devices published for the placements are `sharing.dra.partitions`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sharing.dra.names import parse_ondemand_name, profile_slug
from sharing.mig import Catalog, Placement, Product, Profile, default_catalog, geometry
from sharing.mig.policy import Fit, fit
from sharing.model import Gpu, NodeState


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
