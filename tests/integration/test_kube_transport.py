"""The agent's Kubernetes client (the official `kubernetes` client underneath) against a real
kube-apiserver, once per way a kubeconfig can authenticate: a client certificate, a bearer token, an
exec credential plugin. Each must read, watch, patch and report errors alike, and survive an API
server restart."""

from __future__ import annotations

import datetime
import json
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import lab
import pytest

from sharing.errors import KubeError
from sharing.kube import ApiClient, NodeObject

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def admin_token(control_plane: lab.ControlPlane) -> str:
    """A ServiceAccount bound to cluster-admin, for the token and exec kubeconfigs."""
    ns = f"transport-{uuid.uuid4().hex[:6]}"
    for args in (
        ("create", "namespace", ns),
        ("-n", ns, "create", "serviceaccount", "admin"),
        ("create", "clusterrolebinding", ns, "--clusterrole=cluster-admin", f"--serviceaccount={ns}:admin"),
    ):
        control_plane.kubectl(*args, check=True)
    token = control_plane.kubectl("-n", ns, "create", "token", "admin", check=True).stdout.strip()
    assert token
    return token


def exec_kubeconfig(cp: lab.ControlPlane, token: str, path: Path) -> Path:
    """A kubeconfig whose user is an exec credential plugin (as cloud CLIs write them)."""
    api = "client.authentication.k8s.io/v1"
    credential = json.dumps({"apiVersion": api, "kind": "ExecCredential", "status": {"token": token}})
    script = path.with_suffix(".sh")
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{credential}\nEOF\n")
    script.chmod(0o700)
    cluster = {"server": cp.server, "certificate-authority": str(cp.ca_path)}
    user = {
        "exec": {
            "apiVersion": api,
            "command": str(script),
            "interactiveMode": "Never",
        }
    }
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(params=["client-certificate", "token", "exec-plugin"])
def client(
    request: pytest.FixtureRequest, control_plane: lab.ControlPlane, admin_token: str, tmp_path: Path
) -> Iterator[ApiClient]:
    kind = request.param
    if kind == "client-certificate":
        path = control_plane.kubeconfig
    elif kind == "token":
        path = control_plane.token_kubeconfig(admin_token, "transport")
    else:
        path = exec_kubeconfig(control_plane, admin_token, tmp_path / "exec.kubeconfig")
    api = ApiClient(str(path))
    yield api
    api.close()


@pytest.fixture
def node(control_plane: lab.ControlPlane) -> Iterator[str]:
    name = f"transport-{uuid.uuid4().hex[:6]}"
    manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"a": "1"}}}
    control_plane.kubectl("create", "-f", "-", input=json.dumps(manifest), check=True)
    yield name
    control_plane.kubectl("delete", "node", name, "--wait=false")


def test_reads_patches_and_watches_the_node(
    client: ApiClient, control_plane: lab.ControlPlane, node: str
) -> None:
    before = client.get_node(node)
    assert before.labels["a"] == "1"

    patched = client.patch_node_labels(node, {"a": None, "b": "2"}, {"example.com/note": "x"})
    assert "a" not in patched.labels
    assert patched.labels["b"] == "2"
    assert patched.annotations["example.com/note"] == "x"

    control_plane.kubectl("label", "node", node, "c=3", check=True)
    events = client.watch_node(node, patched.resource_version, timeout_s=5)
    first = next(iter(events))
    events.close()  # type: ignore[attr-defined]  # a generator: closing it closes the watch
    assert first.kind == "MODIFIED"
    assert isinstance(first.object, NodeObject)
    assert first.object.labels["c"] == "3"


def test_a_write_after_an_api_server_restart_is_not_lost(
    client: ApiClient, control_plane: lab.ControlPlane, node: str
) -> None:
    """The restart leaves the client a kept-alive connection the server has dropped; the first write
    after it (the agent's `pending` state label) failed with SSLEOFError and was lost."""
    client.get_node(node)  # the connection stays open for the next request
    control_plane.restart_apiserver()
    patched = client.patch_node_labels(node, {"nvidia.com/mig.config.state": "pending"})
    assert "pending" == patched.labels["nvidia.com/mig.config.state"]
    assert "pending" == client.get_node(node).labels["nvidia.com/mig.config.state"]


def test_events_land_on_the_node(client: ApiClient, control_plane: lab.ControlPlane, node: str) -> None:
    client.create_node_event(client.get_node(node), "Warning", "TransportCheck", "through this kubeconfig")
    listed = control_plane.kubectl(
        "get", "events", "-n", "default", "--field-selector", f"involvedObject.name={node}", "-o", "json",
        check=True,
    )  # fmt: skip
    reasons = [(e["reason"], e["message"]) for e in json.loads(listed.stdout)["items"]]
    assert ("TransportCheck", "through this kubeconfig") in reasons


def test_a_missing_configmap_is_no_error_and_a_missing_node_is_one(client: ApiClient) -> None:
    missing = client.get_configmap("default", f"none-{uuid.uuid4().hex[:6]}")
    assert missing.data is None
    with pytest.raises(KubeError, match="404"):
        client.get_node(f"none-{uuid.uuid4().hex[:6]}")


def test_a_forbidden_request_says_so(control_plane: lab.ControlPlane, tmp_path: Path) -> None:
    ns = f"weak-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    control_plane.kubectl("-n", ns, "create", "serviceaccount", "weak", check=True)
    token = control_plane.kubectl("-n", ns, "create", "token", "weak", check=True).stdout.strip()
    for path in (
        control_plane.token_kubeconfig(token, "weak"),
        exec_kubeconfig(control_plane, token, tmp_path / "weak.kubeconfig"),
    ):
        api = ApiClient(str(path))
        with pytest.raises(KubeError, match="403") as raised:
            api.get_node("anything")
        api.close()
        assert f"system:serviceaccount:{ns}:weak" in str(raised.value)


def test_in_cluster_credentials_pick_up_a_rotated_token(
    control_plane: lab.ControlPlane, admin_token: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod the kubelet rewrites the ServiceAccount token before it expires; the client reads the
    file again once a minute (kubernetes/config/incluster_config.py). The clock is moved on a minute
    instead of waiting for it; the new token is a weaker ServiceAccount's, so its 403 shows it is used."""
    from kubernetes.config import incluster_config  # noqa: PLC0415 - the in-cluster paths, pointed here

    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text(admin_token)
    ca.write_bytes(control_plane.ca_path.read_bytes())
    server = control_plane.server.removeprefix("https://")
    host, port = server.rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    api = ApiClient()
    assert api.get_configmap("default", "none").data is None  # the admin token is accepted

    ns = f"rotated-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    control_plane.kubectl("-n", ns, "create", "serviceaccount", "weak", check=True)
    token.write_text(control_plane.kubectl("-n", ns, "create", "token", "weak", check=True).stdout.strip())

    class Later(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> Later:
            return super().now(tz) + datetime.timedelta(minutes=2)  # type: ignore[return-value]

    clock = types.SimpleNamespace(datetime=Later, timedelta=datetime.timedelta)
    monkeypatch.setattr(incluster_config, "datetime", clock)  # that module's clock only
    with pytest.raises(KubeError, match="403") as raised:
        api.get_node("anything")
    api.close()
    assert f"system:serviceaccount:{ns}:weak" in str(raised.value)
