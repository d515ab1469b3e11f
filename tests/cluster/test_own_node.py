"""The own-node admission policy with two real agents: node-a's agent, with its own token, may change
its own Node's nvidia.com/ labels and nothing of node-b's.

The token is the one the agent on node-a uses, read in its container (the projected ServiceAccount
token of its pod, bound to that pod and so carrying the claim `authentication.kubernetes.io/node-name:
node-a`). The chart's DRA part is on for the module (deploy/helm/gpu-sharing/templates/rbac.yaml
grants ResourceSlices only then), so every refusal below is the admission policy's
(templates/admission-policy.yaml), not RBAC's: RBAC grants each of these requests. tests/e2e/test_own_node.py
tries the same policy with tokens made for stand-in pods on one control plane; here the Nodes,
pods and tokens are real.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import Cluster, agent_token, kubectl_as, token_kubeconfig

pytestmark = pytest.mark.node

MINE, OTHER = "node-a", "node-b"
REFUSED_NODE = f"the gpu-sharing agent on {MINE} may only update its own Node"
REFUSED_EVENT = f"the gpu-sharing agent on {MINE} may only create Events about its own Node"
REFUSED_SLICE = (
    f"the gpu-sharing agent on {MINE} may only change ResourceSlices of its own node, not those of {OTHER}"
)
LAYOUT = "nvidia.com/gpu-sharing.layout"
MARK = "nvidia.com/gpu-sharing.own-node-test"
"""A label and annotation key the agent itself never writes."""


@pytest.fixture
def as_agent_a(dra_chart: Cluster) -> Path:
    """A kubeconfig with the token of node-a's running agent."""
    return token_kubeconfig(dra_chart, agent_token(dra_chart, MINE), f"agent-{MINE}-{uuid.uuid4().hex[:6]}")


@pytest.fixture
def slice_of_b(dra_chart: Cluster) -> Iterator[str]:
    """A ResourceSlice of node-b, made by the admin (another driver's: the agent on node-b keeps its
    own pool and leaves it alone); deleted after the test."""
    name = f"own-node-test-{uuid.uuid4().hex[:6]}"
    made = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "own-node-test.example.com",
            "nodeName": OTHER,
            "pool": {"name": OTHER, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "dev-0"}],
        },
    }
    dra_chart.kubectl("apply", "-f", "-", input=json.dumps(made))
    try:
        yield name
    finally:
        dra_chart.kubectl("delete", "resourceslice", name, "--ignore-not-found")


def node_meta(cluster: Cluster, name: str) -> tuple[dict[str, str], dict[str, str]]:
    meta = cluster.get(f"/api/v1/nodes/{name}")["metadata"]
    return dict(meta.get("labels", {})), dict(meta.get("annotations", {}))


def event(about: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "own-node-test-", "namespace": "default"},
            "involvedObject": {"kind": "Node", "name": about},
            "reason": "OwnNodeTest",
            "message": "an Event written with node-a's agent token",
            "type": "Normal",
        }
    )


def events(cluster: Cluster, about: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.name={about},reason=OwnNodeTest"
    return list(cluster.get(f"/api/v1/namespaces/default/events?fieldSelector={selector}")["items"])


def refused(done: Any, message: str) -> None:
    """The request was refused by the admission policy, with its message."""
    assert 0 != done.returncode, done.stdout
    assert "denied request" in done.stderr, done.stderr
    assert message in done.stderr, done.stderr


def test_the_agents_token_changes_its_own_nodes_nvidia_labels(dra_chart: Cluster, as_agent_a: Path) -> None:
    cluster = dra_chart
    try:
        done = kubectl_as(as_agent_a, "label", "node", MINE, f"{MARK}=yes")
        assert 0 == done.returncode, done.stderr
        assert "yes" == node_meta(cluster, MINE)[0].get(MARK)
        done = kubectl_as(as_agent_a, "annotate", "node", MINE, f"{MARK}=yes")
        assert 0 == done.returncode, done.stderr
        done = kubectl_as(as_agent_a, "create", "-f", "-", input=event(MINE))
        assert 0 == done.returncode, done.stderr
        done = kubectl_as(as_agent_a, "label", "node", MINE, f"{MARK}-")
        assert 0 == done.returncode, done.stderr
        done = kubectl_as(as_agent_a, "annotate", "node", MINE, f"{MARK}-")
        assert 0 == done.returncode, done.stderr
        labels, notes = node_meta(cluster, MINE)
        assert MARK not in labels
        assert MARK not in notes
        assert 1 == len(events(cluster, MINE))
    finally:
        cluster.kubectl("label", "node", MINE, f"{MARK}-")
        cluster.kubectl("annotate", "node", MINE, f"{MARK}-")
        for e in events(cluster, MINE):
            cluster.kubectl("delete", "event", "-n", "default", e["metadata"]["name"], "--ignore-not-found")


def test_the_agents_token_changes_nothing_of_another_node(
    dra_chart: Cluster, as_agent_a: Path, slice_of_b: str
) -> None:
    cluster = dra_chart
    labels_before, notes_before = node_meta(cluster, OTHER)
    slice_before = cluster.get(f"/apis/resource.k8s.io/v1/resourceslices/{slice_of_b}")
    config = f"nvidia.com/device-plugin.config={labels_before['nvidia.com/device-plugin.config']}-x"
    attempts = {
        "a new nvidia.com/ label": (("label", "node", OTHER, f"{MARK}=yes"), REFUSED_NODE),
        "its config label": (("label", "node", OTHER, config, "--overwrite"), REFUSED_NODE),
        "its state label removed": (("label", "node", OTHER, "nvidia.com/mig.config.state-"), REFUSED_NODE),
        "an agent's annotation": (("annotate", "node", OTHER, f"{MARK}=yes"), REFUSED_NODE),
        "the agent's layout annotation": (
            ("annotate", "node", OTHER, f"{LAYOUT}=forged", "--overwrite"),
            REFUSED_NODE,
        ),
        "an Event about it": (("create", "-f", "-"), REFUSED_EVENT),
        "a ResourceSlice of it created": (("create", "-f", "-"), REFUSED_SLICE),
        "its ResourceSlice changed": (
            ("label", "resourceslice", slice_of_b, f"{MARK}=yes"),
            REFUSED_SLICE,
        ),
        "its ResourceSlice deleted": (("delete", "resourceslice", slice_of_b), REFUSED_SLICE),
    }
    forged_slice = json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"generateName": "forged-"},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": OTHER,
                "pool": {"name": OTHER, "generation": 99, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-99"}],
            },
        }
    )
    inputs = {"an Event about it": event(OTHER), "a ResourceSlice of it created": forged_slice}
    for what, (args, message) in attempts.items():
        done = kubectl_as(as_agent_a, *args, input=inputs.get(what))
        try:
            refused(done, message)
        except AssertionError as err:
            raise AssertionError(f"{what}: {err}") from None
    # Nothing of node-b's changed: its labels and annotations (less what its own agent keeps
    # current, which the attempts did not touch), no Event, its slice as it was, no forged slice.
    labels, notes = node_meta(cluster, OTHER)
    assert labels_before == labels
    assert MARK not in notes
    assert notes_before.get(LAYOUT) == notes.get(LAYOUT)
    assert [] == events(cluster, OTHER)
    after = cluster.get(f"/apis/resource.k8s.io/v1/resourceslices/{slice_of_b}")
    assert slice_before["metadata"]["resourceVersion"] == after["metadata"]["resourceVersion"]
    slices = cluster.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    assert [] == [s["metadata"]["name"] for s in slices if s["metadata"]["name"].startswith("forged-")]


def test_node_bs_agent_is_refused_node_a_just_the_same(dra_chart: Cluster) -> None:
    """The policy is the same for every agent: node-b's token is refused node-a's labels, and
    still changes node-b's own (two real agents, each bound to its node)."""
    cluster = dra_chart
    as_b = token_kubeconfig(cluster, agent_token(cluster, OTHER), f"agent-{OTHER}-{uuid.uuid4().hex[:6]}")
    done = kubectl_as(as_b, "label", "node", MINE, f"{MARK}=yes")
    refused(done, f"the gpu-sharing agent on {OTHER} may only update its own Node")
    assert MARK not in node_meta(cluster, MINE)[0]
    try:
        done = kubectl_as(as_b, "label", "node", OTHER, f"{MARK}=yes")
        assert 0 == done.returncode, done.stderr
        assert "yes" == node_meta(cluster, OTHER)[0].get(MARK)
    finally:
        cluster.kubectl("label", "node", OTHER, f"{MARK}-")
