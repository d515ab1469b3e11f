"""A whole 1.34 cluster served through DRA (one real node): what 1.34 has works, what it lacks is
refused by name.

DRA is GA in 1.34 (resource.k8s.io/v1); partitionable devices, device taints, consumable capacity
and extended resources through DRA are alpha and off there (k8s.io/kubernetes v1.34.4
pkg/features/kube_features.go). So the static pool is published, a claim for a whole GPU or for
a MIG device of the static layout is allocated and its pod runs; a pod asking for a MIG resource in
`resources.limits` is not served through DRA and stays Pending with the scheduler's reason; `mig:
dynamic`, which needs partitionable devices, is refused with a ConfigInvalid Event naming
DRAPartitionableDevices while the node keeps serving its last config.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import lab
import pytest

from tests.cluster.conftest import CONFIG_LABEL, STATE_LABEL, Cluster, running
from tests.polling import poll
from tests.skew.conftest import OLD, one_node, server_version

pytestmark = pytest.mark.node

NODE = "skew-dra"
DRIVER = "gpu.nvidia.com"
FRONTEND = "nvidia.com/gpu-sharing.frontend"
STATIC = """version: v1
migStrategy: mixed
gpus:
  - devices: [0]
    mig: {3g.20gb: 2}
  - devices: [1]
    mig: disabled
"""
DYNAMIC = "version: v1\nmigStrategy: mixed\ngpus:\n  - devices: all\n    mig: dynamic\n"
DEVICES = {"gpu-0-mig-0", "gpu-0-mig-1", "gpu-1"}


def published(cluster: Cluster) -> set[str]:
    """The device names of the node's pool."""
    items = cluster.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    ours = [s for s in items if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == NODE]
    return {d["name"] for s in ours for d in s["spec"].get("devices") or []}


def events(cluster: Cluster, reason: str) -> list[str]:
    selector = f"involvedObject.kind=Node,involvedObject.name={NODE},reason={reason}"
    return [e["message"] for e in cluster.get(f"/api/v1/events?fieldSelector={selector}")["items"]]


@pytest.fixture(scope="module")
def old(cluster_binaries: lab.Binaries) -> Iterator[Cluster]:
    configs = {"static": STATIC, "dynamic": DYNAMIC}
    with one_node(
        cluster_binaries, NODE, "A100-SXM4-40GB:2", configs, "static",
        k8s=OLD, labels={FRONTEND: "dra"}, dra={"enabled": True},
    ) as cluster:  # fmt: skip
        poll("the pool's devices", lambda: published(cluster), lambda d: d == DEVICES, 180)
        yield cluster


def test_the_pool_is_published_on_a_1_34_api_server(old: Cluster) -> None:
    assert server_version(old) == lab.kubernetes_version(OLD)
    assert (old.labels(NODE)[STATE_LABEL], published(old)) == ("success", DEVICES)


def pod_body(name: str, resources: dict[str, Any], claim: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {"name": "main", "image": "localhost/toolbox:1", "command": ["sleep", "1000000"],
             "resources": resources}
        ],
    }  # fmt: skip
    if claim is not None:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def claimed(old: Cluster, device_class: str) -> list[tuple[str, str, str]]:
    """A claim for one device of `device_class` and a pod that uses it, Running: what was allocated."""
    name = f"c-{uuid.uuid4().hex[:6]}"
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}},
    }
    try:
        old.kubectl("apply", "-f", "-", input=json.dumps(claim))
        old.kubectl("apply", "-f", "-", input=json.dumps(pod_body(name, {"claims": [{"name": "gpu"}]}, name)))
        poll(f"pod {name} Running", lambda: old.pod(name), running, 120)
        status = old.get(f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}")["status"]
        return [(r["driver"], r["pool"], r["device"]) for r in status["allocation"]["devices"]["results"]]
    finally:
        old.kubectl("delete", "pod,resourceclaim", name, "--ignore-not-found", "--timeout=60s")


def test_a_claim_for_a_whole_gpu_is_allocated_and_its_pod_runs(old: Cluster) -> None:
    assert claimed(old, DRIVER) == [(DRIVER, NODE, "gpu-1")]


def test_a_claim_for_a_mig_device_of_the_static_layout_is_allocated_and_its_pod_runs(old: Cluster) -> None:
    ((driver, pool, device),) = claimed(old, "mig-3g.20gb.nvidia.com")
    assert (driver, pool) == (DRIVER, NODE)
    assert device in {"gpu-0-mig-0", "gpu-0-mig-1"}


def test_limits_naming_a_mig_resource_are_not_served_through_dra_and_the_scheduler_says_so(
    old: Cluster,
) -> None:
    """Without DRAExtendedResource (alpha, off in 1.34) the API server drops the DeviceClasses'
    extendedResourceName: nothing serves `nvidia.com/mig-3g.20gb` in limits on a node served through
    DRA, and the pod stays Pending with the scheduler's reason."""
    classes = old.get("/apis/resource.k8s.io/v1/deviceclasses/mig-3g.20gb.nvidia.com")
    assert "extendedResourceName" not in classes["spec"]
    name = f"l-{uuid.uuid4().hex[:6]}"
    old.kubectl(
        "apply", "-f", "-", input=json.dumps(pod_body(name, {"limits": {"nvidia.com/mig-3g.20gb": "1"}}))
    )
    try:

        def unschedulable(pod: dict[str, Any]) -> str:
            conditions = pod.get("status", {}).get("conditions", [])
            return next(
                (
                    c.get("message", "")
                    for c in conditions
                    if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                ),
                "",
            )

        message = poll(f"pod {name} unschedulable", lambda: unschedulable(old.pod(name)), bool, 60)
        assert "Insufficient nvidia.com/mig-3g.20gb" in message, message
        assert old.pod(name)["status"]["phase"] == "Pending"
    finally:
        old.kubectl("delete", "pod", name, "--ignore-not-found", "--timeout=60s")


def test_mig_dynamic_is_refused_by_name_and_the_node_keeps_serving(old: Cluster) -> None:
    try:
        old.kubectl("label", "node", NODE, f"{CONFIG_LABEL}=dynamic", "--overwrite")
        poll("state failed", lambda: old.labels(NODE).get(STATE_LABEL), lambda s: s == "failed", 90)
        # The agent sends the Event after the Node's labels: it may come a moment later.
        (refusal,) = poll("the ConfigInvalid Event", lambda: events(old, "ConfigInvalid"), bool, 30)
        assert "config 'dynamic' asks for mig: dynamic" in refusal
        assert "feature gate DRAPartitionableDevices off" in refusal
        assert published(old) == DEVICES  # the last good config's devices, still offered
        agent = old.agent_pods()[NODE]
        assert [c["restartCount"] for c in agent["status"]["containerStatuses"]] == [0] * len(
            agent["status"]["containerStatuses"]
        )
    finally:
        old.kubectl("label", "node", NODE, f"{CONFIG_LABEL}=static", "--overwrite")
        poll("state success", lambda: old.labels(NODE).get(STATE_LABEL), lambda s: s == "success", 90)
