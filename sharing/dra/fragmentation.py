"""Fragmentation made visible: a claim waits for a MIG profile that the free memory and compute of a
dynamic GPU would hold, but no placement does (pure: no I/O).

The kube-scheduler allocates a device only where its counters fit (KEP-4815), so such a claim stays
Pending and the scheduler says only that no device fits. Nobody moves running instances to make the
room whole; what the agent can do is say so: this finds those claims from the pool as it is now (the
placements allocated to claims and the instances that exist) with the placement policy's check
(`sharing.dra.placements.request_fit`). A claim names a profile through its per-profile DeviceClass
`mig-<profile>.nvidia.com` (`+` written `.`, as the chart names them); claims of other classes ask
for something this cannot judge and are left out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from sharing.dra.placements import request_fit
from sharing.kube.api import PendingClaim
from sharing.mig import Catalog, Product, geometry
from sharing.mig.policy import Fit
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
    """The pending claims whose profile fits no dynamic GPU but is FRAGMENTED on at least one
    (`sharing.dra.placements.request_fit`)."""
    allocated = tuple(allocated)
    products = [
        product
        for gpu in node.gpus
        if gpu.uuid in dynamic and gpu.mig_enabled and (product := geometry(gpu, catalog)) is not None
    ]
    found: list[Fragmented] = []
    for claim in pending:
        for device_class in claim.classes:
            profile = next((p for product in products if (p := class_profile(device_class, product))), None)
            if profile is None:
                continue
            kind, gpus = request_fit(node, dynamic, profile, catalog, allocated=allocated)
            if kind is Fit.FRAGMENTED:
                found.append(Fragmented(claim.namespace, claim.name, profile, gpus))
    return tuple(found)
