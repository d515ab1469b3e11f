"""Which placements of a dynamic GPU are taken, and what follows from that (pure: no I/O, no clock).

A placement is taken when a claim prepared here holds the device that stands for it (its name,
`gpu-0-mig-3g-20gb-at-4`, parsed back through the profiles whose devices can be named) or when a GPU
instance exists there. From that: what an allocated on-demand device holds for the safe change
protocol (`held_by`). The devices published for the placements are `sharing.dra.partitions`.
"""

from __future__ import annotations

from collections.abc import Iterable

from sharing.dra.names import parse_ondemand_name, profile_slug
from sharing.mig import Placement, Product, Profile
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


def allocated_placements(product: Product, gpu_index: int, devices: Iterable[str]) -> tuple[Placement, ...]:
    """The placements of GPU `gpu_index` that these device names (of our pool) stand for."""
    slugs = named(product)
    found: list[Placement] = []
    for name in devices:
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


def occupied_placements(gpu: Gpu, product: Product, prepared: Iterable[str]) -> tuple[Placement, ...]:
    """The placements of a dynamic GPU taken now: held by claims prepared here, or by an instance."""
    existing = {Placement(gi.profile, gi.start, gi.size) for gi in gpu.instances}
    return tuple(sorted(existing | set(allocated_placements(product, gpu.index, prepared))))
