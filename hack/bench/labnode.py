"""What the benches on a real node share (hack/lab, as tests/node brings it up): the node itself, up
with the agent installed by its Helm chart, which the parts take turns on; watches held while a bench
runs, pods started and timed from their POST to Running and ready, and the devices of the node's DRA
pool.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lab
from lab import images
from lab.helm import NAMESPACE, RELEASE, Helm
from lab.images import TOOLBOX

from bench.clients import Api, Watch
from bench.report import Results, say
from sharing.dra.names import DRIVER

PODS = "/api/v1/namespaces/default/pods"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


NODE = "bench-real-node"


class SharedNode:
    """The real node `NODE` (index 2 of the lab cluster "bench") that the parts on a real node take
    turns on: brought up with the images by the first, then for each part the chart upgraded to its
    values and the node relabelled; taken down by `down` after the last, or at once when a part fails
    on it (the next part then starts on a fresh node). One node for the three saves two bring-ups and
    teardowns (a control plane, containerd, the images, the chart): the three parts' smoke run took
    121 s on their own nodes, 75 s on this one (2 cores)."""

    def __init__(self) -> None:
        self._node: lab.RealNode | None = None
        self._api: Api | None = None
        self._labels: set[str] = set()

    @contextlib.contextmanager
    def chart(self, labels: Mapping[str, str], values: dict[str, Any]) -> Iterator[tuple[lab.RealNode, Api]]:
        """The node with the chart upgraded to `values`, the configs of its `config.map` in the
        ConfigMap (as a person edits it: the chart writes the map on the first install only),
        `labels` on it (the labels of the part before that `labels` does not name removed), and the
        chart rolled out: one agent pod, of the current template, ready."""
        try:
            node, api = self._up()
            Helm(node.kubeconfig, binary=lab.binaries().helm).upgrade_install(values)
            for key, text in values["config"]["map"].items():
                api.put_config(key, text)
            api.label_node(NODE, {**dict.fromkeys(self._labels - set(labels)), **labels})
            self._labels = set(labels)
            # The agent is ready once it has applied a config and registered its plugins: after the label.
            wait_until(lambda: _rolled_out(api), 180, "the chart's agent rolled out")
            yield node, api
        except BaseException:
            self.close()
            raise

    def down(self, results: Results) -> None:
        """The node down (what the demo's Ctrl-C runs: its daemons, the agent's and the pods'
        containers, cgroups, namespaces), timed until every process it recorded has exited:
        node_stop_s. Nothing when no part left it up."""
        if self._node is None:
            return
        records = list(self._node.records)
        start = time.monotonic()
        self.close()
        stopped = time.monotonic() - start
        left = [r.name for r in records if r.alive()]
        if left:
            raise RuntimeError(f"still running after the node's down: {', '.join(left)}")
        results.add("node_stop_s", stopped)

    def _up(self) -> tuple[lab.RealNode, Api]:
        if self._node is None or self._api is None:
            say("real node: images (built when their inputs changed), then the node up (~30 s)")
            self._node = lab.RealNode("bench", NODE, index=2).up(images.all_images(lab.binaries()))
            self._api = Api(f"https://{self._node.address}:6443", self._node.state / "control-plane")
            self._labels = set()
        return self._node, self._api

    def close(self) -> None:
        """The node down, if up, untimed."""
        node, self._node, self._api = self._node, None, None
        if node is not None:
            node.down()


def _rolled_out(api: Api) -> bool:
    """The agent's DaemonSet has seen its spec and has one pod, not terminating, ready and of the
    current template (the chart rolls with a surge: the new pod beside the old until it is ready)."""
    ds = api.request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{RELEASE}")
    status = ds.get("status", {})
    if status.get("observedGeneration") != ds["metadata"]["generation"]:
        return False
    if not status.get("desiredNumberScheduled") == status.get("updatedNumberScheduled") == 1:
        return False
    pods = [
        pod
        for pod in api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        for owner in pod["metadata"].get("ownerReferences", [])
        if owner["kind"] == "DaemonSet" and owner["name"] == RELEASE
    ]
    if len(pods) != 1 or pods[0]["metadata"].get("deletionTimestamp"):
        return False
    conditions = pods[0].get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@contextlib.contextmanager
def watching(watch: Watch) -> Iterator[Watch]:
    """The watch, running while the block does."""
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()


def wait_until(ok: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `ok` every 50 ms; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(0.05)


def pod_name() -> str:
    """A fresh name for a bench pod (and its claim)."""
    return f"bench-{uuid.uuid4().hex[:8]}"


def pod_body(
    name: str, *, limits: Mapping[str, str] | None = None, claim: str | None = None
) -> dict[str, Any]:
    """A pod that sleeps in the toolbox image, with these `limits` or the ResourceClaim `claim`."""
    container: dict[str, Any] = {"name": "main", "image": TOOLBOX, "command": ["sleep", "1000000"]}
    spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0}
    if claim is None:
        container["resources"] = {"limits": dict(limits or {})}
    else:
        container["resources"] = {"claims": [{"name": "mig"}]}
        spec["resourceClaims"] = [{"name": "mig", "resourceClaimName": claim}]
    spec["containers"] = [container]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def timed_start(api: Api, pods: Watch, pod: dict[str, Any], claim: dict[str, Any] | None = None) -> float:
    """Seconds from the first POST (the claim's, then the pod's) until the pod watch `pods` shows the
    pod Running and ready; the pod (grace 0), then its claim, deleted and the pod gone before this
    returns."""
    name = pod["metadata"]["name"]
    since = pods.mark()
    start = time.monotonic()
    if claim is not None:
        api.create(CLAIMS, claim)
    api.create(PODS, pod)
    running = pods.wait(name, lambda v: v["running"], since, 120) - start
    since = pods.mark()
    api.request("DELETE", f"{PODS}/{name}?gracePeriodSeconds=0")
    deadline = time.monotonic() + 60
    while not any(kind == "DELETED" and who == name for _, kind, who, _ in pods.since(since)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pod {name} not gone within 60 s")
        time.sleep(0.05)
    if claim is not None:
        api.request("DELETE", f"{CLAIMS}/{claim['metadata']['name']}")
    return running


def pool_devices(api: Api, node: str) -> dict[str, dict[str, Any]]:
    """{device name: {attribute: value}} of the DRA pool of `node` (our driver's slices)."""
    items = api.request("GET", "/apis/resource.k8s.io/v1/resourceslices")["items"]
    return {
        d["name"]: {k: next(iter(v.values())) for k, v in d.get("attributes", {}).items()}
        for s in items
        if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == node
        for d in s["spec"].get("devices", [])
    }
