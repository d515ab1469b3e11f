"""What an operator asks of a node: its GPUs, every slice, who holds it, and the config in effect.

Pure: one document (plain JSON values) from what the agent knows: the observed GPUs, what the
plugins advertise (with health), who holds which device (PodResources), the config selected and
the configs in effect per GPU, the state and the last change. `sharing status` prints it for people
or as JSON, `/status` serves it, and the metrics are computed from the same document, so the
three never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sharing.config import Problem
from sharing.devices import REPLICA_SEPARATOR, Device, Inventory
from sharing.devices.inventory import mig_resource
from sharing.dra.foreign import Foreign
from sharing.dra.fragmentation import GpuRoom
from sharing.mig import Catalog, device_profile, geometry
from sharing.model import ClaimHold, Gpu, GpuUuid, Holding, NodeState
from sharing.ops.usage import gpu_usage, slice_usage, summary
from sharing.store import OwnedInstance, PreparedClaim, PreparedDevice
from sharing.usage import UsageReport


@dataclass(frozen=True, slots=True)
class ConfigStatus:
    """The config side of the status: what the node asks for and what is in effect."""

    selected: str | None = None
    """The config the node's label (or `default`) names; None: no config applies."""
    source: str = ""
    state: str | None = None
    """The `nvidia.com/mig.config.state` value (pending, success, failed)."""
    in_effect: Mapping[str, str | None] = field(default_factory=dict)
    """Per GPU UUID, the name of the config last applied to it."""
    last_change: Mapping[str, str] = field(default_factory=dict)
    """time, reason, message of the last Event-worthy outcome."""
    warnings: tuple[Problem, ...] = ()
    """Every warning of the selected config (and of the ConfigMap as a whole)."""
    warned: Mapping[str, int] = field(default_factory=dict)
    """How many warnings each config of the ConfigMaps has (the agent's log lists them all)."""


def status_document(
    node_name: str,
    node: NodeState,
    inventory: Inventory,
    holders: Sequence[Holding] | None,
    config: ConfigStatus,
    *,
    holders_error: str = "",
    unhealthy: frozenset[str] = frozenset(),
    mps: Mapping[GpuUuid, Mapping[str, Any]] | None = None,
    claims: Sequence[ClaimHold] = (),
    frontend: str = "deviceplugin",
    room: Sequence[GpuRoom] = (),
    foreign: Sequence[Foreign] = (),
    recorded: Sequence[PreparedClaim] = (),
    usage: UsageReport | None = None,
    usage_enabled: bool = False,
    catalog: Catalog | None = None,
) -> dict[str, Any]:
    """The status of a node; `holders` None means they could not be read (`holders_error` says why).

    `unhealthy` names the GPUs a health event (XID) took down and that have not recovered; `mps`, per
    GPU UUID, its MPS control daemon (`mps_daemon`), for the GPUs shared with MPS, and per MIG UUID
    that of an on-demand MIG device a claim shares with MPS; `claims` are the ResourceClaims holding
    devices (DRA front-end), each shown beside its devices; `room` what each dynamic GPU can still take
    (`sharing.dra.fragmentation`); `foreign` the MIG instances on dynamic GPUs that the agent did not
    make (`sharing.dra.foreign`); `recorded` the claims the DRA plugin's checkpoint records as
    prepared: the instances made (or adopted) for them on the dynamic GPUs are those GPUs' slices, each
    with its claim and the claim's pods (`onDemand` says where; one still being made, with no MIG UUID
    yet, shows at the next look).
    `usage` the usage sampler's latest report (`sharing.ops.usage` shapes its parts), each held
    slice's right size on its GPU's MIG profiles (the driver's, else `catalog`'s).
    """
    owners = _owners(holders or ())
    profiles = {ci.uuid: device_profile(gi, ci) for g in node.gpus for gi, ci in g.mig_devices}
    slices: dict[str, list[dict[str, Any]]] = {}
    for resource, devices in inventory.resources:
        for device in devices:
            entry = _slice(resource, device, owners.get(device.id))
            entry["profile"] = profiles.get(device.mig_uuid) if device.mig_uuid else None
            entry["claims"] = [
                {"namespace": c.namespace, "name": c.name, "pods": list(c.pods)}
                for c in sorted(claims, key=lambda c: (c.namespace, c.name))
                if device.uuid in c.uuids
            ]
            gpu = node.gpu(device.gpu_uuid)
            product = geometry(gpu, catalog) if gpu is not None and catalog is not None else None
            entry["usage"] = slice_usage(usage, entry, gpu, product)
            slices.setdefault(device.gpu_uuid, []).append(entry)
    for c in sorted(recorded, key=lambda c: (c.namespace, c.name)):
        for d in c.devices:
            if d.instance is not None and d.uuid and d.instance.gpu_uuid in inventory.dynamic:
                daemon = (mps or {}).get(GpuUuid(d.uuid))
                healthy = d.instance.gpu_uuid not in unhealthy
                made = _made(c, d, d.instance, healthy=healthy, mps=daemon)
                slices.setdefault(d.instance.gpu_uuid, []).append(made)
    return {
        "node": node_name,
        "frontend": frontend,
        "config": {
            "selected": config.selected,
            "source": config.source,
            "state": config.state,
            "inEffect": sorted({n for n in config.in_effect.values() if n}),
            "warnings": [p.as_dict() for p in config.warnings],
            "warningsPerConfig": dict(sorted(config.warned.items())),
        },
        "lastChange": dict(config.last_change),
        "holders": {"known": holders is not None, "error": holders_error},
        "usage": summary(usage, usage_enabled),
        "gpus": [
            {
                **_gpu(g, slices.get(g.uuid, []), config.in_effect.get(g.uuid), g.uuid not in unhealthy),
                "mps": dict((mps or {})[g.uuid]) if g.uuid in (mps or {}) else None,
                "usage": gpu_usage(usage, g.uuid),
                "dynamic": _dynamic(g.uuid, inventory),
                "room": next((_room(r) for r in room if r.uuid == g.uuid), None),
                "foreign": [
                    _foreign(f, g.uuid in inventory.reclaim) for f in foreign if f.gpu.uuid == g.uuid
                ],
            }
            for g in node.gpus
        ],
        "unreadable": [{"index": u.index, "uuid": u.uuid, "error": u.error} for u in node.unreadable],
    }


def mps_daemon(
    pipe_directory: str,
    wanted: tuple[int, int],
    enforced: tuple[int, int] | None,
    restarts: int,
    error: str = "",
) -> dict[str, Any]:
    """One GPU's MPS control daemon: its pipes, the limits wanted and those it answers with
    (active thread percentage, pinned memory MiB), whether they agree, restarts and the last error."""
    return {
        "pipeDirectory": pipe_directory,
        "activeThreadPercentage": wanted[0],
        "pinnedMemoryMiB": wanted[1],
        "enforced": None
        if enforced is None
        else {"activeThreadPercentage": enforced[0], "pinnedMemoryMiB": enforced[1]},
        "healthy": enforced == wanted,
        "restarts": restarts,
        "error": error,
    }


def _dynamic(uuid: str, inventory: Inventory) -> str | None:
    """Under `mig: dynamic`: `onDemand` (MIG devices made per claim) or `whole` (the GPU has no MIG)."""
    if uuid in inventory.dynamic:
        return "onDemand"
    return "whole" if uuid in inventory.whole else None


def _room(r: GpuRoom) -> dict[str, Any]:
    return {
        "largestProfile": r.largest or None,
        "largestComputeSlices": r.largest_compute_slices,
        "freeComputeSlices": r.free_compute_slices,
        "strandedComputeSlices": r.stranded_compute_slices,
    }


def _foreign(f: Foreign, reclaim: bool) -> dict[str, Any]:
    gi = f.instance
    return {
        "profile": gi.profile,
        "start": gi.start,
        "gpuInstance": gi.id,
        "uuids": [ci.uuid for ci in gi.compute_instances],
        "busy": gi.busy,
        "device": f.device,
        "claim": f.claim or None,
        "reclaimedWhenIdle": reclaim,
    }


def _made(
    claim: PreparedClaim,
    device: PreparedDevice,
    instance: OwnedInstance,
    *,
    healthy: bool,
    mps: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """A MIG instance made (or adopted) for a claim on a dynamic GPU, as a slice of that GPU."""
    return {
        "resource": mig_resource(instance.profile),
        "id": device.uuid,
        "device": device.uuid,
        "replica": None,
        "health": "Healthy" if healthy else "Unhealthy",
        "pod": None,
        "profile": instance.profile,
        "claims": [
            {
                "namespace": claim.namespace,
                "name": claim.name,
                "pods": [f"{claim.namespace}/{p.name}" for p in claim.pods],
            }
        ],
        "onDemand": {
            "device": device.device,
            "start": instance.start,
            "made": not instance.foreign,
        },
        "mps": dict(mps) if mps is not None else None,
    }


def _owners(holders: Sequence[Holding]) -> dict[str, dict[str, str]]:
    return {
        device: {"namespace": h.namespace, "pod": h.pod, "container": h.container}
        for h in holders
        for device in h.device_ids
    }


def _gpu(gpu: Gpu, slices: list[dict[str, Any]], config: str | None, healthy: bool) -> dict[str, Any]:
    if not gpu.mig_capable:
        mig = "unsupported"
    else:
        mig = "on" if gpu.mig_enabled else "off"
        if gpu.mig_pending != gpu.mig_enabled:
            mig += f" ({'on' if gpu.mig_pending else 'off'} after a reset)"
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "product": gpu.product,
        "mig": mig,
        "health": "Healthy" if healthy else "Unhealthy",
        "config": config,
        "slices": slices,
    }


def _slice(resource: str, device: Device, owner: dict[str, str] | None) -> dict[str, Any]:
    return {
        "resource": resource,
        "id": device.id,
        "device": device.id.partition(REPLICA_SEPARATOR)[0],
        "replica": device.replica,
        "health": device.health.value,
        "pod": owner,
        "onDemand": None,
        "mps": None,
    }
