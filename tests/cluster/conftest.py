"""One real three-node Kubernetes for every test in tests/cluster, the agent installed on all three by
its chart (one DaemonSet), each node with its own fake GPUs and its own config label: the layout of
`lab.cluster` (hack/lab: the first node runs the control plane; each its own containerd, kubelet and
kube-proxy in private namespaces, its own driver root). Tests talk to the cluster
as an operator does (kubectl, helm, `kubectl exec`) and leave it as they found it.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lab
import pytest
from bench.clients import Watch
from lab import cluster as lab_cluster
from lab import images, kubeconfig
from lab.api import Api
from lab.cluster import CONFIG_LABEL, NODES, STATE_LABEL
from lab.helm import NAMESPACE, Helm
from lab.paths import kubectl_path

from tests.polling import poll

TOOLBOX = "localhost/toolbox:1"


@dataclass
class Cluster:
    """The running cluster (its first node holds the control plane) and what tests do with it."""

    first: lab.RealNode
    helm: Helm
    pods: list[str] = field(default_factory=list)

    def node(self, name: str) -> lab.RealNode:
        return next(n for n in (self.first, *self.first.members) if n.node_name == name)

    def kubectl(self, *args: str, input: str | None = None) -> str:
        done = self.first.kubectl(*args, input=input)
        assert 0 == done.returncode, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def get(self, path: str) -> dict[str, Any]:
        """A GET of the API server (a path under it), as admin."""
        return dict(self.first.api.request("GET", path))

    def labels(self, node: str) -> dict[str, str]:
        return dict(self.get(f"/api/v1/nodes/{node}")["metadata"].get("labels", {}))

    def allocatable(self, node: str) -> dict[str, str]:
        """The Node's allocatable nvidia.com/ resources, less those at 0 (the kubelet keeps a
        resource whose plugin has gone at 0)."""
        status = self.get(f"/api/v1/nodes/{node}")["status"]
        return {
            k: v for k, v in status.get("allocatable", {}).items() if k.startswith("nvidia.com/") and v != "0"
        }

    def converged(self, node: str, expected: dict[str, str]) -> bool:
        return self.labels(node).get(STATE_LABEL) == "success" and self.allocatable(node) == expected

    def wait_converged(self, node: str, expected: dict[str, str], timeout: float = 180) -> None:
        poll(
            f"node {node} at success offering {expected}",
            lambda: (self.labels(node).get(STATE_LABEL), self.allocatable(node)),
            lambda seen: seen == ("success", expected),
            timeout,
        )

    def agent_pods(self) -> dict[str, dict[str, Any]]:
        """The agent's live pods by node."""
        selector = "app.kubernetes.io/name=gpu-sharing"
        items = self.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")["items"]
        return {p["spec"]["nodeName"]: p for p in items if not p["metadata"].get("deletionTimestamp")}

    def agent_exec(self, node: str, *command: str) -> str:
        """A command in the agent's container on ``node`` (`kubectl exec ds/...` picks any node's)."""
        pod = self.agent_pods()[node]["metadata"]["name"]
        return self.kubectl("-n", NAMESPACE, "exec", pod, "-c", "agent", "--", *command)

    def put_config(self, name: str, text: str | None) -> None:
        """Set (or, with None, remove) one config of the user's ConfigMap."""
        patch = json.dumps({"data": {name: text}})
        self.kubectl("-n", NAMESPACE, "patch", "configmap", "gpu-sharing-config", "--type=merge", "-p", patch)

    def start_pod(
        self, node: str, limits: dict[str, str], *, image: str = TOOLBOX, command: list[str] | None = None
    ) -> str:
        """A pod on ``node`` with these limits, sleeping unless told otherwise; its name."""
        name = f"p-{uuid.uuid4().hex[:6]}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": node,
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "main",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "command": command or ["sleep", "1000000"],
                        "resources": {"limits": limits},
                    }
                ],
            },
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(pod))
        self.pods.append(name)
        return name

    def pod(self, name: str) -> dict[str, Any]:
        return self.get(f"/api/v1/namespaces/default/pods/{name}")

    def wait_running(self, name: str, timeout: float = 90) -> dict[str, Any]:
        return dict(poll(f"pod {name} Running", lambda: self.pod(name), running, timeout))

    def delete_pods(self) -> None:
        if self.pods:
            self.kubectl("delete", "pod", *self.pods, "--ignore-not-found", "--wait=true", "--timeout=120s")
            self.pods.clear()


def running(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    ready = all(c.get("ready") for c in status.get("containerStatuses", [{}]))
    return status.get("phase") == "Running" and ready


@pytest.fixture(scope="session")
def real_cluster(cluster_binaries: lab.Binaries) -> Iterator[Cluster]:
    """The three nodes, labelled, with the chart installed; down at the end of the session."""
    if os.geteuid() != 0:
        pytest.skip("the real cluster needs root (namespaces, cgroups, mounts)")
    archives = images.all_images(cluster_binaries)
    # Its own subnet and state beside the session's single node (tests/node, index 1) and the
    # bench's; SHARING_TEST_CLUSTER_INDEX names another for a second checkout testing beside this one.
    index = int(os.environ.get("SHARING_TEST_CLUSTER_INDEX", "10"))
    first, helm = lab_cluster.up(f"cluster{index}", index, cluster_binaries, archives)
    try:
        cluster = Cluster(first, helm)
        for name, (_, _, expected) in NODES.items():
            cluster.wait_converged(name, expected)
        yield cluster
    finally:
        first.down()


@pytest.fixture
def node_watch(real_cluster: Cluster) -> Iterator[Watch]:
    """Every update of every Node while the test runs (a watch: no update is missed), as its
    nvidia.com/ allocatable (less those at 0), state label and config label."""

    def view(node: Mapping[str, Any]) -> dict[str, Any]:
        allocatable = node.get("status", {}).get("allocatable", {})
        labels = node.get("metadata", {}).get("labels", {})
        return {
            "allocatable": {k: v for k, v in allocatable.items() if k.startswith("nvidia.com/") and v != "0"},
            "state": labels.get(STATE_LABEL),
            "config": labels.get(CONFIG_LABEL),
        }

    first = real_cluster.first
    watch = Watch(Api(f"https://{first.api_address}:6443", first.kubeconfig.parent), "/api/v1/nodes", view)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()


@pytest.fixture
def cluster(real_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster; pods a test started are deleted after it."""
    yield real_cluster
    real_cluster.delete_pods()


# --- What tests/cluster/test_own_node.py, test_dra.py and test_drain.py add ----------------------

FRONTEND = "nvidia.com/gpu-sharing.frontend"
"""A node's front-end label (deploy/helm/gpu-sharing/values.yaml `frontend`): deviceplugin or dra."""
TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
"""Where the kubelet puts the agent pod's projected ServiceAccount token."""


def agent_token(cluster: Cluster, node: str) -> str:
    """The token of the agent pod on ``node``, read inside its container: the pod-bound token the
    agent itself uses, carrying the node claim the own-node admission policy checks."""
    return cluster.agent_exec(node, "cat", TOKEN).strip()


def token_kubeconfig(cluster: Cluster, token: str, name: str) -> Path:
    """A kubeconfig for the cluster's API server that authenticates with ``token`` only."""
    where = cluster.first.kubeconfig.parent
    return kubeconfig.write(
        where / f"token-{name}.kubeconfig",
        f"https://{cluster.first.api_address}:6443",
        where / "ca.crt",
        token=token,
        user=name,
    )


def kubectl_as(config: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``kubectl`` with another kubeconfig than the admin's; not checked (refusals are expected)."""
    return subprocess.run(
        [kubectl_path(), f"--kubeconfig={config}", *args],
        check=False,
        capture_output=True,
        text=True,
        input=input,
        timeout=60,
    )


@pytest.fixture(scope="module")
def dra_chart(real_cluster: Cluster) -> Iterator[Cluster]:
    """The session's cluster, whose chart has its DRA part on (`lab.cluster.values`): DeviceClasses,
    the agent's ResourceSlice rights and the own-ResourceSlices admission policy; every node on the
    device plugins until its front-end label says otherwise. Pods a module started go after it."""
    try:
        yield real_cluster
    finally:
        real_cluster.delete_pods()
