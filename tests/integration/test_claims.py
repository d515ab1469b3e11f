"""The claims that hold devices of a node's DRA pool, found from the node alone against a real
kube-apiserver (`sharing.kube.podclaims`): the claims its bound pods and the pods nominated to it name,
one GET each; other pools, other drivers, claims no pod of the node names and deleted claims do not
count; a pod being bound that asks for an extended resource through DRA and names no claim yet is
"cannot tell" (fail closed)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import lab
import pytest

from sharing.kube import ApiClient
from sharing.kube.podclaims import ClaimsUnsureError, claims_of_node_pods
from sharing.model import ClaimAllocation

pytestmark = pytest.mark.integration

DRIVER = "gpu.nvidia.com"
MIG = "nvidia.com/mig-1g.5gb"


def apply(cp: lab.ControlPlane, obj: dict[str, Any]) -> None:
    cp.kubectl("apply", "-f", "-", input=json.dumps(obj), check=True)


def status(cp: lab.ControlPlane, ns: str, kind: str, name: str, body: dict[str, Any]) -> None:
    patch = ["patch", kind, name, "--subresource=status", "--type=merge", "-p", json.dumps(body)]
    cp.kubectl("-n", ns, *patch, check=True)


def claim(cp: lab.ControlPlane, ns: str, name: str, results: list[dict[str, str]], pods: list[str]) -> str:
    """A claim with an allocation written into its status as the scheduler writes it; its UID."""
    apply(cp, {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    })  # fmt: skip
    uid = cp.kubectl("-n", ns, "get", "resourceclaim", name, "-o", "jsonpath={.metadata.uid}", check=True)
    where = {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
    }
    devices = {"results": [{"request": "gpu", **r} for r in results]}
    status(cp, ns, "resourceclaim", name, {"status": {
        "allocation": {"devices": devices, "nodeSelector": where},
        "reservedFor": [{"resource": "pods", "name": p, "uid": str(uuid.uuid4())} for p in pods],
    }})  # fmt: skip
    return uid.stdout.strip()


def pod(
    cp: lab.ControlPlane,
    ns: str,
    name: str,
    *,
    node: str = "",
    claims: list[dict[str, str]] | None = None,
    limits: dict[str, str] | None = None,
) -> None:
    """A pod bound to `node` (spec.nodeName), or unbound; naming claims by name or template."""
    container: dict[str, Any] = {"name": "main", "image": "gpu-sharing:placeholder"}
    if limits:
        container["resources"] = {"limits": limits}
    spec: dict[str, Any] = {"containers": [container]}
    if node:
        spec["nodeName"] = node
    if claims:
        spec["resourceClaims"] = claims
    apply(cp, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec})


def test_the_claims_of_the_nodes_pods_allocated_from_its_pool_hold_devices(
    control_plane: lab.ControlPlane,
) -> None:
    ns = f"claims-{uuid.uuid4().hex[:6]}"
    node = f"node-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    ours = {"driver": DRIVER, "pool": node}
    two = claim(
        control_plane, ns, "two", [{**ours, "device": "gpu-0-mig-1"}, {**ours, "device": "gpu-1"}], ["p"]
    )
    claim(
        control_plane, ns, "other-node", [{"driver": DRIVER, "pool": "elsewhere", "device": "gpu-0"}], ["p"]
    )
    claim(
        control_plane, ns, "other-driver", [{"driver": "example.com", "pool": node, "device": "gpu-0"}], ["p"]
    )
    claim(control_plane, ns, "no-pod-here", [{**ours, "device": "gpu-2"}], [])
    made = claim(control_plane, ns, "p-made-abcde", [{**ours, "device": "gpu-3"}], ["p"])
    refs = ["two", "other-node", "other-driver", "deleted"]
    pod(control_plane, ns, "p", node=node, claims=[
        *({"name": f"c{i}", "resourceClaimName": n} for i, n in enumerate(refs)),
        {"name": "t", "resourceClaimTemplateName": "some-template"},
    ])  # fmt: skip
    # The claim the ResourceClaim controller made from the template, named in the pod's status.
    status(control_plane, ns, "pod", "p", {"status": {"resourceClaimStatuses": [
        {"name": "t", "resourceClaimName": "p-made-abcde"},
    ]}})  # fmt: skip
    pod(
        control_plane,
        ns,
        "elsewhere",
        node="another-node",
        claims=[{"name": "c", "resourceClaimName": "no-pod-here"}],
    )

    kube = ApiClient(str(control_plane.kubeconfig))
    got = claims_of_node_pods(kube, node, DRIVER, through_dra=lambda r: True)
    assert (
        ClaimAllocation(ns, "p-made-abcde", made, ("gpu-3",), (f"{ns}/p",)),
        ClaimAllocation(ns, "two", two, ("gpu-0-mig-1", "gpu-1"), (f"{ns}/p",)),
    ) == got


def test_a_pod_being_bound_counts_and_one_that_names_no_claim_of_its_extended_resources_is_unsure(
    control_plane: lab.ControlPlane,
) -> None:
    """The scheduler names the node in status.nominatedNodeName before it writes the allocation and
    binds after it; the claim of a pod's extended resources is named in its status after the claim's
    allocation is written."""
    ns = f"claims-{uuid.uuid4().hex[:6]}"
    node = f"node-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    kube = ApiClient(str(control_plane.kubeconfig))
    ours = {"driver": DRIVER, "pool": node}
    uid = claim(control_plane, ns, "c", [{**ours, "device": "gpu-0-mig-1g-5gb-at-6"}], ["binding"])
    pod(control_plane, ns, "binding", claims=[{"name": "c", "resourceClaimName": "c"}])
    assert () == claims_of_node_pods(kube, node, DRIVER, through_dra=lambda r: True)  # not nominated yet
    status(control_plane, ns, "pod", "binding", {"status": {"nominatedNodeName": node}})
    expected = (ClaimAllocation(ns, "c", uid, ("gpu-0-mig-1g-5gb-at-6",), (f"{ns}/binding",)),)
    assert expected == claims_of_node_pods(kube, node, DRIVER, through_dra=lambda r: True)

    pod(control_plane, ns, "by-limits", limits={MIG: "1"})
    status(control_plane, ns, "pod", "by-limits", {"status": {"nominatedNodeName": node}})
    with pytest.raises(ClaimsUnsureError, match=f"pods {ns}/by-limits are being bound to this node"):
        claims_of_node_pods(kube, node, DRIVER, through_dra=lambda r: r == MIG)
    # On a node the device plugins serve, nvidia.com/mig-1g.5gb is theirs: nothing to be unsure of.
    assert expected == claims_of_node_pods(kube, node, DRIVER, through_dra=lambda r: False)
    limits = claim(
        control_plane, ns, "by-limits-extended-resources-x1", [{**ours, "device": "gpu-1"}], ["by-limits"]
    )
    mapping = {"containerName": "main", "resourceName": MIG, "requestName": "container-0-request-0"}
    status(control_plane, ns, "pod", "by-limits", {"status": {"extendedResourceClaimStatus": {
        "resourceClaimName": "by-limits-extended-resources-x1", "requestMappings": [mapping],
    }}})  # fmt: skip
    assert (
        ClaimAllocation(ns, "by-limits-extended-resources-x1", limits, ("gpu-1",), (f"{ns}/by-limits",)),
        *expected,
    ) == claims_of_node_pods(kube, node, DRIVER, through_dra=lambda r: r == MIG)
