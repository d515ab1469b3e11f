"""The device files a container needs for each device, for the CDI spec the agent writes.

Real GPUs follow the NVIDIA driver's layout (MIG user guide, "Device Nodes and Capabilities":
https://docs.nvidia.com/datacenter/tesla/mig-user-guide/#device-nodes-and-capabilities):
every container using a GPU needs `/dev/nvidiactl` (and `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools`
where the driver made them); a whole GPU is `/dev/nvidia<minor>`; a MIG device needs its GPU's node
plus the access nodes of its GPU instance and compute instance, `/dev/nvidia-caps/nvidia-cap<N>`,
where N is the `DeviceFileMinor` the driver lists in
`/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access` and `.../gi<g>/ci<c>/access`.

Simulated GPUs get harmless character devices with `/dev/null`'s numbers (1, 3) under the
simulator's own directory, at the same container paths, so a CDI spec for them can be injected by a
real container runtime and seen in a real container without touching any real device.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sharing.model import ComputeInstance, Gpu, GpuInstance

_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.M)
COMMON = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


@dataclass(frozen=True, slots=True)
class DeviceFile:
    """A device node: where the container sees it, and where it is on the host."""

    path: str
    host_path: str


class DeviceFiles(Protocol):
    """Where the device files of GPUs and MIG devices are."""

    def common(self) -> tuple[DeviceFile, ...]:
        """What every container with any device needs."""
        ...

    def for_gpu(self, gpu: Gpu) -> tuple[DeviceFile, ...]:
        """A whole GPU."""
        ...

    def for_mig(self, gpu: Gpu, gi: GpuInstance, ci: ComputeInstance) -> tuple[DeviceFile, ...]:
        """One MIG device (its GPU's node, then the GPU- and compute-instance access nodes)."""
        ...


class DriverFiles:
    """The NVIDIA driver's device files, under `dev` and `caps` (normally /dev and /proc)."""

    def __init__(
        self, dev: Path = Path("/dev"), caps: Path = Path("/proc/driver/nvidia/capabilities")
    ) -> None:
        self.dev = dev
        self.caps = caps

    def common(self) -> tuple[DeviceFile, ...]:
        return tuple(_same(self.dev / name) for name in COMMON if (self.dev / name).exists())

    def for_gpu(self, gpu: Gpu) -> tuple[DeviceFile, ...]:
        return () if gpu.minor is None else (_same(self.dev / f"nvidia{gpu.minor}"),)

    def for_mig(self, gpu: Gpu, gi: GpuInstance, ci: ComputeInstance) -> tuple[DeviceFile, ...]:
        if gpu.minor is None:
            return ()
        base = self.caps / f"gpu{gpu.minor}" / "mig" / f"gi{gi.id}"
        caps = [_cap_minor(base / "access"), _cap_minor(base / f"ci{ci.id}" / "access")]
        nodes = [self.dev / "nvidia-caps" / f"nvidia-cap{n}" for n in caps if n is not None]
        return (*self.for_gpu(gpu), *(_same(p) for p in nodes))


class SimFiles:
    """Stand-ins under `root` (the simulator's directory), at the driver's container paths."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def common(self) -> tuple[DeviceFile, ...]:
        return tuple(f for f in (self._node("nvidiactl"),) if f is not None)

    def for_gpu(self, gpu: Gpu) -> tuple[DeviceFile, ...]:
        node = self._node(f"nvidia{gpu.index if gpu.minor is None else gpu.minor}")
        return () if node is None else (node,)

    def for_mig(self, gpu: Gpu, gi: GpuInstance, ci: ComputeInstance) -> tuple[DeviceFile, ...]:
        # The simulator has no capability files: the numbers only need to be distinct per device.
        base = 1 + 1000 * gpu.index + 10 * gi.id
        caps = (
            self._node(f"nvidia-caps/nvidia-cap{base}"),
            self._node(f"nvidia-caps/nvidia-cap{base + 1 + ci.id}"),
        )
        return (*self.for_gpu(gpu), *(c for c in caps if c is not None))

    def _node(self, name: str) -> DeviceFile | None:
        """The stand-in for /dev/<name>, made when missing; None where device nodes cannot be made."""
        host = self.root / name
        if not host.exists():
            try:
                host.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mknod(host, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            except OSError:
                return None  # not root: no stand-ins, the spec names no device files
        return DeviceFile(f"/dev/{name}", str(host))


def _same(path: Path) -> DeviceFile:
    return DeviceFile(str(path), str(path))


def _cap_minor(path: Path) -> int | None:
    try:
        match = _MINOR.search(path.read_text("utf-8", "replace")[:4096])
    except OSError:
        return None
    return int(match.group(1)) if match else None
