"""What the benches on a real node share (hack/lab, as tests/node brings it up): the node up with the
agent installed by its Helm chart, watches held while a bench runs, pods started and timed from their
POST to Running and ready, and the devices of the node's DRA pool.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lab
from lab.helm import Helm
from lab.images import TOOLBOX

from bench.clients import Api, Watch
from sharing.dra.names import DRIVER

PODS = "/api/v1/namespaces/default/pods"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


def chart_node(
    bins: lab.Binaries,
    archives: Sequence[Path],
    run: str,
    name: str,
    *,
    index: int,
    labels: Mapping[str, str],
    values: dict[str, Any],
) -> tuple[lab.RealNode, Api]:
    """Node `name` of the lab cluster `run` up with the images `archives`, `labels` on it, then the
    chart installed with `values`; the node and a client of its API server (taken down here only
    when this fails)."""
    node = lab.RealNode(run, name, index=index).up(archives)
    try:
        api = Api(f"https://{node.address}:6443", node.state / "control-plane")
        api.label_node(name, dict(labels))
        Helm(node.kubeconfig, binary=bins.helm).upgrade_install(values)
    except BaseException:
        node.down()
        raise
    return node, api


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
