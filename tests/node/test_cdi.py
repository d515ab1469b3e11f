"""The node's containerd (2.x, built from its Go module) injects what a CDI spec names.

The agent's CDI strategies end in the same place: a device plugin answers Allocate with CDI device
names, the kubelet passes them to the runtime, and containerd applies the edits of the spec in
/var/run/cdi on the node. Here the Go stub plugin plays the plugin, so this proves the node side on
its own: a spec written into the node's /var/run/cdi, a pod requesting the stub's resource, and the
container seeing the spec's env var and device node (a harmless char device: /dev/null's 1:3).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import lab
import pytest

from tests.node.conftest import NodeUnderTest
from tests.polling import poll

pytestmark = pytest.mark.node

RESOURCE = "example.com/dev"


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


def test_containerd_applies_the_cdi_spec_a_device_plugin_names(
    node: NodeUnderTest, cluster_binaries: lab.Binaries
) -> None:
    version = node.get("node", "gpu-node")["status"]["nodeInfo"]["containerRuntimeVersion"]
    assert version.startswith("containerd://2.")
    with tempfile.TemporaryDirectory(prefix="cdi-dev-") as tmp:
        dev = Path(tmp) / "null"
        os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))
        # /var/run/cdi as the node sees it: its /run is a tmpfs of its own mount namespace (and
        # /var/run a symlink, which /proc/PID/root would resolve on the host: name /run itself).
        holder = next(r for r in node.node.records if r.name == "namespace-holder")
        spec_dir = Path(f"/proc/{holder.pid}/root/run/cdi")
        spec = spec_dir / "example.com-dev.json"
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
