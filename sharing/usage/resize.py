"""One GPU of `sharing recommend`: its held MIG devices at their right size, and its free room (pure).

The policy is `sharing.usage.recommend`'s (read it there); this is the planning of one GPU in MIG mode
whose profiles are known: which held instances stay and which change, whether the right sizes fit
around the free devices where they are, the largest plain profiles that fit what is left (each step
asked of the exact planner, `sharing.mig.plan`), and whether the agent, which never destroys a held
device, would have to wait for a pod before it can apply it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sharing.mig import Existing, Plan, Product, plan_gpu
from sharing.mig.rightsize import candidates
from sharing.model import Gpu, GpuInstance


@dataclass(frozen=True, slots=True)
class Held:
    """A held slice as the agent's status shows it."""

    id: str
    device: str
    """The GPU or MIG device it is (a replica's device)."""
    resource: str
    holder: str
    """`namespace/pod/container`, or `claim namespace/name`."""
    replica: bool
    right: str | None
    """Its right size (None: not known yet, or no profile holds it)."""
    why: str = ""


@dataclass(frozen=True, slots=True)
class Change:
    """A held MIG device the new layout gives its pod at another size."""

    holder: str
    device: str
    profile: str
    to: str
    waits: bool = False
    """The rollout waits for this pod (or drain mode evicts it): the new layout cannot be made around
    its instance. False: the agent keeps its instance while it runs (the layout has its profile, with
    room around it), and it becomes free room once the pod ends."""


@dataclass(frozen=True, slots=True)
class GpuAdvice:
    index: int
    uuid: str
    product: str
    rule: dict[str, Any]
    resized: bool
    """True: a MIG layout is proposed; False: the GPU is kept as it is (`note` says what it is)."""
    note: str = ""
    held: tuple[str, ...] = ()
    """The profiles of its held MIG devices now."""
    right_sized: tuple[str, ...] = ()
    """What the new layout gives them."""
    free_room: tuple[str, ...] = ()
    """Every device of the new layout no pod holds: the free ones as they are, and `made`."""
    made: tuple[str, ...] = ()
    """The devices made of what the right sizes give back (and of slices no device used)."""
    frees: tuple[int, int] = (0, 0)
    """Compute and memory slices the held ones give back at their right size."""
    room: tuple[int, int] = (0, 0)
    """Compute and memory slices of the free room."""
    changes: tuple[Change, ...] = ()
    waits: bool = False
    """The rollout of this GPU waits for pods (`Change.waits`)."""
    fits: tuple[Held, ...] = ()
    largest: str | None = None
    """On a GPU without MIG mode: its largest MIG profile (a right size that large: none is smaller
    than the whole GPU)."""
    """On a GPU without MIG mode: its held replicas and the MIG profile that would hold each."""


def per_profile(gpu: Gpu, counts: Mapping[str, int]) -> dict[str, int]:
    """Per MIG profile, the replicas its devices offer (`counts`: per device; one rule gives every
    device of a profile the same count); profiles without replicas left out."""
    found: dict[str, int] = {}
    for gi, ci in gpu.mig_devices:
        found[gi.profile] = max(found.get(gi.profile, 0), counts.get(ci.uuid, 0))
    return {p: n for p, n in sorted(found.items()) if n > 1}


def resize(gpu: Gpu, product: Product, held: Sequence[Held], replicas: Mapping[str, int]) -> GpuAdvice:
    """The advice for one GPU in MIG mode (`replicas`: per device, the time-sliced replicas it offers)."""
    kept, changed = _held_instances(gpu, held)
    free = {
        gi.id: gi
        for gi in gpu.instances
        if gi.compute_instances and gi.id not in kept and gi.id not in changed
    }
    after = Counter(gi.profile for gi in kept.values()) + Counter(c.to for _, c in changed.values())
    note, stay = "", free
    if not _feasible(product, _existing(kept | free), after + _profiles(free)):
        note, stay = "its free devices move to make room for the right sizes", {}
        if not _feasible(product, _existing(kept), after):
            note = "its held slices' right sizes cannot be placed around the others: they stay as they are"
            kept |= {i: gi for i, (gi, _) in changed.items()}
            changed, stay = {}, free
            after = Counter(gi.profile for gi in kept.values())
    base = after + _profiles(stay)
    want = _fill(product, _existing(kept | stay), base)
    holding = [*kept.values(), *(gi for gi, _ in changed.values())]
    waits = bool(changed) and not _placeable(product, gpu, set(kept) | set(changed), want)
    blocking = {i for i in changed if not _placeable(product, gpu, set(kept) | {i}, want)}
    if waits and not blocking:  # only together do they stand in the way: each is waited for
        blocking = set(changed)
    by_start = sorted(changed.items(), key=lambda x: x[1][0].start)
    before, now = _slices(product, [gi.profile for gi in holding]), _slices(product, list(after.elements()))
    rule: dict[str, Any] = {"devices": [gpu.index], "mig": dict(sorted(want.items()))}
    replicas = {p: n for p, n in per_profile(gpu, replicas).items() if p in want}
    if replicas:
        rule["replicas"] = replicas
    return GpuAdvice(
        gpu.index, gpu.uuid, gpu.product, rule, True, note,
        held=tuple(sorted(gi.profile for gi in holding)),
        right_sized=tuple(sorted(after.elements())),
        free_room=tuple(_largest_first(product, (want - after).elements())),
        made=tuple(_largest_first(product, (want - base).elements())),
        frees=(before[0] - now[0], before[1] - now[1]),
        room=(product.compute_slices - now[0], product.slots - now[1]),
        changes=tuple(replace(c, waits=i in blocking) for i, (_, c) in by_start),
        waits=waits,
    )  # fmt: skip


def _held_instances(
    gpu: Gpu, held: Sequence[Held]
) -> tuple[dict[int, GpuInstance], dict[int, tuple[GpuInstance, Change]]]:
    """The GPU instances held: those kept as they are, and those the new layout gives their pod at its
    right size (a MIG device held whole by one pod whose right size is another profile)."""
    by_device: dict[str, list[Held]] = {}
    for h in held:
        by_device.setdefault(h.device, []).append(h)
    kept: dict[int, GpuInstance] = {}
    changed: dict[int, tuple[GpuInstance, Change]] = {}
    for gi, ci in gpu.mig_devices:
        holders = by_device.get(ci.uuid, [])
        one = holders[0] if len(holders) == 1 and not holders[0].replica else None
        if one is not None and one.right is not None and one.right != gi.profile:
            changed[gi.id] = (gi, Change(one.holder, ci.uuid, gi.profile, one.right))
        elif holders:
            kept[gi.id] = gi
    return kept, changed


def _placeable(product: Product, gpu: Gpu, busy: set[int], want: Counter[str]) -> bool:
    """Whether the agent can make `want` while the instances `busy` (by GPU instance id) are held: it
    keeps a held instance whose profile is wanted, and never destroys one."""
    existing = [Existing(gi.profile, gi.start, busy=gi.id in busy) for gi in gpu.instances]
    return isinstance(plan_gpu(product, existing, want), Plan)


def _existing(instances: Mapping[int, GpuInstance]) -> list[Existing]:
    """Instances that stay where they are, as the planner takes them."""
    return [Existing(gi.profile, gi.start, busy=True) for gi in instances.values()]


def _profiles(instances: Mapping[int, GpuInstance]) -> Counter[str]:
    return Counter(gi.profile for gi in instances.values())


def _feasible(product: Product, fixed: list[Existing], want: Counter[str]) -> bool:
    return isinstance(plan_gpu(product, fixed, want), Plan)


def _fill(product: Product, fixed: list[Existing], need: Counter[str]) -> Counter[str]:
    """`need` and the largest plain profiles that still fit around `fixed`, largest first."""
    want = Counter(need)
    for profile in _largest_first(product, (p.name for p in candidates(product))):
        limit = product.require_profile(profile).max_count
        while want[profile] < limit and _feasible(product, fixed, want + Counter({profile: 1})):
            want[profile] += 1
    return want


def _largest_first(product: Product, names: Iterable[str]) -> list[str]:
    def size(name: str) -> tuple[int, int, int, str]:
        p = product.require_profile(name)
        return (-p.compute_slices, -p.memory_mib, -p.size, p.name)

    return sorted(names, key=size)


def _slices(product: Product, profiles: Sequence[str]) -> tuple[int, int]:
    """Compute and memory slices (placement slots) of these profiles."""
    found = [product.require_profile(p) for p in profiles]
    return sum(p.compute_slices for p in found), sum(p.size for p in found)
