"""How much room each dynamic GPU has left, and how much of its free compute its shape strands (pure).

Per GPU under `mig: dynamic` in MIG mode, from the instances on it (what the node knows; never other
nodes' claims): the largest profile one more instance of which still has a free placement (the
largest claim the GPU can take now), its free compute slices, and the stranded ones: free compute
slices beyond what the most instances of its smallest profile that can still be placed would use.
The smallest profile takes one compute slice and the fewest memory slices, so nothing packs more
compute onto the GPU; what is left over is cut off by where the instances in use sit (fragmentation,
which only their release undoes: nobody moves a running instance). `sharing status` and the metrics
show it per GPU.

A claim that waits because no GPU has a placement for it is the scheduler's to report (its Event says
"cannot allocate all claims"); which node could hold it once its idle instances went is what
`sharing pools` tells a person, with their own credentials: the agent reads no other node's claims.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sharing.mig import Catalog, Placement, Profile, geometry
from sharing.mig.policy import Fit, addable, fit
from sharing.model import NodeState


@dataclass(frozen=True, slots=True)
class GpuRoom:
    """What one dynamic GPU can still take."""

    gpu: int
    uuid: str
    largest: str
    """The largest profile (placement size, then compute, then memory) with a free placement; "" for
    none."""
    largest_compute_slices: int
    free_compute_slices: int
    stranded_compute_slices: int
    """Free compute slices that no placement can use, given the instances where they are."""


def room(node: NodeState, dynamic: Collection[str], catalog: Catalog) -> tuple[GpuRoom, ...]:
    """The room of every dynamic GPU of `node` in MIG mode whose geometry is known, by index."""
    found = []
    for gpu in node.gpus:
        product = geometry(gpu, catalog) if gpu.uuid in dynamic and gpu.mig_enabled else None
        if product is None or not product.profiles:
            continue
        occupied = tuple(Placement(gi.profile, gi.start, gi.size) for gi in gpu.instances)
        fits = sorted((p for p in product.profiles if fit(product, occupied, p.name) is Fit.FITS), key=_name)
        largest = max(fits, key=_rank, default=None)  # of equals, the first by name (`1g.5gb`, not `+me`)
        known = [product.profile(gi.profile) for gi in gpu.instances]
        used = sum(p.compute_slices if p is not None else product.compute_slices for p in known)
        free = max(0, product.compute_slices - used)
        smallest = min(product.profiles, key=lambda p: (p.compute_slices, p.size, p.memory_mib, p.name))
        usable = addable(product, occupied, smallest.name) * smallest.compute_slices
        found.append(
            GpuRoom(
                gpu.index,
                gpu.uuid,
                largest.name if largest is not None else "",
                largest.compute_slices if largest is not None else 0,
                free,
                max(0, free - usable),
            )
        )
    return tuple(found)


def _rank(profile: Profile) -> tuple[int, int, int]:
    return profile.size, profile.compute_slices, profile.memory_mib


def _name(profile: Profile) -> str:
    return profile.name
