"""Which ResourceClaims hold devices of this node's DRA pool, found from the node alone: the claims its
pods name, one GET each. No list or watch of ResourceClaims: no field selector reaches into a claim's
allocation (only metadata.name and metadata.namespace, up to Kubernetes 1.37), so either would be
every claim of the cluster, for every node.

A decision that destroys devices of the pool (a change, `reclaimForeign: idle`) asks this after the
devices were withdrawn and the API server holds the slices without them, and after the scheduling
cycles that read the pool before that are over (`DraFrontEnd.settled`): no allocation of a withdrawn
device can be written after that. One written before belongs to a claim of a pod that is
- bound to the node (`spec.nodeName`): the pods the agent lists anyway;
- or being bound: the scheduler writes the allocation in its PreBind plugins and binds the pod after
  them, and names the node in the pod's `status.nominatedNodeName` before them (k8s.io/kubernetes
  v1.37.2 pkg/scheduler/schedule_one.go `bindingCycle`, gate NominatedNodeNameForExpectation, on by
  default from 1.35; pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go `PreBind`
  -> `bindClaim`): those are listed by that field.
A pod names its claims in `spec.resourceClaims` (by name, or made from a template and named in
`status.resourceClaimStatuses`, which the scheduler waits for before it allocates) and, for extended
resources served through DRA, in `status.extendedResourceClaimStatus`, which the scheduler writes
only after the claim's allocation (`bindClaim`: the claim is created and its status written, then the
pod's status patched). A pod being bound that asks for such a resource and names no such claim yet
cannot be told apart from one whose claim holds our devices: that is a `KubeError` (fail closed: the
decision waits and looks again).
"""

from __future__ import annotations

from collections.abc import Callable

from sharing.errors import KubeError
from sharing.kube.api import KubeClient, NotFoundError
from sharing.model import BoundPod, ClaimAllocation
from sharing.text import listed


class ClaimsUnsureError(KubeError):
    """A pod being bound to the node may hold devices of the pool through a claim it does not name yet."""


def claims_of_node_pods(
    kube: KubeClient, node: str, driver: str, *, through_dra: Callable[[str], bool]
) -> tuple[ClaimAllocation, ...]:
    """The claims the pods bound or being bound to `node` name that are allocated devices of `driver`'s
    pool `node`, by namespace and name. `through_dra(resource)`: whether a pod asking for that extended
    resource gets it through a claim (the node is served by DRA and a DeviceClass names it)."""
    pods = (*kube.list_node_pods(node), *kube.list_nominated_pods(node))
    unsure = [p for p in pods if not p.bound and not p.extended_claim and _asks(p, through_dra)]
    if unsure:
        names = listed([f"{p.namespace}/{p.name}" for p in unsure])
        raise ClaimsUnsureError(
            f"pods {names} are being bound to this node and ask for extended resources served through "
            "DRA, and the claims the scheduler makes for them are not named yet"
        )
    found = []
    for namespace, name in sorted({(p.namespace, c) for p in pods for c in p.claims}):
        try:
            claim = kube.get_resource_claim(namespace, name)
        except NotFoundError:
            continue  # deleted since its pod named it: it holds nothing
        devices = tuple(r.device for r in claim.results if r.driver == driver and r.pool == node)
        if devices:
            users = tuple(f"{namespace}/{p.name}" for p in claim.reserved_for)
            found.append(ClaimAllocation(namespace, name, claim.uid, devices, users))
    return tuple(found)


def _asks(pod: BoundPod, through_dra: Callable[[str], bool]) -> bool:
    return any(through_dra(r) for r in pod.resources)
