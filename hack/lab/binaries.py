"""The Go-built binaries the lab runs, from ``hack/build-go.sh`` or from ``SHARING_*`` overrides.

``hack/build-go.sh`` is the one build entry point: it builds what is missing into a content-keyed
cache directory and prints that directory. Each binary can be replaced by a prebuilt one through
its environment variable (envtest style), so a machine without Go can still run the lab.

The Kubernetes release is hack/go/k8s's unless ``SHARING_K8S_VERSION`` names another minor (``1.34``:
hack/go/k8s-1.34); ``binaries("1.34")`` asks for one explicitly (a node's kubelet of another release,
for version skew). Only the five Kubernetes daemons differ between releases.
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
    promtool: Path  # Prometheus's rule checker and rule unit tests: built with ``test_tools`` only
    pause: Path  # the pause image's only file
    kubectl: Path  # at the default release (hack/go/kubectl): in kubectl's skew with the lab's cluster

    @property
    def directory(self) -> Path:
        """Where the shim lives: containerd finds ``containerd-shim-runc-v2`` on its PATH."""
        return self.containerd_shim_runc_v2.parent


def env_var(field: str) -> str:
    """``kube_apiserver`` -> ``SHARING_KUBE_APISERVER``; the shim's is ``SHARING_CONTAINERD_SHIM``."""
    if field == "containerd_shim_runc_v2":
        return "SHARING_CONTAINERD_SHIM"
    return "SHARING_" + field.upper()


K8S_VERSION_ENV = "SHARING_K8S_VERSION"
KUBELET_VERSION_ENV = "SHARING_KUBELET_VERSION"


def _module(minor: str | None) -> Path:
    """The wrapper module of Kubernetes ``minor`` (``1.34``; None: the one ``SHARING_K8S_VERSION``
    names, else the default's)."""
    go = REPO / "hack" / "go"
    wanted = (minor or os.environ.get(K8S_VERSION_ENV) or "").removeprefix("v")
    wanted = ".".join(wanted.split(".")[:2])
    if not wanted or wanted == _minor(_required(go / "k8s" / "go.mod")):
        return go / "k8s"
    module = go / f"k8s-{wanted}"
    if not (module / "go.mod").is_file():
        others = sorted(p.name.removeprefix("k8s-") for p in go.glob("k8s-*"))
        default = _minor(_required(go / "k8s" / "go.mod"))
        raise ClusterError(
            f"no Kubernetes {wanted} in the lab (hack/go/k8s-{wanted}): {default} (the default) or "
            + (", ".join(others) or "none other")
        )
    return module


def _required(go_mod: Path) -> str:
    for line in go_mod.read_text().splitlines():
        words = line.split()
        if words[:1] == ["k8s.io/kubernetes"] and len(words) >= 2 and words[1] != "=>":
            return words[1]
        if words[:2] == ["require", "k8s.io/kubernetes"] and len(words) >= 3:
            return words[2]
    raise ClusterError(f"{go_mod.relative_to(REPO)} requires no k8s.io/kubernetes")


def _minor(version: str) -> str:
    return ".".join(version.removeprefix("v").split(".")[:2])


def kubernetes_version(minor: str | None = None) -> str:
    """The Kubernetes release the lab builds, as its binaries report it: ``v1.37.2`` (``k8s.io/kubernetes``
    in hack/go/k8s/go.mod), or the one of ``minor`` / ``SHARING_K8S_VERSION`` (``v1.34.4``)."""
    return _required(_module(minor) / "go.mod")


def default_kubernetes_version() -> str:
    """The default release (hack/go/k8s), whatever ``SHARING_K8S_VERSION`` says."""
    return _required(REPO / "hack" / "go" / "k8s" / "go.mod")


_cache: dict[tuple[str, bool], Binaries] = {}


def binaries(version: str | None = None, *, test_tools: bool = False) -> Binaries:
    """Paths of every binary: the ``SHARING_*`` overrides win, ``hack/build-go.sh`` provides the rest.

    ``version`` (``1.34``) picks the Kubernetes release of the five Kubernetes daemons; None: the one
    of ``SHARING_K8S_VERSION``, else the default. The build happens once per machine and release (the
    first takes ~30 minutes on 2 cores, another release ~10 more). Raises ``BinariesUnavailable`` when
    Go is missing and nothing is cached, ``ClusterError`` when a build fails.
    """
    release = kubernetes_version(version)
    key = (release, test_tools)
    if key in _cache:  # one build per process, release and set
        return _cache[key]
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
        bin_dir = _build(_minor(release), test_tools)
        if bin_dir is None:
            wanted = ", ".join(env_var(n) for n in missing)
            raise BinariesUnavailable(f"Go is not installed and nothing is cached; set {wanted}")
        for name in missing:
            paths[name] = bin_dir / name.replace("_", "-")
    _cache[key] = Binaries(**paths)
    return _cache[key]


def _build(minor: str, test_tools: bool) -> Path | None:
    # stderr (progress lines) goes straight to the caller's terminal or pytest's capture.
    env = os.environ | {K8S_VERSION_ENV: minor}
    args = [str(BUILD_SCRIPT), *(["--test-tools"] if test_tools else [])]
    proc = subprocess.run(args, stdout=subprocess.PIPE, text=True, check=False, cwd=REPO, env=env)
    if proc.returncode == NO_GO_EXIT:
        return None
    if proc.returncode != 0:
        raise ClusterError(f"hack/build-go.sh failed with exit code {proc.returncode} (its output is above)")
    return Path(proc.stdout.strip().splitlines()[-1])
