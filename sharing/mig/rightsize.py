"""The right size of a slice: the smallest MIG profile of its GPU that holds what its pod used (pure).

From a held slice's window (`sharing.usage.window`): its peak memory and, where it is known, its SM
p95. A profile holds it when its memory is at least the peak plus HEADROOM (10 %), and, where an SM
figure is known, when its compute slices are at least the p95's share of the compute slices the
slice has now (a MIG device: its profile's; a whole GPU or a replica of one: the GPU's), since NVML
gives a MIG device's SM activity relative to its own GPU instance (GPM SM_UTIL) and a process's on a
whole GPU relative to the GPU (nvmlDeviceGetProcessUtilization). Where no SM figure is known (MIG
before Hopper, a replica of a MIG device) memory alone decides, and the basis says so.

The smallest is the one with the fewest compute slices, then the least memory, then the fewest
placement slots. A slice on a profile with an extension (`1g.10gb+me`: media engines) is sized among
the profiles with the same extension, so a pod that needs the engines keeps them; every other slice
among the plain profiles. The right size may be larger than the slice: a pod near its slice's limit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sharing.mig.catalog import MIB, Product, Profile

HEADROOM_PERCENT = 10
HEADROOM = HEADROOM_PERCENT / 100
"""Memory above the peak a right size keeps free."""


class Basis(enum.Enum):
    """What decided a right size."""

    MEMORY = "memory"
    """The peak memory alone: no SM figure is known for the slice."""
    MEMORY_SM = "memory+sm"
    """The peak memory and the SM p95."""


@dataclass(frozen=True, slots=True)
class RightSize:
    """The smallest profile that holds a slice's use, or None when no profile of its GPU does."""

    profile: str | None
    basis: Basis
    peak_bytes: int
    sm_p95: float | None
    memory_bytes: int
    """The memory it needs: the peak plus HEADROOM."""
    compute_slices: float | None
    """The compute slices its SM p95 needs (None: memory only)."""
    why: str = ""
    """Why no profile holds it (empty when one does)."""


def extension(profile: str | None) -> str:
    """`me` of `1g.10gb+me`; empty for a plain profile or a whole GPU."""
    return (profile or "").partition("+")[2]


def right_size(
    product: Product,
    peak_bytes: int,
    sm_p95: float | None,
    *,
    compute_slices: int,
    family: str = "",
) -> RightSize:
    """The right size on `product` of a slice that spans `compute_slices` now, of profiles with the
    extension `family` (see the module)."""
    memory = -(-peak_bytes * (100 + HEADROOM_PERCENT) // 100)  # rounded up, in whole bytes
    compute = None if sm_p95 is None else sm_p95 * compute_slices
    basis = Basis.MEMORY if compute is None else Basis.MEMORY_SM
    fits = [p for p in candidates(product, family) if _holds(p, memory, compute)]
    if fits:
        return RightSize(fits[0].name, basis, peak_bytes, sm_p95, memory, compute)
    largest = candidates(product, family)[-1:]
    why = (
        f"no MIG profile of {product.name} holds {_gib(memory)} GiB"
        + ("" if compute is None else f" and {compute:.2g} compute slices")
        + (f" (the largest is {largest[0].name})" if largest else "")
    )
    return RightSize(None, basis, peak_bytes, sm_p95, memory, compute, why)


def candidates(product: Product, family: str = "") -> list[Profile]:
    """The profiles a right size is chosen from, smallest first."""
    return sorted(
        (p for p in product.profiles if extension(p.name) == family),
        key=lambda p: (p.compute_slices, p.memory_mib, p.size, p.name),
    )


def _holds(profile: Profile, memory: int, compute: float | None) -> bool:
    # A p95 is a bin's upper edge (a multiple of 5 %): allow for the float product's rounding.
    return profile.memory_mib * MIB >= memory and (
        compute is None or profile.compute_slices >= compute - 1e-9
    )


def _gib(value: int) -> str:
    return f"{value / (1 << 30):.1f}"
