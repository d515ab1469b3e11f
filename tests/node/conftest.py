"""Real single-node Kubernetes clusters for the tests in tests/node, with the agent installed by its chart.

Two nodes, each started once per session: one for the modules that take the node through DRA and
on-demand MIG (tests/conftest.py `_DRA_NODE`), one for the rest; the modules of a node run one after
another on one worker, the two nodes side by side. Each node (hack/lab: containerd 2.x, kubelet,
scheduler, controller-manager, kube-proxy in private namespaces) has 2x A100-SXM4-40GB + 2x H100
80GB HBM3 simulated and a config in the user's ConfigMap that yields every kind of resource at
once. Tests talk to it as an operator does: the requests kubectl sends (straight to the API server:
a kubectl process costs a tenth of a CPU-second), helm, `kubectl exec` into pods. Needs root;
skipped without the Go binaries.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lab
import pytest
from lab import images
from lab.api import ApiError
from lab.helm import NAMESPACE, RELEASE, Helm, lab_values

from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from tests.conftest import worker_group
from tests.polling import poll

NODE = "gpu-node"
CONFIG = "all-kinds"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
CONFIGMAP = "gpu-sharing-config"  # the chart's, holding the user's configs
HTTP_PORT = 9402  # the agent's status and metrics (the chart's httpPort)
TOOLBOX = "localhost/toolbox:1"
# One config, every kind of resource: a MIG device, a whole GPU, a time-sliced replica of a GPU and
# a replica of a MIG device (renamed .shared, so each kind has its own resource name). GPUs 0-1 are
# the A100s, 2-3 the H100s.
ALL_KINDS = """version: v1
migStrategy: mixed
sharing:
  renameByDefault: true
gpus:
  - devices: [2]
    mig: disabled
  - devices: [3]
    mig: disabled
    replicas: 4
  - devices: {product: A100-SXM4-40GB}
    mig: {1g.5gb: 2, 2g.10gb: 1, 3g.20gb: 1}
    replicas: {2g.10gb: 2}
"""
EXPECTED = {
    "nvidia.com/mig-1g.5gb": "4",
    "nvidia.com/mig-3g.20gb": "2",
    "nvidia.com/mig-2g.10gb.shared": "4",
    "nvidia.com/gpu": "1",
    "nvidia.com/gpu.shared": "4",
}


KINDS = {
    "node": ("/api/v1", "nodes", False),
    "pod": ("/api/v1", "pods", True),
    "pods": ("/api/v1", "pods", True),
    "configmap": ("/api/v1", "configmaps", True),
    "service": ("/api/v1", "services", True),
    "events": ("/api/v1", "events", True),
    "daemonset": ("/apis/apps/v1", "daemonsets", True),
    "endpointslices": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "resourceslices": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "resourceclaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "poddisruptionbudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
}
"""The kinds tests read and write through `NodeUnderTest`, by kubectl's name: API path, plural,
namespaced."""


def _path(kind: str, name: str | None = None, namespace: str = "default") -> str:
    prefix, plural, namespaced = KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


@dataclass
class NodeUnderTest:
    """The running node and what tests do with it."""

    node: lab.RealNode
    helm: Helm
    pods: list[str] = field(default_factory=list)

    def kubectl(self, *args: str, input: str | None = None) -> str:
        done = self.node.kubectl(*args, input=input)
        assert 0 == done.returncode, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def create(self, obj: dict[str, Any]) -> str:
        """`kubectl create -f` of one object, sent straight to the API server (a kubectl process
        costs a tenth of a CPU-second, and the node's tests make hundreds); its name."""
        meta = obj["metadata"]
        self.node.api.request(
            "POST", _path(obj["kind"].lower(), None, meta.get("namespace", "default")), obj, merge=False
        )
        return str(meta["name"])

    def delete(
        self,
        kind: str,
        *names: str,
        namespace: str = "default",
        wait: bool = True,
        force: bool = False,
        timeout: float = 60,
    ) -> None:
        """`kubectl delete --ignore-not-found KIND NAMES` (`--grace-period=0 --force` with `force`):
        with `wait`, returns once every one is gone, as kubectl does (a pod: once the kubelet has
        stopped it and unprepared its devices)."""
        query = "?gracePeriodSeconds=0" if force else ""
        for name in names:
            try:
                self.node.api.request("DELETE", _path(kind, name, namespace) + query)
            except ApiError as err:
                if err.status != 404:
                    raise
        if wait:

            def left() -> list[str]:
                return [n for n in names if self.exists(kind, n, "-n", namespace)]

            poll(f"{kind} {' '.join(names)} gone", left, lambda found: not found, timeout)

    def label(self, key: str, value: str | None) -> None:
        """`kubectl label node --overwrite KEY=VALUE` (`KEY-` for None) of the node."""
        self.node.api.request("PATCH", _path("node", NODE), {"metadata": {"labels": {key: value}}})

    def patch_configs(self, data: dict[str, str | None]) -> None:
        """`kubectl patch configmap --type=merge` of the user's ConfigMap's data (None removes a key)."""
        self.node.api.request("PATCH", _path("configmap", CONFIGMAP, NAMESPACE), {"data": data})

    def logs(self, pod: str, namespace: str = NAMESPACE, container: str | None = None) -> str:
        """`kubectl logs` of a pod's container."""
        query = f"?{urllib.parse.urlencode({'container': container})}" if container else ""
        return str(self.node.api.request("GET", _path("pod", pod, namespace) + "/log" + query))

    def get(self, kind: str, *args: str) -> dict[str, Any]:
        """What `kubectl get KIND [NAME] [-n NS] [-l SELECTOR] [--field-selector SELECTOR] -o json`
        shows, read straight from the API server: tests poll with it, and a kubectl process per read
        would take the CPU from what they wait for."""
        name, namespace, query = None, "default", {}
        rest = list(args)
        while rest:
            arg = rest.pop(0)
            if arg == "-n":
                namespace = rest.pop(0)
            elif arg in ("-l", "--field-selector"):
                query["labelSelector" if arg == "-l" else "fieldSelector"] = rest.pop(0)
            else:
                assert name is None, f"get {kind} {' '.join(args)}: one name at most"
                name = arg
        path = _path(kind, name, namespace)
        path += f"?{urllib.parse.urlencode(query)}" if query else ""
        return dict(self.node.api.request("GET", path))

    def exists(self, kind: str, *args: str) -> bool:
        """Whether `get` finds it (False: the API server answers 404)."""
        try:
            self.get(kind, *args)
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

    def events(self, reason: str) -> list[str]:
        """The messages of the Events of this reason about the Node, oldest first."""
        selector = f"involvedObject.kind=Node,involvedObject.name={NODE},reason={reason}"
        items = self.get("events", "--field-selector", selector)["items"]
        return [e["message"] for e in sorted(items, key=lambda e: e["metadata"]["name"])]

    def allocatable_all(self) -> dict[str, str]:
        return dict(self.get("node", NODE)["status"].get("allocatable", {}))

    def allocatable(self) -> dict[str, str]:
        """The Node's allocatable nvidia.com/ resources."""
        return {k: v for k, v in self.allocatable_all().items() if k.startswith("nvidia.com/")}

    def offered(self) -> dict[str, str]:
        """The Node's allocatable nvidia.com/ resources above 0. A resource whose plugin stopped (a config
        that no longer makes it) stays at 0 for the kubelet's endpointStopGracePeriod, 5 minutes
        (k8s.io/kubernetes pkg/kubelet/cm/devicemanager): nothing is offered through it meanwhile."""
        return {k: v for k, v in self.allocatable().items() if v != "0"}

    def wait_allocatable(self, expected: dict[str, str] = EXPECTED, timeout: float = 90) -> dict[str, str]:
        """Wait until the node offers exactly `expected` (resources at 0 left out: see `offered`)."""
        return dict(poll("Node allocatable", self.offered, lambda a: a == expected, timeout))

    def agent_pods(self) -> list[dict[str, Any]]:
        pods = self.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=gpu-sharing")["items"]
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def running_agent(self, timeout: float = 90, not_uid: str | None = None) -> dict[str, Any]:
        """The agent's pod once Running (and ready) and the only one, optionally a new one (not
        ``not_uid``). An update starts the new pod beside the old one (the chart's maxSurge), which
        stops once the new one is ready: until it has gone, `kubectl exec ds/...` may reach either."""

        def every() -> list[dict[str, Any]]:
            return list(
                self.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=gpu-sharing")["items"]
            )

        def ok(pods: list[dict[str, Any]]) -> bool:
            return len(pods) == 1 and _running(pods[0]) and pods[0]["metadata"]["uid"] != not_uid

        (pod,) = poll("the agent's pod Running, alone", every, ok, timeout)
        return dict(pod)

    def agent_log(self) -> str:
        """`kubectl logs ds/gpu-sharing`: the agent's log."""
        return self.logs(self._agent_pod(), container="agent")

    def status(self) -> dict[str, Any]:
        """What `sharing status --json` in the agent's pod shows: the document the agent serves on its
        port (the command would cost 0.8 CPU-s a poll; tests/node/test_agent.py runs it)."""
        return dict(self.served("/status"))

    def metrics(self) -> list[str]:
        """The lines of the agent's /metrics (which renders the status at most once a second)."""
        return str(self.served("/metrics")).splitlines()

    def served(self, path: str) -> Any:
        """What the agent's newest pod serves on its port at `path` (JSON decoded), read through the
        API server's proxy to the pod; ApiError for any answer but 2xx (a 503 from /readyz)."""
        proxy = _path("pod", f"{self._agent_pod()}:{HTTP_PORT}", NAMESPACE) + "/proxy"
        return self.node.api.request("GET", proxy + path)

    def _agent_pod(self) -> str:
        """The agent's newest pod (not being deleted), as `ds/gpu-sharing` reaches it."""
        pods = sorted(self.agent_pods(), key=lambda p: p["metadata"]["creationTimestamp"])
        return str(pods[-1]["metadata"]["name"])

    def export(self) -> dict[str, Any]:
        """`sharing export --json` inside the agent's pod: the GPUs as the agent sees them."""
        return dict(
            json.loads(
                self.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "export", "--json")
            )
        )

    def start_pod(self, resource: str, count: int = 1, name: str | None = None) -> str:
        name = name or f"p-{uuid.uuid4().hex[:6]}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "main",
                        "image": TOOLBOX,
                        "command": ["sleep", "1000000"],
                        "resources": {"limits": {resource: str(count)}},
                    }
                ],
            },
        }
        self.create(pod)
        self.pods.append(name)
        return name

    def pod(self, name: str) -> dict[str, Any]:
        return self.get("pod", name)

    def wait_running(self, name: str, timeout: float = 60) -> dict[str, Any]:
        return dict(poll(f"pod {name} Running", lambda: self.pod(name), _running, timeout))

    def env(self, pod: str) -> dict[str, str]:
        """The container's environment, read inside it."""
        lines = self.kubectl("exec", pod, "--", "env").splitlines()
        return dict(line.partition("=")[::2] for line in lines if "=" in line)

    def allocation(self, pod: dict[str, Any], resource: str) -> tuple[list[str], dict[str, str]]:
        """What the kubelet recorded for the pod's container: device IDs and Allocate's response env.

        From the kubelet's own checkpoint (/var/lib/kubelet/device-plugins on the node), which keeps
        each ContainerAllocateResponse exactly as the plugin sent it.
        """
        path = self.node.state / "kubelet" / "device-plugins" / "kubelet_internal_checkpoint"
        entries = json.loads(path.read_text())["Data"]["PodDeviceEntries"]
        for e in entries:
            if e["PodUID"] == pod["metadata"]["uid"] and e["ResourceName"] == resource:
                ids = [i for numa in e["DeviceIDs"].values() for i in numa]
                response = api.ContainerAllocateResponse.FromString(base64.b64decode(e["AllocResp"]))
                return ids, dict(response.envs)
        raise AssertionError(f"no checkpoint entry for pod {pod['metadata']['name']} and {resource}")

    def delete_pods(self) -> None:
        """Delete the pods this session started and wait until they are gone (their devices free)."""
        if self.pods:
            self.delete("pod", *self.pods, timeout=50)
            self.pods.clear()


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """The status of the pod's container `name`."""
    status: dict[str, Any] = next(c for c in pod["status"]["containerStatuses"] if c["name"] == name)
    return status


def _running(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    ready = all(c.get("ready") for c in status.get("containerStatuses", [{}]))
    return status.get("phase") == "Running" and ready


def _session_node(binaries: lab.Binaries, variable: str, default: int) -> Iterator[NodeUnderTest]:
    """A real node, labelled with the all-kinds config, and the chart installed (simulated GPUs); down
    after. One per machine at a time on its index (its subnet 10.(200+N).0.0/24 and its own state): a
    second checkout testing beside this one names others with `variable`."""
    if os.geteuid() != 0:
        pytest.skip("the real node needs root (namespaces, cgroups, mounts)")
    archives = images.all_images(binaries)
    index = int(os.environ.get(variable, str(default)))
    node = lab.RealNode("test" if index == 1 else f"test{index}", NODE, index=index).up(archives)
    try:
        node.kubectl("label", "node", NODE, f"{CONFIG_LABEL}={CONFIG}", check=True)
        helm = Helm(node.kubeconfig, binary=binaries.helm)
        helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
        under_test = NodeUnderTest(node, helm)
        under_test.running_agent()
        under_test.wait_allocatable()
        yield under_test
    finally:
        node.down()


@pytest.fixture(scope="session")
def first_node(cluster_binaries: lab.Binaries) -> Iterator[NodeUnderTest]:
    """The session node of the modules of worker group "node" (index 1 unless told)."""
    yield from _session_node(cluster_binaries, "SHARING_TEST_NODE_INDEX", 1)


@pytest.fixture(scope="session")
def dra_node(cluster_binaries: lab.Binaries) -> Iterator[NodeUnderTest]:
    """The session node of the modules of worker group "dra-node" (index 6 unless told): the ones that
    take the node through DRA and on-demand MIG, a second node so that they run beside the others."""
    yield from _session_node(cluster_binaries, "SHARING_TEST_DRA_NODE_INDEX", 6)


@pytest.fixture(scope="module")
def real_node(request: pytest.FixtureRequest) -> NodeUnderTest:
    """The session node of this module's worker group (tests/conftest.py `worker_group`): the modules
    of a group share one node, one after another, and each leaves it as the session made it."""
    group = worker_group(request.node.nodeid)
    under_test: NodeUnderTest = request.getfixturevalue({"node": "first_node", "dra-node": "dra_node"}[group])
    return under_test


@pytest.fixture
def node(real_node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The module's session node; pods a test started are deleted after it."""
    yield real_node
    real_node.delete_pods()
