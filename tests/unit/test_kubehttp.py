"""The standard-library Kubernetes transport: what it reads from a kubeconfig, what it leaves to the
official client, and a rotated ServiceAccount token being picked up."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from sharing import kubehttp
from sharing.kube import ApiClient
from sharing.kubelib import Library


def kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://10.0.0.1:6443"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [
            {"name": "other", "context": {"cluster": "c", "user": "nobody"}},
            {"name": "x", "context": {"cluster": "c", "user": "u"}},
        ],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    return path


def test_files_are_relative_to_the_kubeconfig_and_data_is_decoded(tmp_path: Path) -> None:
    cluster = {"server": "https://api:6443", "certificate-authority-data": base64.b64encode(b"CA").decode()}
    user = {"client-certificate": "certs/me.crt", "client-key-data": base64.b64encode(b"KEY").decode()}
    got = kubehttp.from_kubeconfig(str(kubeconfig(tmp_path, user, cluster)))
    expected = kubehttp.Credentials(
        server="https://api:6443",
        ca_data="CA",
        cert_file=str(tmp_path.resolve() / "certs" / "me.crt"),
        key_data=b"KEY",
    )
    assert expected == got


@pytest.mark.parametrize(
    "user",
    [
        {"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1"}},
        {"auth-provider": {"name": "oidc"}},
        {"username": "admin", "password": "secret"},
    ],
    ids=["exec", "auth-provider", "password"],
)
def test_other_ways_of_authenticating_go_to_the_official_client(tmp_path: Path, user: dict[str, Any]) -> None:
    path = str(kubeconfig(tmp_path, user))
    with pytest.raises(kubehttp.Unsupported):
        kubehttp.from_kubeconfig(path)
    # The agent still starts: the official client's transport takes the kubeconfig.
    assert isinstance(ApiClient(path)._http, Library)


def test_a_token_kubeconfig_uses_the_standard_library(tmp_path: Path) -> None:
    assert isinstance(ApiClient(str(kubeconfig(tmp_path, {"token": "t"})))._http, kubehttp.Http)


def test_a_rotated_token_file_is_read_again(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    http = kubehttp.Http(kubehttp.Credentials("https://api:6443", token_file=str(token)), "test")
    assert "Bearer first" == http._headers("application/json")["Authorization"]
    token.write_text("second\n")
    os.utime(token, (1, 1))  # a new mtime, as the kubelet's atomic rewrite gives
    assert "Bearer second" == http._headers("application/json")["Authorization"]


def test_outside_a_pod_in_cluster_credentials_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="not in a pod"):
        kubehttp.in_cluster()
