"""The Kubernetes adapter without an API server: what a user sees for credentials it cannot load,
and that the official client stays off the path of the offline commands. The requests themselves
are tested against a real kube-apiserver (tests/integration/test_kube_transport.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sharing.errors import KubeError
from sharing.kube import ApiClient

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "none"
    with pytest.raises(KubeError, match=f"cannot load Kubernetes credentials from {missing}: no such file"):
        ApiClient(str(missing))


def test_a_kubeconfig_without_a_context_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts: []\n")
    with pytest.raises(KubeError, match=r"cannot load Kubernetes credentials from .*context"):
        ApiClient(str(path))


def test_outside_a_pod_in_cluster_credentials_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="in-cluster service account: Service host/port is not set"):
        ApiClient()


def test_validate_does_not_import_the_kubernetes_client() -> None:
    """`sharing validate` and `sharing plan` run offline: the client (~17 MB, ~0.2 s) is the agent's."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['sharing', 'validate', 'deploy/presets-configmap.yaml']\n"
        "try:\n    runpy.run_module('sharing', run_name='__main__')\n"
        "except SystemExit as done:\n    assert done.code == 0, done.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kubernetes', 'urllib3')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "[]" == done.stdout.splitlines()[-1]
