"""The CDI spec of the devices the agent advertises, for the CDI device-list strategies.

With `cdi-annotations` or `cdi-cri`, Allocate names devices as `k8s.gpu-sharing.io/gpu=<name>` and
the container runtime (containerd >= 1.7, CRI-O) resolves those names in the specs of its CDI
directories (/etc/cdi, /var/run/cdi): https://github.com/cncf-tags/container-device-interface.
The agent keeps one spec of its own there, listing exactly the devices it advertises. It is rewritten,
atomically, before the plugins advertise a change, so a name the kubelet hands out always resolves
and a device that is gone never stays in it. The files come from the GPU backend
(`sharing.gpu.devfiles`); assembling the spec is pure.

The spec is laid out as NVIDIA's container toolkit lays out the one `nvidia-ctk cdi generate` writes
(github.com/NVIDIA/nvidia-container-toolkit, pkg/nvcdi/wrapper.go GetSpec): what every device needs
in the spec's own `containerEdits`, which the runtime applies once whichever devices of the spec a
container gets (the CDI spec, "containerEdits"), and each device's own nodes in its entry, so a
device's entry names nothing of another GPU. The common edits are the control device nodes, the
driver's libraries and binaries as read-only bind mounts with the toolkit's options
(internal/discover/mounts.go), and `NVIDIA_VISIBLE_DEVICES=void`, which the toolkit sets
(pkg/nvcdi/wrapper.go GetCommonEdits) so that an NVIDIA runtime hook that also sees the container
injects nothing more, `void` being "the same behavior as runc"
(cmd/nvidia-container-runtime/README.md); CUDA images set the variable to `all` themselves.
Each device entry adds its device nodes and `GPU_SHARING_DEVICE_<NAME>=<uuid>`, and for a GPU shared
with MPS (or an on-demand MIG device a DRA claim shares with MPS) its daemon's pipe directory (with
`CUDA_MPS_PIPE_DIRECTORY`) and the MPS shared memory at /dev/shm, what Allocate hands out without CDI.

Unlike the toolkit's spec, this one has no hooks: the toolkit's `create-symlinks` and
`update-ldcache` hooks run `nvidia-cdi-hook`, which a node without the toolkit lacks, and a hook that
cannot run fails every container. The library links are mounted by their own names instead, and the
dynamic loader finds the libraries in its default directories (`/usr/lib/x86_64-linux-gnu` on
Debian-based images, `/usr/lib64` on Red Hat-based ones).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sharing.devices import (
    CDI_KIND,
    DEFAULT_MPS_ROOT,
    Device,
    DeviceIdStrategy,
    Inventory,
    client_edits,
    device_name,
)
from sharing.gpu.devfiles import DeviceFiles, DriverFile
from sharing.model import NodeState

CDI_VERSION = "0.6.0"
"""Device nodes with a `hostPath` (a driver root other than the node's /) came with CDI spec 0.5.0."""
SPEC_FILE = CDI_KIND.replace("/", "-") + ".json"
DEVICE_ENV = "GPU_SHARING_DEVICE_"
COMMON_ENV = ("NVIDIA_VISIBLE_DEVICES=void",)
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
"""The toolkit's options for the driver's files (internal/discover/mounts.go)."""


def build_spec(
    inventory: Inventory,
    node: NodeState,
    files: DeviceFiles,
    ids: DeviceIdStrategy,
    *,
    mps_root: str = DEFAULT_MPS_ROOT,
) -> dict[str, Any] | None:
    """The spec for every physical device in the inventory (replicas share their device's entry).

    None when there is no device: a spec without one is invalid ("invalid spec, no devices",
    pkg/cdi/spec.go in github.com/cncf-tags/container-device-interface), so none is written.
    """
    named: dict[str, Device] = {}
    for device in _physical(inventory):
        named.setdefault(device_name(device, ids), device)
    return build_named_spec(CDI_KIND, sorted(named.items()), node, files, mps_root=mps_root)


def build_named_spec(
    kind: str,
    devices: Iterable[tuple[str, Device]],
    node: NodeState,
    files: DeviceFiles,
    *,
    mps_root: str = DEFAULT_MPS_ROOT,
) -> dict[str, Any] | None:
    """A spec of `kind` with one entry per (CDI device name, device), in the order given, and the
    driver's common files; None when there is no device (a spec without one is invalid)."""
    entries = [
        {"name": name, "containerEdits": _edits(name, device, node, files, mps_root)}
        for name, device in devices
    ]
    if not entries:
        return None
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": entries,
        "containerEdits": {
            "env": list(COMMON_ENV),
            "deviceNodes": [_node(f) for f in files.common()],
            "mounts": [_mount(f) for f in files.mounts()],
        },
    }


def write_spec(directory: Path, spec: dict[str, Any] | None, file_name: str = SPEC_FILE) -> bool:
    """Write the spec atomically (None removes it); True when the file changed."""
    path = directory / file_name
    if spec is None:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True
    text = json.dumps(spec, indent=1, sort_keys=True) + "\n"
    try:
        if path.read_text("utf-8") == text:
            return False
    except OSError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{file_name}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)  # a runtime reading the directory sees the old spec or the new one
    return True


def _edits(name: str, device: Device, node: NodeState, files: DeviceFiles, mps_root: str) -> dict[str, Any]:
    edits: dict[str, Any] = {
        "env": [f"{DEVICE_ENV}{_env_suffix(name)}={device.uuid}"],
        "deviceNodes": [_node(f) for f in _files(device, node, files)],
    }
    if device.mps:  # a client of its device's MPS server: the pipes and shared memory (Allocate's edits)
        mps = client_edits(mps_root, device.uuid)  # a GPU's, or an on-demand MIG device's own daemon
        edits["env"] += [f"{k}={v}" for k, v in mps.env]
        edits["mounts"] = [
            {"hostPath": host, "containerPath": inside, "options": ["rw", "nosuid", "nodev", "rbind"]}
            for inside, host in mps.mounts
        ]
    return edits


def _physical(inventory: Inventory) -> Iterable[Device]:
    return (d for _, devices in inventory.resources for d in devices)


def _files(device: Device, node: NodeState, files: DeviceFiles) -> tuple[DriverFile, ...]:
    gpu = node.gpu(device.gpu_uuid)
    if gpu is None:
        return ()
    if device.mig_uuid is None:
        return files.for_gpu(gpu)
    for gi, ci in gpu.mig_devices:
        if ci.uuid == device.mig_uuid:
            return files.for_mig(gpu, gi, ci)
    return ()


def _node(f: DriverFile) -> dict[str, str]:
    entry = {"path": f.path, "permissions": "rw"}
    if f.host_path != f.path:
        entry["hostPath"] = f.host_path
    return entry


def _mount(f: DriverFile) -> dict[str, Any]:
    return {"hostPath": f.host_path, "containerPath": f.path, "options": list(MOUNT_OPTIONS)}


def _env_suffix(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()
