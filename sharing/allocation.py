"""Allocation policy: which devices to prefer for a container, and what Allocate hands it.

The kubelet asks GetPreferredAllocation for a hint and then Allocate for what the container gets:
by NVIDIA's device-list strategies (one or several) `envvar` (NVIDIA_VISIBLE_DEVICES), `volume-mounts`
(/dev/null mounted at /var/run/nvidia-container-devices/<id>, the variable naming that directory),
`cdi-annotations` (CDI device names in a pod annotation) and `cdi-cri` (CDI device names in the CRI
field); devices named by UUID or by index (`0`, or `0:1` for MIG device 1 of GPU 0). When every
chosen strategy is CDI, no variable and no mount are added, as NVIDIA's plugin does.
Replicas and MIG devices are spread over distinct physical GPUs by default (least-loaded GPU first;
the NVIDIA plugin groups MIG devices by their own UUID and so cannot), or packed onto the busiest
GPU; full GPUs are kept on one NUMA node when the node knows it. Pure: devices in, IDs out.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sharing.errors import PluginError
from sharing.inventory import Device, DeviceId
from sharing.text import listed

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"
CDI_KIND = "k8s.gpu-sharing.io/gpu"
"""The CDI kind (vendor/class) of the spec the agent writes; its own, so it never collides with the
specs NVIDIA's tools generate (`nvidia.com/gpu`, `k8s.device-plugin.nvidia.com/gpu`)."""
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


class DeviceListStrategy(enum.Enum):
    """How Allocate hands devices to a container (NVIDIA's names and meanings)."""

    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI_CRI = "cdi-cri"


class DeviceIdStrategy(enum.Enum):
    """How devices are named to the container runtime."""

    UUID = "uuid"
    INDEX = "index"


@dataclass(frozen=True, slots=True)
class Injection:
    """The device-list strategies (at least one) and the device ID strategy."""

    strategies: frozenset[DeviceListStrategy] = frozenset({DeviceListStrategy.ENVVAR})
    ids: DeviceIdStrategy = DeviceIdStrategy.UUID

    @property
    def cdi(self) -> bool:
        """True when a CDI strategy is chosen: the agent writes its CDI spec."""
        return bool(self.strategies & {DeviceListStrategy.CDI_ANNOTATIONS, DeviceListStrategy.CDI_CRI})


ENVVAR_BY_UUID = Injection()
"""The default: NVIDIA_VISIBLE_DEVICES with UUIDs."""


def device_name(device: Device, ids: DeviceIdStrategy) -> str:
    """What the container runtime is told: the UUID, or the index (`0`, `0:1`)."""
    return device.index if ids is DeviceIdStrategy.INDEX and device.index else device.uuid


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
    known: dict[str, Device] = {d.id: d for d in devices}
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
    # Inventory order, not the kubelet's (which is random): equal choices always come out the same.
    rank = {d.id: n for n, d in enumerate(devices)}
    pool = sorted((known[i] for i in set(available) if i in known), key=lambda d: rank[d.id])
    candidates = [d for d in pool if d.id not in must]
    needed = size - len(must)
    if needed > len(candidates):
        raise AllocationError(
            f"{resource}: {size} devices asked for, but only {len(must) + len(candidates)} of the available"
            " ones are advertised by this node"
        )
    chosen = [known[i] for i in must]
    if all(d.mig_uuid is None and d.replica is None for d in devices):
        picks = _by_numa(chosen, candidates, needed)
    else:
        picks = _by_physical_gpu(
            devices, pool=pool, chosen=chosen, candidates=candidates, needed=needed, policy=policy
        )
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
    known: dict[str, Device] = {d.id: d for d in devices}
    unknown = [i for i in requested if i not in known]
    if unknown:
        raise AllocationError(
            f"{resource}: unknown device IDs {_ids(unknown)}: this node does not advertise them"
            " (the devices changed since the pod was scheduled; delete the pod to reschedule it)"
        )
    chosen = [known[i] for i in requested]
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
    devices: Sequence[Device],
    *,
    pool: list[Device],
    chosen: list[Device],
    candidates: list[Device],
    needed: int,
    policy: AllocationPolicy,
) -> list[Device]:
    """Shared devices: greedy by load (held by others + picked here) of the physical GPU, then of
    the device itself (a MIG device's replicas), then inventory order."""
    levels: tuple[Callable[[Device], str], ...] = (lambda d: d.gpu_uuid, lambda d: d.uuid)
    total = [Counter(level(d) for d in devices) for level in levels]
    free = [Counter(level(d) for d in pool) for level in levels]
    picked = [Counter(level(d) for d in chosen) for level in levels]
    rank = {d.id: n for n, d in enumerate(devices)}
    sign = -1 if policy is AllocationPolicy.PACKED else 1

    def key(d: Device) -> tuple[int, ...]:
        loads: list[int] = []
        for n, level in enumerate(levels):
            k = level(d)
            loads += [sign * (total[n][k] - free[n][k] + picked[n][k]), sign * picked[n][k]]
        return (*loads, rank[d.id])

    # The candidates of one device (its replicas) share their loads, so the best of them is the
    # first in inventory order: each pick compares one head per device, not every candidate.
    queues: dict[str, list[Device]] = {}
    for d in candidates:
        queues.setdefault(d.uuid, []).append(d)
    heads = dict.fromkeys(queues, 0)
    picks: list[Device] = []
    for _ in range(needed):
        device = min((u for u in queues if heads[u] < len(queues[u])), key=lambda u: key(queues[u][heads[u]]))
        best = queues[device][heads[device]]
        heads[device] += 1
        picks.append(best)
        for n, level in enumerate(levels):
            picked[n][level(best)] += 1
    return picks


def _ids(ids: Sequence[str]) -> str:
    return listed(ids)
