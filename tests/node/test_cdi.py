"""The node's containerd (2.x, built from its Go module) injects what a CDI spec names.

The agent's CDI strategies end in the same place: a device plugin answers Allocate with CDI device
names, the kubelet passes them to the runtime, and containerd applies the edits of the spec in
/var/run/cdi on the node. First the Go stub plugin plays the plugin, so the node side is proven on
its own: a spec written into the node's /var/run/cdi, a pod requesting the stub's resource, and the
container seeing the spec's env var and device node (a harmless char device: /dev/null's 1:3).
Then the spec the agent builds (`sharing.gpu.cdi`) over a driver root laid out as NVIDIA's
installer lays it out, still behind the stub: the pod's dynamic loader finds the driver's library by
name and the pod sees its GPU's node and nothing of the other. Last the agent itself on the node's
fake NVIDIA driver (hack/fakedriver), by `cdi-cri` alone.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lab
import pytest
from lab.helm import NAMESPACE, RELEASE, lab_values
from lab.images import agent_image

from sharing.devices import CDI_KIND, DeviceIdStrategy
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.gpu.cdi import build_spec
from sharing.gpu.devfiles import DriverFiles
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from tests.node.conftest import ALL_KINDS, CONFIG, NodeUnderTest
from tests.polling import poll

pytestmark = pytest.mark.node

RESOURCE = "example.com/dev"
LIB = "usr/lib/x86_64-linux-gnu"
NVML = f"/{LIB}/libnvidia-ml.so.1"


def cdi_spec(host_node: Path) -> dict[str, object]:
    return {
        "cdiVersion": "0.6.0",
        "kind": RESOURCE,
        "devices": [
            {
                "name": "Dev-1",
                "containerEdits": {
                    "env": ["STUB_CDI_DEVICE=Dev-1"],
                    "deviceNodes": [
                        {
                            "path": "/dev/stub-dev-1",
                            "hostPath": str(host_node),
                            "type": "c",
                            "major": 1,
                            "minor": 3,
                        }
                    ],
                },
            }
        ],
    }


def spec_dir(node: NodeUnderTest) -> Path:
    """/var/run/cdi as the node sees it: its /run is a tmpfs of its own mount namespace (and
    /var/run a symlink, which /proc/PID/root would resolve on the host: name /run itself)."""
    holder = next(r for r in node.node.records if r.name == "namespace-holder")
    return Path(f"/proc/{holder.pid}/root/run/cdi")


def test_containerd_applies_the_cdi_spec_a_device_plugin_names(
    node: NodeUnderTest, cluster_binaries: lab.Binaries
) -> None:
    version = node.get("node", "gpu-node")["status"]["nodeInfo"]["containerRuntimeVersion"]
    assert version.startswith("containerd://2.")
    with tempfile.TemporaryDirectory(prefix="cdi-dev-") as tmp:
        dev = Path(tmp) / "null"
        os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
        spec = spec_dir(node) / "example.com-dev.json"
        spec.write_text(json.dumps(cdi_spec(dev)))
        plugin_dir = node.node.state / "kubelet" / "device-plugins"  # the node's, bind-mounted
        with lab.StubDevicePlugin(
            plugin_dir, RESOURCE, ["Dev-1"], binary=cluster_binaries.stub_device_plugin
        ):
            poll("the stub's resource on the Node", node.allocatable_all, lambda a: a.get(RESOURCE) == "1")
            name = node.start_pod(RESOURCE)
            node.wait_running(name)
            env = node.env(name)
            assert ("Dev-1", "Dev-1") == (env["STUB_CDI_DEVICE"], env["STUB_VISIBLE_DEVICES"])
            # busybox stat: %F file type, %t:%T major:minor in hex.
            seen = node.kubectl("exec", name, "--", "stat", "-c", "%F %t:%T", "/dev/stub-dev-1").strip()
            assert "character special file 1:3" == seen
            node.delete_pods()
        spec.unlink()


def driver_root(root: Path) -> None:
    """A driver as NVIDIA's installer lays it out, GPUs 0 (MIG, one MIG device) and 1 (whole).

    The library is a real shared object (this machine's libz, which needs only libc) under the
    driver's name, so a glibc container's dynamic loader can load it.
    """
    lib = root / LIB
    lib.mkdir(parents=True)
    shutil.copyfile(
        Path(os.path.realpath("/lib/x86_64-linux-gnu/libz.so.1")), lib / "libnvidia-ml.so.580.65.06"
    )
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.65.06")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/nvidia-smi").write_text("#!/bin/sh\n")
    (root / "usr/bin/nvidia-smi").chmod(0o755)
    for name in (
        "nvidiactl",
        "nvidia-uvm",
        "nvidia0",
        "nvidia1",
        "nvidia-caps/nvidia-cap3",
        "nvidia-caps/nvidia-cap4",
    ):
        path = root / "dev" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    caps = root / "proc/driver/nvidia/capabilities/gpu0/mig/gi1"
    (caps / "ci0").mkdir(parents=True)
    (caps / "access").write_text("DeviceFileMinor: 3\n")
    (caps / "ci0/access").write_text("DeviceFileMinor: 4\n")


def agent_spec(root: Path) -> dict[str, Any]:
    """The agent's spec for the root's two devices, named as the stub names them (Dev-1, Dev-2)."""
    gpus = (
        Gpu(0, GpuUuid("GPU-0"), "NVIDIA A100-SXM4-40GB", 40960, True, True, True, minor=0,
            instances=(GpuInstance(1, "7g.40gb", 0, 8, (ComputeInstance(0, MigUuid("MIG-0")),)),)),
        Gpu(1, GpuUuid("GPU-1"), "NVIDIA A100-SXM4-40GB", 40960, True, False, False, minor=1),
    )  # fmt: skip
    devices = (
        Device(DeviceId("MIG-0"), Health.HEALTHY, None, gpus[0].uuid, MigUuid("MIG-0"), index="Dev-1"),
        Device(DeviceId("GPU-1"), Health.HEALTHY, None, gpus[1].uuid, index="Dev-2"),
    )
    inventory = Inventory(((ResourceName(RESOURCE), devices),))
    spec = build_spec(inventory, NodeState(gpus), DriverFiles(root), DeviceIdStrategy.INDEX)
    assert spec is not None
    return {**spec, "kind": RESOURCE}


def start_glibc_pod(node: NodeUnderTest, resource: str) -> str:
    """A pod of the agent's image (Debian: glibc and python3) that only sleeps."""
    name = f"p-{uuid.uuid4().hex[:6]}"
    container = {
        "name": "main",
        "image": agent_image(),
        "imagePullPolicy": "IfNotPresent",
        "command": ["sleep", "1000000"],
        "resources": {"limits": {resource: "1"}},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container]},
    }
    node.create(pod)
    node.pods.append(name)
    return name


def nvidia_nodes(node: NodeUnderTest, pod: str) -> set[str]:
    """Every /dev/nvidia* and /dev/nvidia-caps/* node the container has."""
    listed = node.kubectl(
        "exec", pod, "--", "sh", "-c", "ls -d /dev/nvidia* /dev/nvidia-caps/* 2>/dev/null; true"
    )
    return set(listed.split()) - {"/dev/nvidia-caps"}


def test_a_pod_gets_the_driver_and_only_its_gpu_from_the_agents_spec(
    node: NodeUnderTest, cluster_binaries: lab.Binaries
) -> None:
    with tempfile.TemporaryDirectory(prefix="cdi-driver-") as tmp:
        root = Path(tmp)
        driver_root(root)
        spec = agent_spec(root)
        path = spec_dir(node) / "example.com-dev.json"
        path.write_text(json.dumps(spec))
        plugin_dir = node.node.state / "kubelet" / "device-plugins"
        with lab.StubDevicePlugin(
            plugin_dir, RESOURCE, ["Dev-1", "Dev-2"], binary=cluster_binaries.stub_device_plugin
        ):
            poll("the stub's resource on the Node", node.allocatable_all, lambda a: a.get(RESOURCE) == "2")
            name = start_glibc_pod(node, RESOURCE)
            node.wait_running(name)
            device = node.env(name)["STUB_VISIBLE_DEVICES"]
            mine = {"Dev-1": {"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap3", "/dev/nvidia-caps/nvidia-cap4"}}
            expected = {"/dev/nvidiactl", "/dev/nvidia-uvm"} | mine.get(device, {"/dev/nvidia1"})
            assert expected == nvidia_nodes(node, name)
            assert "void" == node.env(name)["NVIDIA_VISIBLE_DEVICES"]
            # The dynamic loader finds the library by the name CUDA programs open, with no hook.
            load = "import ctypes; print(ctypes.CDLL('libnvidia-ml.so.1')._name)"
            assert "libnvidia-ml.so.1" == node.kubectl("exec", name, "--", "python3", "-c", load).strip()
            mode = node.kubectl("exec", name, "--", "stat", "-c", "%a %F", "/usr/bin/nvidia-smi").strip()
            assert "755 regular file" == mode
            node.delete_pods()
        path.unlink()


@pytest.fixture
def cdi(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The chart upgraded to hand devices out by CDI names only (cdi-cri); put back afterwards."""
    (old,) = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, deviceListStrategy="cdi-cri"))
    node.running_agent(not_uid=old["metadata"]["uid"])
    node.wait_allocatable()
    yield node
    node.delete_pods()
    (old,) = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
    node.running_agent(not_uid=old["metadata"]["uid"])
    node.wait_allocatable()


def _cdi_devices(node: NodeUnderTest, pod_uid: str, resource: str) -> tuple[list[str], list[str]]:
    """(device IDs, CDI names) the kubelet recorded from Allocate, read from its checkpoint."""
    path = node.node.state / "kubelet" / "device-plugins" / "kubelet_internal_checkpoint"
    for entry in json.loads(path.read_text())["Data"]["PodDeviceEntries"]:
        if entry["PodUID"] == pod_uid and entry["ResourceName"] == resource:
            response = api.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
            ids = [i for numa in entry["DeviceIDs"].values() for i in numa]
            return ids, [d.name for d in response.cdi_devices]
    raise AssertionError(f"no checkpoint entry for {pod_uid} and {resource}")


def test_containerd_injects_the_agents_cdi_spec_into_a_pod(cdi: NodeUnderTest) -> None:
    name = cdi.start_pod("nvidia.com/mig-1g.5gb")
    pod = cdi.wait_running(name)
    (device,), names = _cdi_devices(cdi, pod["metadata"]["uid"], "nvidia.com/mig-1g.5gb")
    assert [f"{CDI_KIND}={device}"] == names
    env = cdi.env(name)
    # All strategies are CDI: Allocate adds no variable, as NVIDIA's plugin; the spec's `void`
    # keeps an NVIDIA runtime hook from adding devices, as nvidia-ctk's specs do.
    assert "void" == env["NVIDIA_VISIBLE_DEVICES"]
    suffix = re.sub("[^A-Za-z0-9]", "_", device).upper()
    assert device == env[f"GPU_SHARING_DEVICE_{suffix}"]
    # The spec lists every advertised device and nothing else.
    status = cdi.status()
    advertised = {s["device"] for g in status["gpus"] for s in g["slices"]}
    spec = json.loads(
        cdi.kubectl(
            "-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "cat", "/var/run/cdi/k8s.gpu-sharing.io-gpu.json"
        )
    )
    assert advertised == {d["name"] for d in spec["devices"]}
    gpu = next(g for g in cdi.export()["gpus"] if any(i["uuid"] == device for i in g["instances"]))
    entry = next(d["containerEdits"] for d in spec["devices"] if d["name"] == device)
    # The control nodes, the GPU's node and the MIG device's two capability nodes: nothing else.
    nodes = nvidia_nodes(cdi, name)
    caps = {n for n in nodes if n.startswith("/dev/nvidia-caps/")}
    assert {
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        f"/dev/nvidia{gpu['index']}",
    } == nodes - caps
    assert 2 == len(caps)
    assert caps == {n["path"] for n in entry["deviceNodes"]} - {f"/dev/nvidia{gpu['index']}"}
    seen = cdi.kubectl("exec", name, "--", "stat", "-c", "%F %t:%T", f"/dev/nvidia{gpu['index']}").strip()
    assert "character special file 1:3" == seen
    # The driver's user-space library from the node's driver root (busybox: its ELF magic).
    assert "\x7fELF" == cdi.kubectl("exec", name, "--", "head", "-c", "4", NVML)
