"""Which devices the claims allocated from our pool hold, as UUIDs the safe change protocol knows.

A device allocated to a claim is held from the moment the scheduler writes the allocation, before
any pod runs and before the kubelet prepares it: the scheduler has promised it to the claim
(resource.k8s.io/v1 `ResourceClaim.status.allocation`; KEP-4381, "Allocation" and "Deallocation":
only the resourceclaim controller's deallocation frees it). So every claim with an allocation result
naming our driver and pool counts, prepared or not, whichever pod uses it.

Device names are those of `sharing.dra.names.device_name` (`gpu-0`, `gpu-0-mig-1`, `...-replica-2`),
resolved against the GPUs as observed now. A name that resolves to nothing this node has (the MIG
device it named is gone) holds its whole GPU: fail closed, the GPU is not re-shaped under it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sharing.dra import placements
from sharing.model import ClaimAllocation, ClaimHold, NodeState

_NAME = re.compile(r"^gpu-(?P<gpu>\d+)(?:-mig-(?P<mig>\d+))?(?:-replica-(?P<replica>\d+))?$")


def claim_holds(claims: Iterable[ClaimAllocation], node: NodeState) -> tuple[ClaimHold, ...]:
    """Each claim with the UUIDs it holds on `node`."""
    return tuple(
        ClaimHold(c.namespace, c.name, c.pods, frozenset(u for d in c.devices for u in held_by(d, node)))
        for c in claims
    )


def held_by(device: str, node: NodeState) -> frozenset[str]:
    """The UUIDs one allocated device name holds: its device, or its whole GPU when it names nothing
    that exists (an unknown name that looks like no device of ours holds nothing: not our pool's).
    An on-demand device (`gpu-0-mig-1g-5gb-at-3`) holds what `sharing.dra.placements.held_by` says."""
    ondemand = placements.held_by(device, node)
    if ondemand is not None:
        return ondemand
    found = _NAME.match(device)
    if found is None:
        return frozenset()
    gpu = next((g for g in node.gpus if g.index == int(found["gpu"])), None)
    if gpu is None:
        return frozenset()
    if found["mig"] is None:
        return frozenset({gpu.uuid})
    mig = int(found["mig"])
    for _, ci in gpu.mig_devices:
        if ci.mig_index == mig:
            return frozenset({ci.uuid})
    return frozenset({gpu.uuid, *(ci.uuid for _, ci in gpu.mig_devices)})
