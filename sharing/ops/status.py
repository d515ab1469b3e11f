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

from sharing.devices import REPLICA_SEPARATOR, Device, Inventory
from sharing.dra.foreign import Foreign
from sharing.dra.fragmentation import Fragmented
from sharing.mig import Catalog, geometry
from sharing.model import ClaimHold, Gpu, GpuUuid, Holding, NodeState
from sharing.ops.usage import gpu_usage, slice_usage, summary
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
    fragmented: Sequence[Fragmented] = (),
    foreign: Sequence[Foreign] = (),
    usage: UsageReport | None = None,
    usage_enabled: bool = False,
    catalog: Catalog | None = None,
) -> dict[str, Any]:
    """The status of a node; `holders` None means they could not be read (`holders_error` says why).

    `unhealthy` names the GPUs a health event (XID) took down and that have not recovered; `mps`, per
    GPU UUID, its MPS control daemon (`mps_daemon`), for the GPUs shared with MPS; `claims` are the
    ResourceClaims holding devices (DRA front-end), each shown beside its devices; `fragmented` the
    pending claims whose MIG profile fits a dynamic GPU's free memory and compute but no placement;
    `foreign` the MIG instances on dynamic GPUs that the agent did not make (`sharing.dra.foreign`);
    `usage` the usage sampler's latest report (`sharing.ops.usage` shapes its parts), each held
    slice's right size on its GPU's MIG profiles (the driver's, else `catalog`'s).
    """
    owners = _owners(holders or ())
    profiles = {ci.uuid: gi.profile for g in node.gpus for gi, ci in g.mig_devices}
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
    return {
        "node": node_name,
        "frontend": frontend,
        "config": {
            "selected": config.selected,
            "source": config.source,
            "state": config.state,
            "inEffect": sorted({n for n in config.in_effect.values() if n}),
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
                "foreign": [
                    _foreign(f, g.uuid in inventory.reclaim) for f in foreign if f.gpu.uuid == g.uuid
                ],
            }
            for g in node.gpus
        ],
        "unreadable": [{"index": u.index, "uuid": u.uuid, "error": u.error} for u in node.unreadable],
        "fragmented": [
            {"claim": f"{f.namespace}/{f.name}", "profile": f.profile, "gpus": list(f.gpus)}
            for f in fragmented
        ],
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
    }
