"""Container images without a registry: pause, a busybox toolbox, and the agent from deploy/Dockerfile.

Each image is a docker-archive tarball under ``<cache>/images``, named after a hash of everything it
is made from, so an unchanged input is never rebuilt and a changed one always is. The node imports
the tarballs into its containerd; pods find them by name and never pull (``IfNotPresent``).

- ``registry.k8s.io/pause:3.10``: the static Go pause binary alone (containerd's sandbox image).
- ``localhost/toolbox:1``: busybox-static with ``sh env cat ls sleep grep head stat wget`` for test pods.
- ``docker.io/library/gpu-sharing:<version>``: ``deploy/Dockerfile`` unmodified, built by buildah
  ``--from`` a Debian base made with mmdebstrap (python3 + pip): ``python:3.11-slim`` cannot be pulled
  here. pip inside the build sees this machine's TLS interception, so the host CA bundle is mounted
  over the base's for the build only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

from lab import packages
from lab.binaries import Binaries
from lab.errors import ClusterError
from lab.paths import REPO, cache_dir

PAUSE = "registry.k8s.io/pause:3.10"
TOOLBOX = "localhost/toolbox:1"
TOOLBOX_APPLETS = ("sh", "env", "cat", "ls", "sleep", "grep", "head", "stat", "wget")
BASE_PACKAGES = "python3,python3-pip,ca-certificates"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
STALE_S = 3600
"""An image archive no checkout has used for this long is removed when another of its name is built."""
# What deploy/Dockerfile copies into the image, relative to the repository root.
AGENT_INPUTS = ("deploy/Dockerfile", "pyproject.toml", "README.md", "sharing")


def version() -> str:
    """The project's version (pyproject.toml): the agent image's tag and the chart's appVersion."""
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def agent_image() -> str:
    return f"docker.io/library/gpu-sharing:{version()}"


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def _files(root: Path, rels: Iterable[str]) -> Iterable[bytes]:
    for rel in rels:
        path = root / rel
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file() and "__pycache__" not in f.parts:
                yield str(f.relative_to(root)).encode()
                yield f.read_bytes()


def _run(*cmd: str, cwd: Path | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False)
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def _cached(name: str, key: str, build: Callable[[Path], None]) -> Path:
    """``<cache>/images/<name>-<key>.tar``, built by ``build(tmp_path)`` when missing."""
    out = cache_dir() / "images" / f"{name}-{key}.tar"
    if out.exists():
        os.utime(out)  # in use: not stale for another checkout's build (below)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"==> building image {name} ({key})", file=sys.stderr, flush=True)
    start = time.monotonic()
    tmp = out.with_suffix(f".tmp.{os.getpid()}")
    try:
        build(tmp)
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    # The cache does not grow: other images of this name go once no checkout has used them for an
    # hour. Not at once: another checkout of other sources (a worktree testing beside this one) may
    # have just been handed its archive and be about to import it into its nodes.
    for stale in out.parent.glob(f"{name}-*.tar"):
        with contextlib.suppress(FileNotFoundError):
            if stale != out and time.time() - stale.stat().st_mtime > STALE_S:
                stale.unlink(missing_ok=True)
    print(f"==> built image {name} in {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    return out


def _pack(fill: Callable[[Path], None], ref: str, out: Path, config: Iterable[str]) -> None:
    """An image from scratch: ``fill(rootfs)``, then umoci config flags, then a docker archive."""
    with tempfile.TemporaryDirectory(prefix="lab-image-") as tmp:
        layout, bundle = Path(tmp) / "oci", Path(tmp) / "bundle"
        _run("umoci", "init", "--layout", str(layout))
        _run("umoci", "new", "--image", f"{layout}:latest")
        _run("umoci", "unpack", "--image", f"{layout}:latest", str(bundle))
        fill(bundle / "rootfs")
        _run("umoci", "repack", "--image", f"{layout}:latest", str(bundle))
        _run("umoci", "config", "--image", f"{layout}:latest", *config)
        _run("skopeo", "copy", "--quiet", f"oci:{layout}:latest", f"docker-archive:{out}:{ref}")


def pause(bins: Binaries) -> Path:
    def fill(rootfs: Path) -> None:
        shutil.copy(bins.pause, rootfs / "pause")

    key = _digest([bins.pause.read_bytes()])
    return _cached("pause", key, lambda out: _pack(fill, PAUSE, out, ["--config.entrypoint=/pause"]))


def toolbox() -> Path:
    busybox = Path("/bin/busybox")

    def fill(rootfs: Path) -> None:
        (rootfs / "bin").mkdir()
        shutil.copy(busybox, rootfs / "bin" / "busybox")
        for applet in TOOLBOX_APPLETS:
            (rootfs / "bin" / applet).symlink_to("busybox")

    key = _digest([busybox.read_bytes(), " ".join(TOOLBOX_APPLETS).encode()])
    config = ["--config.env=PATH=/bin", "--config.cmd=sh"]
    return _cached("toolbox", key, lambda out: _pack(fill, TOOLBOX, out, config))


def base() -> Path:
    """Debian bookworm minbase with python3 and pip: the stand-in for ``python:3.11-slim``."""

    def fill(rootfs: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="lab-base-") as tmp:
            tar = Path(tmp) / "rootfs.tar"
            _run(
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                f"--include={BASE_PACKAGES}",
                "bookworm",
                str(tar),
            )
            _run("tar", "-xf", str(tar), "-C", str(rootfs))

    config = [
        "--config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        # Debian's pip refuses system-wide installs (PEP 668); a container image is the system.
        "--config.env=PIP_BREAK_SYSTEM_PACKAGES=1",
        "--config.env=REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt",
        "--config.cmd=python3",
    ]
    key = _digest([b"bookworm minbase", BASE_PACKAGES.encode(), *(c.encode() for c in config)])
    return _cached("base", key, lambda out: _pack(fill, "localhost/debian-python:bookworm", out, config))


def agent() -> Path:
    """The agent image built from ``deploy/Dockerfile`` as users build it."""
    packages.ensure()
    base_tar = base()
    key = _digest([base_tar.name.encode(), *_files(REPO, AGENT_INPUTS)])

    def build(out: Path) -> None:
        store = cache_dir() / "images" / "buildah"
        storage = [
            "--root",
            str(store / "root"),
            "--runroot",
            str(store / "run"),
            "--storage-driver",
            "overlay",
        ]
        with tempfile.TemporaryDirectory(prefix="lab-agent-") as tmp:
            context = Path(tmp)
            for rel in AGENT_INPUTS[1:]:
                src = REPO / rel
                if src.is_dir():
                    shutil.copytree(src, context / rel, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(src, context / rel)
            tag = f"localhost/gpu-sharing-build:{key}"
            _run(
                "buildah", *storage, "bud", "--isolation", "chroot", "--from", f"docker-archive:{base_tar}",
                "--volume", f"{HOST_CA}:/etc/ssl/certs/ca-certificates.crt:ro",
                "-f", str(REPO / "deploy" / "Dockerfile"), "-t", tag, str(context),
            )  # fmt: skip
            try:
                _run("buildah", *storage, "push", "--quiet", tag, f"docker-archive:{out}:{agent_image()}")
            finally:
                subprocess.run(
                    ["buildah", *storage, "rmi", "--all", "--force"], capture_output=True, check=False
                )

    return _cached("agent", key, build)


def all_images(bins: Binaries) -> list[Path]:
    """pause, toolbox and the agent, each built when its inputs changed; one builder at a time per
    cache (parallel test workers and the bench may ask at once: the second finds them built)."""
    lock = cache_dir() / "images.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        packages.ensure()
        return [pause(bins), toolbox(), agent()]
