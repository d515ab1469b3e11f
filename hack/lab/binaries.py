"""The Go-built binaries the lab runs, from ``hack/build-go.sh`` or from ``SHARING_*`` overrides.

``hack/build-go.sh`` is the one build entry point: it builds what is missing into a content-keyed
cache directory and prints that directory. Each binary can be replaced by a prebuilt one through
its environment variable (envtest style), so a machine without Go can still run the lab.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path

from lab.errors import BinariesUnavailable, ClusterError
from lab.paths import BUILD_SCRIPT, REPO

# build-go.sh exits with this code when Go is missing and nothing matching is cached.
NO_GO_EXIT = 3


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every binary; the field name is the binary's name with ``_`` for ``-``."""

    kube_apiserver: Path
    etcd: Path
    kubelet_harness: Path
    stub_device_plugin: Path  # a minimal Go device plugin, a test peer for the harness
    dra_kubelet: Path  # the kubelet's own DRA plugin watcher and client, a test peer for DRA plugins
    kubelet: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    kube_proxy: Path
    containerd: Path
    containerd_shim_runc_v2: Path
    ctr: Path
    helm: Path
    pause: Path  # the pause image's only file

    @property
    def directory(self) -> Path:
        """Where the shim lives: containerd finds ``containerd-shim-runc-v2`` on its PATH."""
        return self.containerd_shim_runc_v2.parent


def env_var(field: str) -> str:
    """``kube_apiserver`` -> ``SHARING_KUBE_APISERVER``; the shim's is ``SHARING_CONTAINERD_SHIM``."""
    if field == "containerd_shim_runc_v2":
        return "SHARING_CONTAINERD_SHIM"
    return "SHARING_" + field.upper()


def kubernetes_version() -> str:
    """The Kubernetes release the lab builds (``k8s.io/kubernetes`` in hack/go/k8s/go.mod), as its
    binaries report it: ``v1.37.2``."""
    for line in (REPO / "hack" / "go" / "k8s" / "go.mod").read_text().splitlines():
        words = line.split()
        if words[:1] == ["k8s.io/kubernetes"] and len(words) >= 2 and words[1] != "=>":
            return words[1]
    raise ClusterError("hack/go/k8s/go.mod requires no k8s.io/kubernetes")


_cache: Binaries | None = None


def binaries() -> Binaries:
    """Paths of every binary: the ``SHARING_*`` overrides win, ``hack/build-go.sh`` provides the rest.

    The build happens once per machine (the first takes ~25 minutes on 2 cores). Raises
    ``BinariesUnavailable`` when Go is missing and nothing is cached, ``ClusterError`` when a build
    fails.
    """
    global _cache  # noqa: PLW0603 - one build per process
    if _cache is not None:
        return _cache
    paths: dict[str, Path] = {}
    names = [f.name for f in fields(Binaries)]
    for name in names:
        value = os.environ.get(env_var(name))
        if value:
            path = Path(value)
            if not os.access(path, os.X_OK):
                raise ClusterError(f"{env_var(name)}={path} is not an executable file")
            paths[name] = path
    missing = [n for n in names if n not in paths]
    if missing:
        bin_dir = _build()
        if bin_dir is None:
            wanted = ", ".join(env_var(n) for n in missing)
            raise BinariesUnavailable(f"Go is not installed and nothing is cached; set {wanted}")
        for name in missing:
            paths[name] = bin_dir / name.replace("_", "-")
    _cache = Binaries(**paths)
    return _cache


def _build() -> Path | None:
    # stderr (progress lines) goes straight to the caller's terminal or pytest's capture.
    proc = subprocess.run([str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False, cwd=REPO)
    if proc.returncode == NO_GO_EXIT:
        return None
    if proc.returncode != 0:
        raise ClusterError(f"hack/build-go.sh failed with exit code {proc.returncode} (its output is above)")
    return Path(proc.stdout.strip().splitlines()[-1])
