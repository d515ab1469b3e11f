"""Helm (built from its Go module) against a lab cluster, and the chart values the lab installs with.

Helm keeps its caches and config under the lab's cache (``HELM_*_HOME``), never in the user's home.
``lab_values`` are what a user would set on a node with the lab's fake NVIDIA driver (lab.driver),
adjusted to the agent in this checkout:
probes only when the agent serves them, and the presets copied into the user's map only while the
agent does not read the presets ConfigMap itself (so the same chart works before and after).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab import driver
from lab.binaries import binaries
from lab.errors import ClusterError
from lab.images import agent_image
from lab.paths import REPO, cache_dir

CHART = REPO / "deploy" / "helm" / "gpu-sharing"
RELEASE = "gpu-sharing"
NAMESPACE = "gpu-sharing"


class Helm:
    """``helm`` with the given kubeconfig; values are passed as a file (JSON is YAML)."""

    def __init__(self, kubeconfig: Path, *, binary: Path | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.binary = binary or binaries().helm
        home = cache_dir() / "helm"
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def run(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise ClusterError(f"helm {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done

    def upgrade_install(self, values: Mapping[str, Any], *, extra: Sequence[str] = ()) -> str:
        """``helm upgrade --install`` of the chart in the repository; returns helm's output."""
        path = cache_dir() / "helm" / f"values-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values, indent=2))
        try:
            args = [
                "upgrade",
                "--install",
                RELEASE,
                str(CHART),
                "--namespace",
                NAMESPACE,
                "--create-namespace",
            ]
            return self.run(*args, "--values", str(path), *extra).stdout
        finally:
            path.unlink(missing_ok=True)

    def uninstall(self) -> str:
        return self.run("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait").stdout

    def status(self) -> dict[str, Any]:
        done = self.run("status", RELEASE, "--namespace", NAMESPACE, "--output", "json", check=False)
        return dict(json.loads(done.stdout)) if done.returncode == 0 else {}


def lab_values(configs: Mapping[str, str] | None = None, **overrides: Any) -> dict[str, Any]:
    """Values for the lab: the local image, the node's fake driver, the user's ``configs`` (name: YAML)."""
    repository, _, tag = agent_image().rpartition(":")
    user = dict(configs or {})
    values: dict[str, Any] = {
        "image": {"repository": repository.removeprefix("docker.io/library/"), "tag": tag},
        # The fake driver writes its state and device stand-ins under its root: mounted read-write.
        "driverRoot": driver.NODE_DRIVER_ROOT,
        "driverRootReadOnly": False,
        "logFormat": "console",
        "config": {"create": True, "map": user},
    }
    return {**values, **overrides}
