"""The agent's ServiceAccount, as an attacker holding its token would use it: only its own Node.

RBAC lets it patch every Node and create Events in `default`; the ValidatingAdmissionPolicy in
deploy/ narrows that to its own Node (the node claim of its pod-bound token), `nvidia.com/` labels,
its own annotations, and Events about that Node. Run against the real kube-apiserver with the
agent's own token; everything the agent itself needs is proven by the other e2e tests, which run it
with such a token.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import lab
import pytest
from lab.api import ApiError

from tests.apiserver import agent_token
from tests.e2e.conftest import NAMESPACE

pytestmark = pytest.mark.integration


@pytest.fixture
def nodes(deployed: lab.ControlPlane) -> Iterator[tuple[str, str]]:
    mine, other = (f"own-{uuid.uuid4().hex[:6]}" for _ in range(2))
    for name in (mine, other):
        manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"team": "a"}}}
        deployed.api.request("POST", "/api/v1/nodes", manifest, merge=False)
    yield mine, other
    pod = f"/api/v1/namespaces/{NAMESPACE}/pods/agent-{mine}"  # made by `as_agent`, where a test asks
    for path in (f"/api/v1/nodes/{mine}", f"/api/v1/nodes/{other}", pod):
        try:
            deployed.api.request("DELETE", path)
        except ApiError as err:
            if err.status != 404:
                raise


@pytest.fixture
def as_agent(deployed: lab.ControlPlane, nodes: tuple[str, str]) -> Path:
    return deployed.token_kubeconfig(agent_token(deployed, nodes[0]), f"attacker-{nodes[0]}")


def run(cp: lab.ControlPlane, kubeconfig: Path, *args: str, stdin: str | None = None) -> tuple[bool, str]:
    done = cp.kubectl(*args, kubeconfig=kubeconfig, input=stdin)
    # `kubectl cordon` reports a refused patch on stderr but exits 0.
    return done.returncode == 0 and "error:" not in done.stderr, done.stderr


def event(about: dict[str, str]) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "forged-", "namespace": "default"},
            "involvedObject": about,
            "reason": "Forged",
            "message": "an Event the agent should not be able to write",
            "type": "Warning",
        }
    )


def test_the_agent_changes_its_own_node_as_it_needs(
    deployed: lab.ControlPlane, nodes: tuple[str, str], as_agent: Path
) -> None:
    mine, _ = nodes
    ok = [
        run(deployed, as_agent, "label", "node", mine, "nvidia.com/gpu.count=2"),
        run(deployed, as_agent, "label", "node", mine, "nvidia.com/gpu.count-"),
        run(deployed, as_agent, "annotate", "node", mine, "nvidia.com/gpu-sharing.config=all-1g"),
        run(deployed, as_agent, "create", "-f", "-", stdin=event({"kind": "Node", "name": mine})),
    ]
    assert [(True, "")] * 4 == [(allowed, "") for allowed, _ in ok], ok


@pytest.mark.parametrize(
    ("attack", "refusal"),
    [
        pytest.param(
            ("label", "node", "{other}", "nvidia.com/gpu.count=9"),
            "may only update its own Node",
            id="label-another-node",
        ),
        pytest.param(
            ("label", "node", "{mine}", "team=b", "--overwrite"),
            "nvidia.com/ labels",
            id="change-a-label-it-does-not-own",
        ),
        pytest.param(
            ("label", "node", "{mine}", "team-"), "nvidia.com/ labels", id="remove-a-label-it-does-not-own"
        ),
        pytest.param(
            ("annotate", "node", "{mine}", "example.com/owner=me"),
            "gpu-sharing. annotations",
            id="foreign-annotation",
        ),
        pytest.param(("cordon", "{mine}"), "spec", id="cordon"),
        pytest.param(("taint", "node", "{mine}", "evil=yes:NoExecute"), "spec", id="taint-noexecute"),
        pytest.param(
            ("taint", "node", "{other}", "evil=yes:NoExecute"), "its own Node", id="taint-another-node"
        ),
    ],
)
def test_every_other_change_of_a_node_is_refused(
    deployed: lab.ControlPlane,
    nodes: tuple[str, str],
    as_agent: Path,
    attack: tuple[str, ...],
    refusal: str,
) -> None:
    mine, other = nodes
    allowed, error = run(deployed, as_agent, *(a.format(mine=mine, other=other) for a in attack))
    assert not allowed
    assert refusal in error
    for name in (mine, other):
        node = deployed.api.request("GET", f"/api/v1/nodes/{name}")
        assert "a" == node["metadata"]["labels"]["team"]
        assert "nvidia.com/gpu.count" not in node["metadata"]["labels"]
        assert [] == [t for t in node["spec"].get("taints", []) if t["key"] == "evil"]
        assert not node["spec"].get("unschedulable")


@pytest.mark.parametrize("agents", [True, False], ids=["its-own-cordon", "a-persons-cordon"])
def test_with_drain_mode_off_the_agent_may_undo_only_its_own_cordon(
    deployed: lab.ControlPlane, nodes: tuple[str, str], as_agent: Path, agents: bool
) -> None:
    mine, _ = nodes
    deployed.kubectl("cordon", mine, check=True)
    if agents:  # left by the agent while drain mode was on
        deployed.kubectl("annotate", "node", mine, "nvidia.com/gpu-sharing.cordoned=true", check=True)
    allowed, error = run(deployed, as_agent, "uncordon", mine)
    node = deployed.api.request("GET", f"/api/v1/nodes/{mine}")
    assert agents == allowed, error
    assert (not agents) == bool(node["spec"].get("unschedulable"))
    if not agents:
        assert "only undo its own cordon" in error


@pytest.mark.parametrize(
    "about",
    [
        pytest.param({"kind": "Node", "name": "{other}"}, id="another-node"),
        pytest.param({"kind": "Pod", "name": "kube-apiserver", "namespace": "default"}, id="a-pod"),
    ],
)
def test_events_about_anything_but_its_node_are_refused(
    deployed: lab.ControlPlane, nodes: tuple[str, str], as_agent: Path, about: dict[str, str]
) -> None:
    target = {k: v.format(other=nodes[1]) for k, v in about.items()}
    allowed, error = run(deployed, as_agent, "create", "-f", "-", stdin=event(target))
    assert not allowed
    assert "may only create Events about its own Node" in error


def test_a_token_without_a_node_claim_changes_nothing(
    deployed: lab.ControlPlane, nodes: tuple[str, str]
) -> None:
    token = deployed.kubectl("create", "token", "gpu-sharing", "-n", NAMESPACE, "--duration=10m", check=True)
    unbound = deployed.token_kubeconfig(token.stdout.strip(), "unbound-agent")
    allowed, error = run(deployed, unbound, "label", "node", nodes[0], "nvidia.com/gpu.count=1")
    assert not allowed
    assert "carries no node claim" in error
