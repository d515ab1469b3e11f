"""`kubectl apply -f deploy/` (the chart's default render) never loses a user's ConfigMap edit.

deploy/ ships the presets (gpu-sharing-presets, replaced on every apply) but not the user's
gpu-sharing-config, so applying it again leaves the user's configs exactly as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import lab
import pytest

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAMESPACE = "gpu-sharing"
MINE = "version: v1\ngpus:\n  - devices: all\n    replicas: 3\n"


def test_applying_deploy_again_keeps_the_users_configmap_edits(control_plane: lab.ControlPlane) -> None:
    kubectl = control_plane.kubectl
    kubectl("apply", "-f", str(DEPLOY), check=True)
    if kubectl("get", "configmap", "gpu-sharing-config", "-n", NAMESPACE).returncode != 0:
        kubectl("create", "configmap", "gpu-sharing-config", "-n", NAMESPACE, check=True)
    patch = json.dumps({"data": {"mine": MINE}})
    kubectl(
        "patch", "configmap", "gpu-sharing-config", "-n", NAMESPACE, "--type=merge", "-p", patch, check=True
    )
    before = json.loads(
        kubectl("get", "configmap", "gpu-sharing-config", "-n", NAMESPACE, "-o", "json").stdout
    )

    applied = kubectl("apply", "-f", str(DEPLOY), check=True).stdout
    assert "configmap/gpu-sharing-presets" in applied
    assert "configmap/gpu-sharing-config" not in applied

    after = json.loads(
        kubectl("get", "configmap", "gpu-sharing-config", "-n", NAMESPACE, "-o", "json").stdout
    )
    assert before["data"] == after["data"]
    assert MINE == after["data"]["mine"]
    kubectl("patch", "configmap", "gpu-sharing-config", "-n", NAMESPACE, "--type=json", "-p",
            '[{"op": "remove", "path": "/data/mine"}]', check=True)  # fmt: skip
