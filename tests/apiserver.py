"""What tests against the real kube-apiserver (hack/lab) do the same way: the agent's token as its
DaemonSet pod gets it, and waiting until an admission policy a test applied is in force."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import lab
from lab.api import ApiError

from tests.polling import poll

AGENT = "gpu-sharing"
"""The agent's ServiceAccount and namespace as deploy/ names them."""


def agent_token(
    cp: lab.ControlPlane, node: str, *, service_account: str = AGENT, namespace: str = AGENT
) -> str:
    """The agent ServiceAccount's token as its DaemonSet pod on `node` gets it: bound to a pod
    scheduled there (`agent-<node>`), so it carries the node claim the admission policy checks."""
    pod = f"agent-{node}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "namespace": namespace},
        "spec": {
            "nodeName": node,
            "serviceAccountName": service_account,
            "containers": [{"name": "agent", "image": "gpu-sharing:placeholder"}],
        },
    }
    try:
        cp.api.request("POST", f"/api/v1/namespaces/{namespace}/pods", manifest, merge=False)
    except ApiError as err:
        if err.status != 409:  # made before, for an earlier agent of this node: a new token for it
            raise
    # `kubectl create token --duration=2h --bound-object-kind=Pod --bound-object-name=<pod>`
    bound = {"kind": "Pod", "apiVersion": "v1", "name": pod}
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 7200, "boundObjectRef": bound},
    }
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
    return str(cp.api.request("POST", path, request, merge=False)["status"]["token"])


def allocated_claim(cp: lab.ControlPlane, claim: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """Create a ResourceClaim, then write its `status` as the scheduler does (the status subresource,
    a merge patch); the claim as the API server returns it."""
    meta = claim["metadata"]
    claims = f"/apis/resource.k8s.io/v1/namespaces/{meta['namespace']}/resourceclaims"
    cp.api.request("POST", claims, claim, merge=False)
    return dict(cp.api.request("PATCH", f"{claims}/{meta['name']}/status", status))


def pool_devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{device name: its attributes as plain values} of one pool's ResourceSlices as the scheduler
    takes them: the slices of its newest generation, once all of them are there; nothing while a new
    generation is being written (k8s.io/api resource/v1 types.go `ResourcePool`: consumers ignore
    older generations and wait for an incomplete pool). A driver replaces a pool's slices one request
    at a time: a read in between could mix two generations."""
    newest = max((s["spec"]["pool"]["generation"] for s in slices), default=None)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
    if not current or len(current) < current[0]["spec"]["pool"]["resourceSliceCount"]:
        return {}
    return {
        d["name"]: {k: next(iter(v.values())) for k, v in d.get("attributes", {}).items()}
        for s in current
        for d in s["spec"].get("devices", [])
    }


def offers_whole(pool: Mapping[str, Any], gpus: Iterable[int]) -> bool:
    """Whether an on-demand pool (`pool_devices`) offers each of `gpus` whole: its 7g device at slot
    0, which the agent withdraws while any instance stands on the GPU (`sharing.dra.partitions`). The
    pool is republished after the hardware changed: a test that claims from it waits for this, not for
    the hardware alone."""
    return all(any(n.startswith(f"gpu-{g}-mig-7g-") and n.endswith("-at-0") for n in pool) for g in gpus)


def refusal(attempt: Callable[[], str], timeout: float = 30) -> str:
    """What the API server answers `attempt` once an admission policy refuses it (`attempt` returns ""
    while the request passes, and undoes it). The API server reads a new policy a moment after it is
    created, and until then RBAC alone rules: an attack would pass."""
    return str(poll("the own-node admission policy to refuse", attempt, bool, timeout=timeout))


def wait_for_policy(cp: lab.ControlPlane) -> None:
    """Until the own-node admission policy refuses. The probe is a server-side dry run of an Event by
    the agent's token without a node claim, which RBAC allows and the policy refuses."""
    made = cp.kubectl("create", "token", AGENT, "-n", AGENT, check=True)
    unbound = cp.token_kubeconfig(made.stdout.strip(), "agent-without-node")
    probe = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "probe-", "namespace": "default"},
        "involvedObject": {"kind": "Node", "name": "probe"},
        "reason": "Probe",
        "message": "is the admission policy in force",
    }

    def attempt() -> str:
        done = cp.kubectl(
            "create", "--dry-run=server", "-f", "-", kubeconfig=unbound, input=json.dumps(probe)
        )
        return done.stderr if done.returncode != 0 else ""

    refused = refusal(attempt)
    assert "carries no node claim" in refused, refused
