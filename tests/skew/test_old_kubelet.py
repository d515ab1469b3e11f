"""A 1.34 kubelet under the 1.37 control plane, served by the device plugins (one real node).

The device-plugin API (v1beta1) is the same in both releases; what a user sees is checked: the Node
Ready with its kubelet's version, the slices in its allocatable, pods Running on a MIG device, a
time-sliced replica and a whole GPU, and a config change converging.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import lab
import pytest

from tests.cluster.conftest import STATE_LABEL, Cluster
from tests.skew.conftest import OLD, one_node, server_version

pytestmark = pytest.mark.node

NODE = "skew-kubelet"
CONFIG = """version: v1
migStrategy: mixed
gpus:
  - devices: [0]
    mig: {1g.5gb: 2, 3g.20gb: 1}
  - devices: [1]
    replicas: 2
    rename: {nvidia.com/gpu: gpu-ts}
"""
EXPECTED = {
    "nvidia.com/mig-1g.5gb": "2",
    "nvidia.com/mig-3g.20gb": "1",
    "nvidia.com/gpu-ts": "2",
    "nvidia.com/gpu": "1",  # the L4, which no rule matches: whole
}
ALL_1G = CONFIG.replace("{1g.5gb: 2, 3g.20gb: 1}", "{1g.5gb: 7}")


@pytest.fixture(scope="module")
def skewed(cluster_binaries: lab.Binaries) -> Iterator[Cluster]:
    with one_node(
        cluster_binaries, NODE, "A100-SXM4-40GB:2,L4:1", {"work": CONFIG}, "work", kubelet=OLD
    ) as cluster:
        cluster.wait_converged(NODE, EXPECTED)
        yield cluster
        cluster.delete_pods()


def test_the_old_kubelet_joins_the_new_control_plane_and_offers_the_slices(skewed: Cluster) -> None:
    node = skewed.get(f"/api/v1/nodes/{NODE}")
    server = server_version(skewed)
    kubelet = node["status"]["nodeInfo"]["kubeletVersion"]
    ready = [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"]
    expected = (lab.default_kubernetes_version(), lab.kubernetes_version(OLD), ["True"])
    assert (server, kubelet, ready) == expected
    assert (skewed.labels(NODE)[STATE_LABEL], skewed.allocatable(NODE)) == ("success", EXPECTED)


def test_pods_run_on_a_mig_device_a_time_sliced_replica_and_a_whole_gpu(skewed: Cluster) -> None:
    try:
        mig = skewed.start_pod(NODE, {"nvidia.com/mig-1g.5gb": "1"})
        shared = skewed.start_pod(NODE, {"nvidia.com/gpu-ts": "1"})
        whole = skewed.start_pod(NODE, {"nvidia.com/gpu": "1"})
        for pod in (mig, shared, whole):
            skewed.wait_running(pod)
        seen = {pod: visible(skewed, pod) for pod in (mig, shared, whole)}
        gpus = json.loads(skewed.agent_exec(NODE, "sharing", "export", "--json"))["gpus"]
        where = {g["uuid"]: (g["index"], "gpu") for g in gpus}
        where |= {i["uuid"]: (g["index"], i["profile"]) for g in gpus for i in g["instances"] if i["uuid"]}
        assert [where.get(seen[p]) for p in (mig, shared, whole)] == [(0, "1g.5gb"), (1, "gpu"), (2, "gpu")]
    finally:
        skewed.delete_pods()


def visible(cluster: Cluster, pod: str) -> str:
    """NVIDIA_VISIBLE_DEVICES as the pod's container sees it."""
    lines = cluster.kubectl("exec", pod, "--", "env").splitlines()
    return next((line.partition("=")[2] for line in lines if line.startswith("NVIDIA_VISIBLE_DEVICES=")), "")


def test_a_config_change_converges(skewed: Cluster) -> None:
    try:
        skewed.put_config("work", ALL_1G)
        skewed.wait_converged(
            NODE, {"nvidia.com/mig-1g.5gb": "7", "nvidia.com/gpu-ts": "2", "nvidia.com/gpu": "1"}
        )
    finally:
        skewed.put_config("work", CONFIG)
        skewed.wait_converged(NODE, EXPECTED)
