"""`sharing recommend`: a config holding what the node's pods use at their right size, and free room (pure).

From the GPUs as observed (their instances and placements; profiles as their driver reports them,
else the catalog's) and the agent's status (who holds which slice, and each held slice's right size,
`sharing.ops.usage`). Per GPU in MIG mode whose profiles are known:

- a MIG device held whole by one pod whose right size is known is wanted at its right size (the
  fewest compute slices that hold what it used: `sharing.mig.rightsize`);
- every other held MIG device (shared by replicas, held by a claim's several pods, no right size yet,
  or already at it) is kept as it is, where it is;
- the free room is the compute and memory slices the held ones do not need: the devices no pod
  holds stay as they are (nobody asked for them to change, and pods may be about to ask for them),
  and what the right sizes give back (with any slices no device uses) is filled with the largest
  plain profiles the exact planner (`sharing.mig.plan`) can place around the rest, largest first
  (compute slices, then memory), so it is offered as few, large devices that new pods can ask for by
  name. Left empty, it would offer nothing (a device plugin advertises only instances that exist);
  on-demand MIG is the DRA front-end's `mig: dynamic`, which a node chooses for itself;
- where the right sizes do not fit around the free devices where they are, those move (the planner
  keeps as many as it can); where they do not fit around the held ones either, the GPU's held
  slices stay as they are. The advice says which.

Every other GPU (MIG off, no MIG, `mig: dynamic`, profiles not known) is kept as it is: its rule says
what it offers now (time-sliced replicas, MPS clients with their limits); for a replica of a whole GPU
the advice names the MIG profile that would hold its pod. Time-sliced replicas of MIG devices keep their
count per profile; `sharing.renameByDefault` follows the resources' names. What the status cannot show
(`failRequestsGreaterThanOne`, a rule's own `rename`) is left at its default, and said.

The agent never destroys a held device and keeps a held instance whose profile the new layout still
has: a pod whose slice changes keeps it while it runs where the layout can be placed around it, and is
waited for (or evicted by drain mode) where it cannot (`GpuAdvice.waits`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sharing.errors import SharingError
from sharing.mig import Catalog, Product, geometry
from sharing.mig.rightsize import candidates
from sharing.model import Gpu, NodeState
from sharing.usage.resize import GpuAdvice, Held, per_profile, resize


class RecommendError(SharingError):
    """No recommendation can be made from what the node's status says (and why)."""


@dataclass(frozen=True, slots=True)
class Recommendation:
    config: dict[str, Any]
    gpus: tuple[GpuAdvice, ...]
    notes: tuple[str, ...] = ()


def recommend(node: NodeState, status: Mapping[str, Any], catalog: Catalog) -> Recommendation:
    """The recommended native config for this node and the advice per GPU (see the module)."""
    _check(status)
    entries = {g["uuid"]: g for g in status.get("gpus", [])}
    notes = ["failRequestsGreaterThanOne and per-rule rename are not in the status: left at their defaults"]
    state = (status.get("config") or {}).get("state")
    if state not in (None, "success"):
        notes.append(f"the node's config state is {state}: recommend on a node whose change is done")
    gpus = []
    for gpu in node.gpus:
        entry = entries.get(gpu.uuid, {"slices": []})
        product = geometry(gpu, catalog)
        held = [h for s in entry["slices"] if (h := _held(s)) is not None]
        if gpu.mig_enabled and product is not None and not entry.get("dynamic"):
            gpus.append(resize(gpu, product, held, _replicas(entry)))
        else:
            gpus.append(_as_is(gpu, entry, held, product))
    notes += [f"GPU {u.index} cannot be read ({u.error}): no rule, left as it is" for u in node.unreadable]
    mig = any(g.mig_enabled for g in node.gpus)
    replicas = [s for g in status.get("gpus", []) for s in g["slices"] if s.get("replica") is not None]
    config = {
        "version": "v1",
        "migStrategy": "mixed" if mig else "none",
        "sharing": {"renameByDefault": any(s["resource"].endswith(".shared") for s in replicas)},
        "gpus": [g.rule for g in gpus],
    }
    return Recommendation(config, tuple(gpus), tuple(notes))


def _check(status: Mapping[str, Any]) -> None:
    usage = status.get("usage") or {}
    if not usage.get("enabled"):
        raise RecommendError("the agent samples no usage (usage.enabled is false): nothing to size slices by")
    if not usage.get("sampledAt"):
        raise RecommendError("the agent has taken no usage sample yet: try again in a few seconds")
    if not (status.get("holders") or {}).get("known", True) or not usage.get("holdersKnown", True):
        raise RecommendError("who holds which slice is unknown (PodResources unreadable): nothing is sized")
    for gpu in status.get("gpus", []):
        for s in gpu["slices"]:
            if s.get("profile") and s["resource"].split(".shared")[0] == "nvidia.com/gpu":
                raise RecommendError(
                    "this node advertises MIG devices as nvidia.com/gpu (migStrategy single): recommend "
                    "proposes mixed layouts, which would rename them"
                )


def _held(entry: Mapping[str, Any]) -> Held | None:
    pod, claims = entry.get("pod"), entry.get("claims") or []
    if pod:
        holder = f"{pod['namespace']}/{pod['pod']}/{pod['container']}"
    elif claims:
        holder = ", ".join(f"claim {c['namespace']}/{c['name']}" for c in claims)
    else:
        return None
    size = (entry.get("usage") or {}).get("rightSize") or {}
    return Held(
        entry["id"], entry["device"], entry["resource"], holder, entry.get("replica") is not None,
        size.get("profile"), size.get("why") or "",
    )  # fmt: skip


def _replicas(entry: Mapping[str, Any]) -> dict[str, int]:
    """Per device with time-sliced replicas, how many it offers."""
    counts = Counter(s["device"] for s in entry["slices"] if s.get("replica") is not None)
    return dict(counts)


def _as_is(gpu: Gpu, entry: Mapping[str, Any], held: Sequence[Held], product: Product | None) -> GpuAdvice:
    rule: dict[str, Any] = {"devices": [gpu.index]}
    replicas = _replicas(entry)
    if entry.get("dynamic"):
        rule["mig"], note = "dynamic", "mig: dynamic (MIG devices made per claim): kept"
    elif gpu.mig_enabled:
        rule["mig"], note = "unchanged", "MIG on, its profiles are not known: kept as it is"
        if profiles := per_profile(gpu, replicas):
            rule["replicas"] = profiles
    else:
        if gpu.mig_capable:
            rule["mig"] = "disabled"
        count = replicas.get(gpu.uuid, 0)
        daemon = entry.get("mps")
        if daemon and count:
            rule["mps"] = {
                "replicas": count,
                "activeThreadPercentage": daemon["activeThreadPercentage"],
                "pinnedMemoryLimit": f"{daemon['pinnedMemoryMiB']}Mi",
            }
            note = f"MIG off, shared by {count} MPS clients: kept"
        elif count:
            rule["replicas"] = count
            note = f"MIG off, {count} time-sliced replicas: kept"
        else:
            note = "whole: kept" if gpu.mig_capable else "no MIG, whole: kept"
    whole = tuple(h for h in held if h.device == gpu.uuid)
    largest = candidates(product)[-1].name if product is not None and candidates(product) else None
    return GpuAdvice(gpu.index, gpu.uuid, gpu.product, rule, False, note, fits=whole, largest=largest)
