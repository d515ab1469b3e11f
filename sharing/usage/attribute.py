"""Whose are the GPU processes: each held slice gets its own pod's processes, the rest is unattributed (pure).

A slice (a GPU, a MIG device, or a replica of either) is held by a pod (PodResources; on the DRA
front-end, the pods of the claim allocated its device). A process on a device counts for the slice of
that device its pod holds: on a time-sliced or MPS GPU each pod gets its own processes' memory and SM
share, never the device's figure copied to every pod that shares it. A pod holding several replicas
of one device has its processes counted once, on the first of them (by ID) that its container holds.
A process of no pod, of a pod this agent does not know, or of a pod that holds no slice of that
device is unattributed (and counted so, never dropped).

SM per slice: on a GPU without MIG, the sum of its processes' shares (NVML's per-process
utilization); on a MIG device held whole, its GPU instance's GPM activity (Hopper and newer); on a
replica of a MIG device, none: NVML has no per-process utilization in MIG mode, and the instance's
activity is not one replica's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sharing.devices import REPLICA_SEPARATOR, Inventory
from sharing.model import BoundPod, ClaimHold, Holding
from sharing.readings import DeviceReading, NodeReadings, ProcessReading
from sharing.usage.cgroup import PodProcess


@dataclass(frozen=True, slots=True, order=True)
class HeldSlice:
    """One advertised slice and the pod (container) holding it."""

    resource: str
    device: str
    """The slice's ID as advertised: a GPU or MIG UUID, or a replica `<uuid>::<n>`."""
    uuid: str
    """The GPU or MIG device it is (a replica's device)."""
    gpu: str
    """The GPU's UUID."""
    namespace: str
    pod: str
    container: str
    """The holding container's name ("" on DRA: a claim is the pod's)."""
    memory_limit_bytes: int | None = None
    """The most it may use where something limits it (an MPS client's pinned memory)."""

    @property
    def replica(self) -> bool:
        return REPLICA_SEPARATOR in self.device


@dataclass(frozen=True, slots=True)
class SliceUse:
    """What the holder of one slice uses of it now."""

    held: HeldSlice
    memory_used_bytes: int
    memory_total_bytes: int | None
    """Its device's memory (a MIG device's own), or the limit of an MPS client."""
    sm: float | None
    """Its share of the device's SMs (0..1); None where NVML cannot tell it apart (see the module)."""
    processes: tuple[int, ...]
    """The host PIDs counted for it."""


@dataclass(frozen=True, slots=True)
class Unattributed:
    """What processes on one device use that no slice's holder accounts for."""

    gpu: str
    device: str
    memory_used_bytes: int
    pids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Attribution:
    slices: tuple[SliceUse, ...] = ()
    unattributed: tuple[Unattributed, ...] = ()


@dataclass(frozen=True, slots=True)
class Pod:
    """A pod the API server bound to this node, as attribution needs it."""

    namespace: str
    name: str
    containers: Mapping[str, str]
    """Container ID -> name."""


def pods_by_uid(pods: Iterable[BoundPod]) -> dict[str, Pod]:
    """The pods the agent listed (`list_node_pods`), by UID."""
    return {p.uid: Pod(p.namespace, p.name, dict(p.containers)) for p in pods if p.uid}


def held_slices(
    inventory: Inventory,
    holdings: Sequence[Holding],
    claims: Sequence[ClaimHold] = (),
    mps_limits: Mapping[str, int] | None = None,
) -> tuple[HeldSlice, ...]:
    """Every advertised slice a pod holds: its container per PodResources, or the pods of the
    ResourceClaim allocated its device (DRA). `mps_limits`: per GPU or MIG UUID, the pinned memory
    each MPS client of it may use, in bytes."""
    owners = {(h.resource, d): h for h in holdings for d in h.device_ids}
    found: set[HeldSlice] = set()
    for resource, devices in inventory.resources:
        for device in devices:
            limit = (mps_limits or {}).get(device.uuid) if device.mps else None
            holder = owners.get((resource, device.id))
            if holder is not None:
                where = (resource, device.id, device.uuid, device.gpu_uuid)
                found.add(HeldSlice(*where, holder.namespace, holder.pod, holder.container, limit))
            for claim in claims:
                if device.uuid in claim.uuids:
                    for pod in claim.pods:
                        namespace, _, name = pod.partition("/")
                        found.add(
                            HeldSlice(
                                resource, device.id, device.uuid, device.gpu_uuid, namespace, name, "", limit
                            )
                        )
    return tuple(sorted(found))


def attribute(
    readings: NodeReadings,
    held: Sequence[HeldSlice],
    owners: Mapping[int, PodProcess],
    pods: Mapping[str, Pod],
) -> Attribution:
    """Each held slice's use, and what no holder accounts for (see the module)."""
    devices = {d.uuid: (g.uuid, d) for g in readings.gpus for d in g.devices}
    by_device: dict[str, list[HeldSlice]] = {}
    for s in sorted(held):
        by_device.setdefault(s.uuid, []).append(s)
    counted: dict[HeldSlice, list[ProcessReading]] = {s: [] for s in held}
    unattributed: dict[str, tuple[str, list[ProcessReading]]] = {}
    for gpu, device, process in readings.processes():
        owner = owners.get(process.pid)
        pod = pods.get(owner.pod_uid) if owner is not None else None
        slot = None
        if owner is not None and pod is not None:
            container = pod.containers.get(owner.container_id or "", "")
            theirs = [
                s for s in by_device.get(device.uuid, ()) if (s.namespace, s.pod) == (pod.namespace, pod.name)
            ]
            slot = next((s for s in theirs if s.container == container), theirs[0] if theirs else None)
        if slot is not None:
            counted[slot].append(process)
        else:
            unattributed.setdefault(device.uuid, (gpu.uuid, []))[1].append(process)
    uses = []
    for s in sorted(held):
        read = devices.get(s.uuid)
        reading = read[1] if read is not None else None
        total = s.memory_limit_bytes
        if total is None and reading is not None:
            total = reading.memory_total_bytes
        mine = counted[s]
        memory = sum(p.memory_bytes or 0 for p in mine)
        uses.append(SliceUse(s, memory, total, _sm(s, reading, mine), tuple(sorted(p.pid for p in mine))))
    rest = tuple(
        Unattributed(gpu, uuid, sum(p.memory_bytes or 0 for p in left), tuple(sorted(p.pid for p in left)))
        for uuid, (gpu, left) in sorted(unattributed.items())
    )
    return Attribution(tuple(uses), rest)


def _sm(held: HeldSlice, device: DeviceReading | None, processes: Sequence[ProcessReading]) -> float | None:
    if device is None:
        return None
    if device.gpu_instance is None:  # a GPU without MIG: its processes' own shares
        shares = [p.sm for p in processes]
        if any(s is None for s in shares):
            return None
        return min(1.0, sum(s or 0.0 for s in shares))
    return None if held.replica else device.sm_active
