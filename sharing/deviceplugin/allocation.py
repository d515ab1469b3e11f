"""Allocation policy: which devices to prefer for a container, and what Allocate hands it.

The kubelet asks GetPreferredAllocation for a hint and then Allocate for what the container gets:
by NVIDIA's device-list strategies (one or several) `envvar` (NVIDIA_VISIBLE_DEVICES), `volume-mounts`
(/dev/null mounted at /var/run/nvidia-container-devices/<id>, the variable naming that directory),
`cdi-annotations` (CDI device names in a pod annotation) and `cdi-cri` (CDI device names in the CRI
field); devices named by UUID or by index (`0`, or `0:1` for MIG device 1 of GPU 0). When every
chosen strategy is CDI, no variable and no mount are added, as NVIDIA's plugin does. A replica shared
with MPS also gets its GPU's MPS pipe directory and shared memory (`sharing.devices.mps`), through
the CDI spec when a CDI strategy is chosen.
Replicas and MIG devices are spread over distinct physical GPUs by default (least-loaded GPU first;
the NVIDIA plugin groups MIG devices by their own UUID and so cannot), or packed onto the busiest
GPU; full GPUs are kept on one NUMA node when the node knows it. Pure: devices in, IDs out (what
is derived from a device list alone is kept per list, since the kubelet asks on every admission and
the list rarely changes).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sharing.devices import (
    CDI_KIND,
    ENVVAR_BY_UUID,
    Device,
    DeviceId,
    DeviceListStrategy,
    Health,
    Injection,
    client_edits,
    device_name,
)
from sharing.errors import PluginError
from sharing.model import GpuUuid
from sharing.text import listed

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


class AllocationPolicy(enum.Enum):
    """How shared devices (replicas, MIG devices) are chosen across physical GPUs."""

    DISTRIBUTED = "distributed"
    """Least-loaded physical GPU first: two replicas land on two GPUs when they can."""
    PACKED = "packed"
    """Most-loaded physical GPU first: keeps whole GPUs free for others."""


class AllocationError(PluginError):
    """A request the plugin refuses; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Mount:
    """A bind mount into the container."""

    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container gets: variables, mounts, annotations and CDI device names."""

    envs: tuple[tuple[str, str], ...]
    cdi_devices: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class _Index:
    """What the calls need of one device list, whatever the request."""

    devices: Sequence[Device]
    known: dict[str, Device]
    ids: frozenset[str]
    rank: dict[str, int]
    whole: bool
    """Every device is a full, unshared GPU."""
    groups: dict[str, tuple[Device, ...]]
    """The entries of each device (by UUID: its replicas, or itself), in inventory order."""
    group_ids: dict[str, frozenset[str]]
    gpu_of: dict[str, GpuUuid]
    """The physical GPU of each device UUID."""
    per_gpu: Counter[GpuUuid]
    """Entries per physical GPU."""


_INDEXES: dict[int, _Index] = {}
_INDEXES_KEPT = 64  # one per resource's current list, and a few old ones


def _index(devices: Sequence[Device]) -> _Index:
    """The index of `devices`, built once per list object (kept alive by the cache, so its id is
    not reused while cached)."""
    found = _INDEXES.get(id(devices))
    if found is not None and found.devices is devices:
        return found
    if len(_INDEXES) >= _INDEXES_KEPT:
        _INDEXES.clear()
    groups: dict[str, list[Device]] = {}
    for d in devices:
        groups.setdefault(d.uuid, []).append(d)
    index = _Index(
        devices=devices,
        known={d.id: d for d in devices},
        ids=frozenset(d.id for d in devices),
        rank={d.id: n for n, d in enumerate(devices)},
        whole=all(d.mig_uuid is None and d.replica is None for d in devices),
        groups={u: tuple(g) for u, g in groups.items()},
        group_ids={u: frozenset(d.id for d in g) for u, g in groups.items()},
        gpu_of={u: g[0].gpu_uuid for u, g in groups.items()},
        per_gpu=Counter(d.gpu_uuid for d in devices),
    )
    _INDEXES[id(devices)] = index
    return index


def preferred_allocation(
    resource: str,
    devices: Sequence[Device],
    *,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED,
) -> tuple[DeviceId, ...]:
    """`size` device IDs from `available`, `must_include` first; IDs this plugin never advertised
    are never preferred."""
    index = _index(devices)
    known = index.known
    must = list(dict.fromkeys(must_include))
    unknown = [i for i in must if i not in known]
    if unknown:
        raise AllocationError(
            f"{resource}: must-include devices {_ids(unknown)} are not advertised by this node"
        )
    offered = set(available)
    missing = [i for i in must if i not in offered]
    if missing:
        raise AllocationError(
            f"{resource}: must-include devices {_ids(missing)} are not in the available list"
        )
    if size < 1 or len(must) > size:
        raise AllocationError(
            f"{resource}: allocation size {size} is invalid with {len(must)} must-include devices"
        )
    usable = index.ids & offered  # available and advertised (must-include among them)
    needed = size - len(must)
    if needed > len(usable) - len(must):
        raise AllocationError(
            f"{resource}: {size} devices asked for, but only {len(usable)} of the available"
            " ones are advertised by this node"
        )
    chosen = [known[i] for i in must]
    if index.whole:
        # Inventory order, not the kubelet's (which is random): equal choices come out the same.
        candidates = [d for d in devices if d.id in usable and d.id not in must]
        picks = _by_numa(chosen, candidates, needed)
    else:
        picks = _by_physical_gpu(index, usable=usable, chosen=chosen, needed=needed, policy=policy)
    return tuple(d.id for d in chosen + picks)


def allocate(
    resource: str,
    devices: Sequence[Device],
    requested: Sequence[str],
    *,
    fail_requests_greater_than_one: bool = False,
    injection: Injection = ENVVAR_BY_UUID,
) -> ContainerAllocation:
    """What one container gets, per the injection strategies; AllocationError for a request to refuse."""
    if not requested:
        raise AllocationError(f"{resource}: the request names no devices")
    duplicates = [i for i, n in Counter(requested).items() if n > 1]
    if duplicates:
        raise AllocationError(f"{resource}: the request names devices more than once: {_ids(duplicates)}")
    known = _index(devices).known
    unknown = [i for i in requested if i not in known]
    if unknown:
        raise AllocationError(
            f"{resource}: unknown device IDs {_ids(unknown)}: this node does not advertise them"
            " (the devices changed since the pod was scheduled; delete the pod to reschedule it)"
        )
    chosen = [known[i] for i in requested]
    sick = [d.id for d in chosen if d.health is not Health.HEALTHY]
    if sick:
        # The kubelet picks healthy devices only; these turned unhealthy (or were withdrawn for a
        # change, kept in the list while a pod's Allocate may still be under way) as it picked them.
        raise AllocationError(
            f"{resource}: devices {_ids(sick)} are not healthy: failing, or being withdrawn for a change"
            " (they changed as the pod was admitted; delete the pod to reschedule it)"
        )
    if fail_requests_greater_than_one and len(chosen) > 1 and any(d.replica is not None for d in chosen):
        raise AllocationError(
            f"{resource}: {len(chosen)} shared devices requested, but failRequestsGreaterThanOne allows"
            " at most 1 per container; request 1, or set sharing.failRequestsGreaterThanOne: false"
        )
    # Replicas of one device are one device to the container.
    names = tuple(dict.fromkeys(device_name(d, injection.ids) for d in chosen))
    cdi_names = tuple(f"{CDI_KIND}={n}" for n in names)
    chosen_strategies = injection.strategies
    envs: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()
    if DeviceListStrategy.VOLUME_MOUNTS in chosen_strategies:
        envs = ((VISIBLE_DEVICES_ENV, DEVICE_LIST_DIR),)
        mounts = tuple(Mount(f"{DEVICE_LIST_DIR}/{n}", "/dev/null") for n in names)
    elif DeviceListStrategy.ENVVAR in chosen_strategies:
        envs = ((VISIBLE_DEVICES_ENV, ",".join(names)),)
    mps_gpus = tuple(dict.fromkeys(d.gpu_uuid for d in chosen if d.mps))
    if len(mps_gpus) > 1:
        raise AllocationError(
            f"{resource}: replicas of {len(mps_gpus)} MPS GPUs requested ({_ids(mps_gpus)}), but a"
            " container is the client of one MPS control daemon; request replicas of one GPU"
        )
    if mps_gpus and not injection.cdi:
        # With CDI the device's entry in the CDI spec carries the same (sharing.gpu.cdi).
        edits = client_edits(injection.mps_root, mps_gpus[0])
        envs += edits.env
        mounts += tuple(Mount(inside, host, read_only=False) for inside, host in edits.mounts)
    annotations: tuple[tuple[str, str], ...] = ()
    if DeviceListStrategy.CDI_ANNOTATIONS in chosen_strategies:
        # One key per resource: a container asking for two resources gets both annotations.
        key = f"{CDI_ANNOTATION_PREFIX}gpu-sharing_{resource.rpartition('/')[2]}"
        annotations = ((key, ",".join(cdi_names)),)
    return ContainerAllocation(
        envs=envs,
        cdi_devices=cdi_names if DeviceListStrategy.CDI_CRI in chosen_strategies else (),
        mounts=mounts,
        annotations=annotations,
    )


def _by_numa(chosen: list[Device], candidates: list[Device], needed: int) -> list[Device]:
    """Full GPUs: the NUMA node of must-include first, then the smallest node that fits the rest."""
    wanted = {d.numa_node for d in chosen if d.numa_node is not None}
    groups: dict[int | None, list[Device]] = {}
    for d in candidates:
        groups.setdefault(d.numa_node, []).append(d)

    def rank(node: int | None) -> tuple[bool, bool, bool, int, int]:
        size = len(groups[node])
        fits = size >= needed
        return (node not in wanted, node is None, not fits, size if fits else -size, node or 0)

    ordered = [d for node in sorted(groups, key=rank) for d in groups[node]]
    return ordered[:needed]


def _by_physical_gpu(
    index: _Index,
    *,
    usable: frozenset[str],
    chosen: list[Device],
    needed: int,
    policy: AllocationPolicy,
) -> list[Device]:
    """Shared devices: greedy by load (held by others + picked here) of the physical GPU, then of
    the device itself (a MIG device's replicas), then inventory order.

    Per device, not per entry: a device's free entries are counted by a set intersection and its
    replicas share their loads, so the best of them is its first free one in inventory order; each
    pick compares one head per device (8 for 8 GPUs x 64 replicas, not 512 entries).
    """
    must = {d.id for d in chosen}
    free_dev = {u: len(ids & usable) for u, ids in index.group_ids.items()}
    free_gpu: Counter[GpuUuid] = Counter()
    for u, n in free_dev.items():
        free_gpu[index.gpu_of[u]] += n
    picked_gpu = Counter(d.gpu_uuid for d in chosen)
    picked_dev = Counter(d.uuid for d in chosen)
    sign = -1 if policy is AllocationPolicy.PACKED else 1
    heads = {u: 0 for u, n in free_dev.items() if n}

    def head(u: str) -> Device | None:
        """The device's first entry still free to pick (advertised, available, not must-include)."""
        entries, at = index.groups[u], heads[u]
        while at < len(entries) and (entries[at].id not in usable or entries[at].id in must):
            at += 1
        heads[u] = at
        return entries[at] if at < len(entries) else None

    def key(u: str, d: Device) -> tuple[int, ...]:
        g = index.gpu_of[u]
        return (
            sign * (index.per_gpu[g] - free_gpu[g] + picked_gpu[g]), sign * picked_gpu[g],
            sign * (len(index.groups[u]) - free_dev[u] + picked_dev[u]), sign * picked_dev[u],
            index.rank[d.id],
        )  # fmt: skip

    picks: list[Device] = []
    for _ in range(needed):
        heads_now = [(u, d) for u in heads if (d := head(u)) is not None]
        u, best = min(heads_now, key=lambda pair: key(*pair))
        heads[u] += 1
        picks.append(best)
        picked_gpu[best.gpu_uuid] += 1
        picked_dev[u] += 1
    return picks


def _ids(ids: Sequence[str]) -> str:
    return listed(ids)
