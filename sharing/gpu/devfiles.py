"""The files a container needs from the NVIDIA driver, for the CDI spec the agent writes.

They are found under the driver root, as NVIDIA's container toolkit finds them for `nvidia-ctk cdi
generate` (github.com/NVIDIA/nvidia-container-toolkit, pkg/nvcdi/ and internal/discover/):

- Device nodes. Every container with a GPU gets the control nodes `/dev/nvidiactl`,
  `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` and `/dev/nvidia-modeset` (pkg/nvcdi/common-nvml.go,
  controlDeviceNodeDiscoverer); a whole GPU is `/dev/nvidia<minor>` (internal/platform-support/dgpu/
  nvml.go); a MIG device is its GPU's node plus the access nodes of its GPU instance and compute
  instance, `/dev/nvidia-caps/nvidia-cap<N>`, N the `DeviceFileMinor` the driver lists in
  `/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access` and `.../gi<g>/ci<c>/access`
  (newNvmlMigDiscoverer there; MIG user guide, "Device Nodes and Capabilities":
  https://docs.nvidia.com/datacenter/tesla/mig-user-guide/#device-nodes-and-capabilities).
  A node that does not exist is left out, as the toolkit's char-device locator leaves it out
  (internal/discover/char_devices.go over mounts.go).
- Libraries: every `lib*.so.<version>` of the driver's library directories (pkg/nvcdi/driver-nvml.go,
  getVersionLibs; the directories of pkg/lookup/library.go), and the links there that lead to one
  (`libcuda.so.1`, `libnvidia-ml.so.1`, `libcuda.so`): the names the toolkit recreates in the
  container with a `create-symlinks` hook (internal/discover/symlinks.go). The toolkit asks NVML
  for the version and falls back to the name of `libcuda.so.<version>` or `libnvidia-ml.so.<version>`
  (internal/lookup/root/root.go, inferVersion); here the file `libcuda.so.1` (else
  `libnvidia-ml.so.1`) leads to decides, being what a container loads, so the files of an older
  driver left beside it stay out (without the links, the first version by name, as the toolkit's
  fallback). A library the driver lacks is simply not listed.
- Binaries: `nvidia-smi` and the other tools of newDriverBinariesDiscoverer (driver-nvml.go), the
  first executable of each in the default PATH (pkg/lookup/path.go).

A file's container path is its path relative to the driver root; its host path is the same
relative path under `host_root`, the node's path of that root, which differs when the agent's
container mounts it elsewhere. NVIDIA's device plugin does the same: it reads the node's
`nvidiaDriverRoot` mounted at `containerDriverRoot` (`/driver-root`) and rewrites the spec's host
paths from one to the other (github.com/NVIDIA/k8s-device-plugin, internal/cdi/cdi.go,
getRootTransformer). Mounted at the same path as on the node, the two roots are one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sharing.model import ComputeInstance, Gpu, GpuInstance

_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.M)
_VERSION = re.compile(r"^\d+\.\d+(\.\d+)*$")
CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
LIBRARY_DIRS = tuple(
    f"{top}/{arch}{sub}"
    for top in ("usr/lib", "lib")
    for arch in ("64", "/x86_64-linux-gnu", "/aarch64-linux-gnu")
    for sub in ("", "/nvidia/current")
    if not (arch == "64" and sub)
)
"""Where the toolkit's library locator looks, in its order (pkg/lookup/library.go)."""
VERSION_LIBRARIES = ("libcuda.so", "libnvidia-ml.so")
BINARY_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)


@dataclass(frozen=True, slots=True)
class DriverFile:
    """A file of the driver: where the container sees it, and where it is on the node."""

    path: str
    host_path: str


class DeviceFiles(Protocol):
    """Where the driver's files are: per GPU and MIG device, and those every device needs."""

    def common(self) -> tuple[DriverFile, ...]:
        """The device nodes every container with any device needs."""
        ...

    def mounts(self) -> tuple[DriverFile, ...]:
        """The libraries and binaries every container with any device gets, mounted read-only."""
        ...

    def for_gpu(self, gpu: Gpu) -> tuple[DriverFile, ...]:
        """A whole GPU's device nodes."""
        ...

    def for_mig(self, gpu: Gpu, gi: GpuInstance, ci: ComputeInstance) -> tuple[DriverFile, ...]:
        """One MIG device's (its GPU's node, then the GPU- and compute-instance access nodes)."""
        ...


class DriverFiles:
    """The files of the driver under `root`, named for a node that has that root at `host_root`."""

    def __init__(self, root: Path = Path("/"), host_root: Path | None = None) -> None:
        self.root = root
        self.host_root = root if host_root is None else host_root
        self.dev = root / "dev"
        self.caps = root / "proc/driver/nvidia/capabilities"

    def common(self) -> tuple[DriverFile, ...]:
        return self._nodes(self.dev / name for name in CONTROL)

    def mounts(self) -> tuple[DriverFile, ...]:
        return (*self._libraries(), *self._binaries())

    def for_gpu(self, gpu: Gpu) -> tuple[DriverFile, ...]:
        return () if gpu.minor is None else self._nodes([self.dev / f"nvidia{gpu.minor}"])

    def for_mig(self, gpu: Gpu, gi: GpuInstance, ci: ComputeInstance) -> tuple[DriverFile, ...]:
        if gpu.minor is None:
            return ()
        base = self.caps / f"gpu{gpu.minor}" / "mig" / f"gi{gi.id}"
        caps = (_cap_minor(base / "access"), _cap_minor(base / f"ci{ci.id}" / "access"))
        nodes = (self.dev / "nvidia-caps" / f"nvidia-cap{n}" for n in caps if n is not None)
        return (*self.for_gpu(gpu), *self._nodes(nodes))

    def _file(self, path: Path, found: Path | None = None) -> DriverFile:
        """`path` (under the root) as the container and the node name it; `found` its target."""
        rel = path.relative_to(self.root)
        host = self.host_root / (found or path).relative_to(self.root)
        return DriverFile(f"/{rel}", str(host))

    def _nodes(self, paths: Iterable[Path]) -> tuple[DriverFile, ...]:
        return tuple(self._file(p) for p in paths if p.exists())

    def _libraries(self) -> Iterator[DriverFile]:
        dirs = list(_distinct(self.root / d for d in LIBRARY_DIRS))
        version = self._version(dirs)
        if version is None:
            return
        for d in dirs:
            names = sorted(_names(d))
            libs = {d / n for n in names if n.startswith("lib") and n.endswith(f".so.{version}")}
            libs = {p for p in libs if self._resolve(p) == p}
            stems = tuple(p.name[: -len(version) - 1] for p in libs)  # `libcuda.so`
            for name in names:
                path = d / name
                if path in libs:
                    yield self._file(path)
                elif name.startswith(stems) and path.is_symlink():
                    target = self._resolve(path)
                    if target in libs:
                        yield self._file(path, target)

    def _version(self, dirs: list[Path]) -> str | None:
        """The version `libcuda.so.1` (else `libnvidia-ml.so.1`) leads to, else the first by name."""
        candidates = [(lib, d) for lib in VERSION_LIBRARIES for d in dirs]
        for lib, d in candidates:
            target = self._resolve(d / f"{lib}.1")
            if target is not None and (version := _suffix(target.name, lib)):
                return version
        for lib, d in candidates:
            named = sorted(v for n in _names(d) if (v := _suffix(n, lib)))
            if named:
                return named[0]
        return None

    def _binaries(self) -> Iterator[DriverFile]:
        for name in BINARIES:
            for d in BINARY_DIRS:
                found = self._resolve(self.root / d / name)
                if found is not None and os.access(found, os.X_OK):
                    yield self._file(self.root / d / name, found)
                    break

    def _resolve(self, path: Path) -> Path | None:
        """The file `path` leads to, its links followed inside the root; None if none there."""
        for _ in range(40):
            if not path.is_symlink():
                return path if path.is_file() else None
            try:
                target = os.readlink(path)
            except OSError:
                return None
            path = Path(
                os.path.normpath((self.root if target[:1] == "/" else path.parent) / target.lstrip("/"))
            )
            if not path.is_relative_to(self.root):
                return None
        return None


def _distinct(dirs: Iterable[Path]) -> Iterator[Path]:
    """Existing directories, each once (`lib` is a link to `usr/lib` on merged-/usr systems)."""
    seen: set[tuple[int, int]] = set()
    for d in dirs:
        try:
            st = d.stat()
        except OSError:
            continue
        if d.is_dir() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            yield d


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _suffix(name: str, lib: str) -> str | None:
    """The version in a library's name: `580.65.06` in `libcuda.so.580.65.06`, none in `libcuda.so.1`."""
    rest = name[len(lib) + 1 :] if name.startswith(f"{lib}.") else ""
    return rest if _VERSION.match(rest) else None


def _cap_minor(path: Path) -> int | None:
    try:
        match = _MINOR.search(path.read_text("utf-8", "replace")[:4096])
    except OSError:
        return None
    return int(match.group(1)) if match else None
