"""The three-node cluster of tests/cluster and the bench's `realcluster` part: one control plane, three
real nodes of three kinds, the agent on all of them from its chart (one DaemonSet), each node with
its own fake GPUs and its own config label.

- ``node-a``: 2x A100-SXM4-40GB + 1x H100 80GB HBM3, config ``work``;
- ``node-b``: 3x A100-SXM4-80GB, config ``work``;
- ``node-c``: 1x H200 + 2x L4 (a node that mixes MIG-capable GPUs and GPUs without MIG), config
  ``work-c`` (the same text as ``work``, so a change of one config is seen on one node only).

On every node GPU 0 is split into MIG devices, GPU 1 time-sliced (``nvidia.com/gpu-ts``) and GPU 2
shared with MPS (``nvidia.com/gpu-mps``): each kind of slice on each node.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab import containerd, images
from lab.binaries import Binaries
from lab.helm import Helm, lab_values
from lab.node import RealNode

CONFIG_LABEL = "nvidia.com/device-plugin.config"
STATE_LABEL = "nvidia.com/mig.config.state"
WORK = """version: v1
migStrategy: mixed
gpus:
  - devices: {product: A100-SXM4-40GB, indices: [0]}
    mig: {1g.5gb: 2, 3g.20gb: 1}
  - devices: {product: A100-SXM4-80GB, indices: [0]}
    mig: {1g.10gb: 2, 3g.40gb: 1}
  - devices: {product: H200, indices: [0]}
    mig: {1g.18gb: 2, 3g.71gb: 1}
  - devices: [1]
    replicas: 2
    rename: {nvidia.com/gpu: gpu-ts}
  - devices: [2]
    mps: {replicas: 2}
    rename: {nvidia.com/gpu: gpu-mps}
"""
CONFIGS = {"work": WORK, "work-c": WORK}
SHARED = {"nvidia.com/gpu-ts": "2", "nvidia.com/gpu-mps": "2"}
NODES: dict[str, tuple[str, str, dict[str, str]]] = {
    # name: (GPUs, config, what the node offers under it)
    "node-a": (
        "A100-SXM4-40GB:2,H100-80GB-HBM3:1",
        "work",
        {"nvidia.com/mig-1g.5gb": "2", "nvidia.com/mig-3g.20gb": "1", **SHARED},
    ),
    "node-b": (
        "A100-SXM4-80GB:3",
        "work",
        {"nvidia.com/mig-1g.10gb": "2", "nvidia.com/mig-3g.40gb": "1", **SHARED},
    ),
    "node-c": (
        "H200:1,L4:2",
        "work-c",
        {"nvidia.com/mig-1g.18gb": "2", "nvidia.com/mig-3g.71gb": "1", **SHARED},
    ),
}
MIG = {
    "node-a": "nvidia.com/mig-1g.5gb",
    "node-b": "nvidia.com/mig-1g.10gb",
    "node-c": "nvidia.com/mig-1g.18gb",
}
"""A MIG resource of each node."""


def values() -> dict[str, Any]:
    """The release's values: the configs, and the chart's DRA part on (DeviceClasses, the agent's
    ResourceSlice rights and admission policy), each node on the device plugins until its front-end
    label says `dra`."""
    return lab_values(CONFIGS, dra={"enabled": True})


def up(name: str, index: int, bins: Binaries, archives: Sequence[Path]) -> tuple[RealNode, Helm]:
    """The three nodes, labelled, with the chart installed (not yet waited for); the first node (which
    holds the control plane and its members) and the release. Down with ``first.down()``, also when
    this raises."""
    (first_name, (first_gpus, _, _)), *rest = NODES.items()
    first = RealNode(name, first_name, index=index, gpus=first_gpus).up(archives)
    try:
        for node, (gpus, _, _) in rest:
            first.join(node, gpus, archives)
        for node, (_, config, _) in NODES.items():
            first.kubectl("label", "node", node, f"{CONFIG_LABEL}={config}", check=True)
        helm = Helm(first.kubeconfig, binary=bins.helm)
        helm.upgrade_install(values())
    except BaseException:
        first.down()
        raise
    return first, helm


MPS_CLIENT = (  # a stand-in for a CUDA process on an MPS replica: attached until its daemon goes
    "import os, socket\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.connect(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '/control')\n"
    "s.sendall(b'fake_attach')\n"
    "assert s.recv(64) == b'attached\\n'\n"
    "s.recv(1)\n"
    "raise SystemExit('the MPS control daemon went away')\n"
)
"""The command of an MPS client pod (in the agent's image, which has Python): it attaches to its
GPU's fake MPS control daemon and exits, failing its pod, when the daemon goes."""


def mig_instances(node: RealNode) -> dict[str, Any]:
    """Each GPU's MIG instances as the node's (fake) hardware has them."""
    state = json.loads(node.gpus_state.read_text())
    return {g["uuid"]: g["gpuInstances"] for g in state["gpus"]}


def mps_daemons(node: RealNode) -> dict[str, tuple[int, int]]:
    """The node's live MPS control daemons (a daemon holds the lock of its record while it lives): GPU
    -> (PID, attached clients)."""
    found = {}
    for path in sorted((node.driver_root / "var/lib/fake-nvidia/mps").glob("*.json")):
        try:
            with open(path.with_suffix(".lock"), "rb") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    record = json.loads(path.read_text())
                    found[record["gpus"][0]] = (record["pid"], len(record["clients"]))
        except FileNotFoundError:
            continue  # a daemon that quit meanwhile
    return found


def retag(nodes: Sequence[RealNode], tag: str) -> str:
    """The agent's image under another tag on every node (a new release built from the same
    Dockerfile); its reference."""
    source = images.agent_image()
    target = f"{source.rpartition(':')[0]}:{tag}"
    for node in nodes:
        containerd.ctr(node.ns, node.bins, "images", "rm", target, check=False)
        containerd.ctr(node.ns, node.bins, "images", "tag", source, target)
    return target


def runs(pod: Mapping[str, Any], image: str) -> bool:
    """Whether the agent's `pod` runs `image` (a reference as `images.agent_image()` gives it, which
    the chart's values name without Docker Hub's default prefix) and is Ready."""
    spec = pod["spec"]["containers"][0]["image"]
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return spec == image.removeprefix("docker.io/library/") and all(c.get("ready") for c in statuses)


def install(helm: Helm, image: str) -> None:
    """`helm upgrade` of the cluster's release to the agent's `image` (one of `retag`'s)."""
    chosen = values()
    chosen["image"] = {**chosen["image"], "tag": image.rpartition(":")[2]}
    helm.upgrade_install(chosen)
