"""What must hold on a GPU node at every instant, judged from the outside.

The judges read the simulated hardware's state file, the kubelet's device manager (PodResources
`GetAllocatableResources`: its healthy devices, read live) and the kubelet's pods (harness `/pods`),
never the agent. What a config should give is in `tests.e2e.wanted`.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from lab.deadlines import scaled

from sharing.kubelet.api import podresources_v1_pb2 as podresources
from sharing.kubelet.api import podresources_v1_pb2_grpc as podresources_grpc

GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
SHARED = ".shared"
REPLICA = "::"


# --- the hardware ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuHw:
    index: int
    uuid: str
    product: str
    mig: bool
    """MIG mode as it is now (not pending)."""
    devices: Mapping[str, str]
    """MIG device UUID -> profile (a compute instance spanning its whole GPU instance)."""


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[GpuHw, ...]
    busy: frozenset[str] = frozenset()
    """GPU and MIG UUIDs on which NVML reports processes."""

    def gpu(self, uuid: str) -> GpuHw | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def mig(self, uuid: str) -> tuple[GpuHw, str] | None:
        """(its GPU, its profile) for a MIG device UUID."""
        return next(((g, g.devices[uuid]) for g in self.gpus if uuid in g.devices), None)

    def kind(self, uuid: str) -> str | None:
        """`gpu` (a GPU with MIG off), `gpu in MIG mode`, a MIG profile, or None (no such device)."""
        gpu = self.gpu(uuid)
        if gpu is not None:
            return "gpu in MIG mode" if gpu.mig else "gpu"
        mig = self.mig(uuid)
        return mig[1] if mig is not None else None


def read_hardware(path: Path) -> Hardware:
    """The simulated GPUs as they are. The file is replaced atomically on every change, so reading it
    without the simulator's lock gives one consistent version (and cannot wait on a stopped agent)."""
    state = json.loads(path.read_text("utf-8"))
    gpus = []
    busy = set()
    for g in state["gpus"]:
        profiles = {p["id"]: (p["name"], p["slices"]) for p in (g.get("mig") or {}).get("profiles", [])}
        devices = {}
        for gi in g["gpuInstances"]:
            name, slices = profiles[gi["profileId"]]
            for ci in gi["computeInstances"]:
                # A compute instance with fewer slices than its GPU instance is not a MIG device of that
                # profile (the agent never makes one; the judge must not take it for one either).
                devices[ci["uuid"]] = name if ci["size"] == slices else f"{name} (partial)"
                if ci["processes"]:
                    busy.add(ci["uuid"])
        if g["processes"]:
            busy.add(g["uuid"])
        gpus.append(GpuHw(g["index"], g["uuid"], g["product"], bool(g["migCurrent"]), devices))
    return Hardware(tuple(gpus), frozenset(busy))


# --- what the kubelet has -------------------------------------------------------------------------


def allocatable(socket: Path, timeout: float = 10) -> dict[str, set[str]]:
    """{resource: healthy device IDs} from the kubelet's device manager, as it is at this moment.

    The kubelet limits PodResources to 100 requests/s (bursts of 10) for all its clients together;
    a request it turns away is asked again a moment later, until `timeout`.
    """
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = podresources_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
        while True:
            try:
                reply = stub.GetAllocatableResources(
                    podresources.AllocatableResourcesRequest(), timeout=timeout
                )
                break
            except grpc.RpcError as err:
                if err.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # the rate limiter refills a token every 10 ms
    found: dict[str, set[str]] = defaultdict(set)
    for entry in reply.devices:
        found[entry.resource_name].update(entry.device_ids)
    return dict(found)


@dataclass(frozen=True)
class Held:
    pod: str
    resource: str
    device_id: str

    @property
    def uuid(self) -> str:
        return base(self.device_id)

    @property
    def replica(self) -> bool:
        return REPLICA in self.device_id


def holdings(pods: Iterable[Mapping[str, Any]]) -> list[Held]:
    """Every device ID every active pod holds (harness `/pods`), with the resource it was allocated as."""
    return [
        Held(f"{p['namespace']}/{p['name']}", resource, device_id)
        for p in pods
        for c in p["containers"]
        for resource, ids in c["devices"].items()
        for device_id in ids
    ]


def base(device_id: str) -> str:
    """The device a device ID names (a replica ID without its `::n`)."""
    return device_id.partition(REPLICA)[0]


def resource_kind(resource: str) -> str | None:
    """`gpu`, a MIG profile, or None for a resource that is not a GPU's (mixed strategy, `.shared` too)."""
    name = resource.removesuffix(SHARED)
    if name == GPU:
        return "gpu"
    if name.startswith(MIG_PREFIX):
        profile = name[len(MIG_PREFIX) :]
        return profile[: -len(".me")] + "+me" if profile.endswith(".me") else profile
    return None


# --- the invariants -------------------------------------------------------------------------------


def violations(
    hw: Hardware,
    offered: Mapping[str, Iterable[str]],
    pods: Iterable[Mapping[str, Any]],
    busy: Mapping[str, str],
) -> list[str]:
    """Everything wrong on the node at one instant; empty when all is well.

    `offered`: the kubelet's healthy devices per resource; `busy`: devices the test started work
    on, with the kind each had then.
    """
    found: list[str] = []
    for resource, ids in sorted(offered.items()):
        kind = resource_kind(resource)
        for device_id in sorted(ids):
            problem = _mismatch(hw, base(device_id), kind)
            if problem:
                found.append(f"the kubelet offers {resource} {device_id}, but {problem}")
    held = holdings(pods)
    for h in held:
        problem = _mismatch(hw, h.uuid, resource_kind(h.resource))
        if problem:
            found.append(f"pod {h.pod} holds {h.resource} {h.device_id}, but {problem}")
    found += _double_booked(hw, held)
    for uuid, kind in sorted(busy.items()):
        if hw.kind(uuid) != kind:
            found.append(f"{uuid} runs processes as a {kind}, but it is now {hw.kind(uuid) or 'gone'}")
    return found


def _mismatch(hw: Hardware, uuid: str, kind: str | None) -> str:
    """Why the device `uuid` is not a device of `kind` on the hardware ("" when it is)."""
    actual = hw.kind(uuid)
    if kind == "gpu":
        if actual == "gpu in MIG mode":
            return "that GPU is in MIG mode: it is advertised or handed out as a whole GPU"
        return "" if actual == "gpu" else f"it is {actual or 'no GPU on the hardware'}"
    if actual is None:
        return "no such MIG device exists on the hardware"
    return "" if actual == kind else f"it is a {actual} on the hardware, not a {kind}"


def _double_booked(hw: Hardware, held: list[Held]) -> list[str]:
    """Devices two pods hold in a way that shares what one of them holds exclusively."""
    found = []
    by_id: dict[str, set[str]] = defaultdict(set)
    by_device: dict[str, list[Held]] = defaultdict(list)
    for h in held:
        by_id[h.device_id].add(h.pod)
        by_device[h.uuid].append(h)
    for device_id, pods in sorted(by_id.items()):
        if len(pods) > 1:
            found.append(f"device ID {device_id} is held by pods {sorted(pods)}")
    for uuid, hs in sorted(by_device.items()):
        exclusive = sorted({h.pod for h in hs if not h.replica})
        others = sorted({h.pod for h in hs} - set(exclusive[:1]))
        if exclusive and others:
            what = ", ".join(sorted(f"{h.pod}: {h.resource} {h.device_id}" for h in hs))
            found.append(f"{uuid} is held exclusively by {exclusive[0]} and also by {others} ({what})")
    # A GPU held whole while pods hold its MIG devices needs no rule of its own: MIG devices exist
    # only in MIG mode, and a GPU in MIG mode held whole is already wrong (`_mismatch`).
    return found
