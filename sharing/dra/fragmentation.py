"""Fragmentation made visible: a claim waits for a MIG profile that the free memory and compute of a
dynamic GPU would hold, but no placement does (pure: no I/O).

The kube-scheduler allocates a device only where its counters fit (KEP-4815), so such a claim stays
Pending and the scheduler says only that no device fits. Nobody moves running instances to make the
room whole; what the agent can do is say so: this finds those claims from the pool as it is now (the
placements allocated to claims and the instances that exist, `sharing.dra.partitions`) with the
placement policy's check (`sharing.mig.policy.fit`). A claim names a profile through its per-profile
DeviceClass `mig-<profile>.nvidia.com` (`+` written `.`, as the chart names them); claims of other
classes ask for something this cannot judge and are left out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from sharing.dra.partitions import allocated_placements
from sharing.kube.api import PendingClaim
from sharing.mig import Catalog, Placement, Product, geometry
from sharing.mig.policy import Fit, fit
from sharing.model import NodeState


@dataclass(frozen=True, slots=True)
class Fragmented:
    """A pending claim's profile that fits the free memory and compute of `gpus` but no placement."""

    namespace: str
    name: str
    profile: str
    gpus: tuple[int, ...]

    def describe(self) -> str:
        which = ", ".join(str(g) for g in self.gpus)
        return (
            f"claim {self.namespace}/{self.name} waits for a {self.profile} MIG device: GPU {which} has "
            "the free memory and compute for it but no free placement (the free memory slices are not "
            "contiguous around the instances in use); it fits once instances there are released"
        )


def class_profile(device_class: str, product: Product) -> str | None:
    """The profile a per-profile DeviceClass (`mig-1g.5gb.nvidia.com`) names on this product."""
    for profile in product.profiles:
        if device_class == f"mig-{profile.name.replace('+', '.')}.nvidia.com":
            return profile.name
    return None


def fragmented_claims(
    node: NodeState,
    dynamic: Collection[str],
    catalog: Catalog,
    *,
    allocated: Iterable[str],
    pending: Sequence[PendingClaim],
) -> tuple[Fragmented, ...]:
    """The pending claims whose profile fits no dynamic GPU but is FRAGMENTED on at least one."""
    allocated = tuple(allocated)
    gpus: list[tuple[int, Product, tuple[Placement, ...]]] = []
    for gpu in node.gpus:
        product = geometry(gpu, catalog) if gpu.uuid in dynamic and gpu.mig_enabled else None
        if product is None or not product.profiles:
            continue
        existing = {Placement(gi.profile, gi.start, gi.size) for gi in gpu.instances}
        occupied = tuple(sorted(existing | set(allocated_placements(product, gpu.index, allocated))))
        gpus.append((gpu.index, product, occupied))
    found: list[Fragmented] = []
    for claim in pending:
        for device_class in claim.classes:
            verdicts = [
                (index, fit(product, occupied, profile))
                for index, product, occupied in gpus
                if (profile := class_profile(device_class, product)) is not None
            ]
            if not verdicts or any(v is Fit.FITS for _, v in verdicts):
                continue
            where = tuple(i for i, v in verdicts if v is Fit.FRAGMENTED)
            if where:
                profile = next(
                    p for _, product, _ in gpus if (p := class_profile(device_class, product)) is not None
                )
                found.append(Fragmented(claim.namespace, claim.name, profile, where))
    return tuple(found)
