"""DRA across the cluster: node-a and node-c on the DRA front-end with on-demand MIG, node-b on the
device plugins; the scheduler picks the node, the profile and the placement.

How a node chooses its front-end (deploy/helm/gpu-sharing/values.yaml, docs/dra.md): the chart's
`dra.enabled` installs what DRA needs (DeviceClasses, the agent's ResourceSlice rights, the kubelet's
plugin directories in the agent's pod), `frontend` is the default for every node, and a node's label
`nvidia.com/gpu-sharing.frontend=deviceplugin|dra` overrides it for that node. The module turns the
chart's DRA part on, takes node-a's first A100-40GB and node-c's H200 to MIG on with nothing made,
then switches the two nodes to DRA with configs that make those GPUs `mig: dynamic` (on node-c with
one `devices: all` rule, which offers its L4s whole). At its end it puts the labels, the configs and
the chart back and waits until every node offers again what the session started with.

Each test deletes its pods and claims and waits until no instance is left on the dynamic GPUs
(unprepare destroys what prepare made), so each starts from empty dynamic GPUs. What exists on a
GPU is read with `sharing export` in that node's agent (the fake driver's state through pynvml).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from lab.cluster import CONFIG_LABEL, NODES

from tests.apiserver import offers_whole, pool_devices
from tests.cluster.conftest import FRONTEND, Cluster
from tests.hardware import mig_devices
from tests.polling import poll

pytestmark = pytest.mark.node

DRIVER = "gpu.nvidia.com"
HEAD = "version: v1\nmigStrategy: mixed\ngpus:\n"
A100_0 = "  - devices: {product: A100-SXM4-40GB, indices: [0]}\n    mig: "
H200 = "  - devices: {product: H200}\n    mig: "
CONFIGS = {
    "dra-empty-a": f"{HEAD}{A100_0}enabled\n",
    "dra-empty-c": f"{HEAD}{H200}enabled\n",
    "dra-a": f"{HEAD}{A100_0}dynamic\n",
    # One rule for the mixed node: the H200 dynamic, the L4s (no MIG) offered whole.
    "dra-c": f"{HEAD}  - devices: all\n    mig: dynamic\n",
}
DYNAMIC = {"node-a": "NVIDIA A100-SXM4-40GB", "node-c": "NVIDIA H200"}
"""The DRA nodes and the product of their one dynamic GPU (GPU 0)."""
WHOLE = {"node-a": {"gpu-1", "gpu-2"}, "node-c": {"gpu-1", "gpu-2"}}
"""The GPUs each DRA node offers whole: node-a's second A100 and its H100, node-c's two L4s."""


def export(cluster: Cluster, node: str) -> dict[str, Any]:
    return dict(json.loads(cluster.agent_exec(node, "sharing", "export", "--json")))


def gpu0(cluster: Cluster, node: str) -> dict[str, Any]:
    return dict(next(g for g in export(cluster, node)["gpus"] if g["index"] == 0))


def gpu0_mig(cluster: Cluster, node: str) -> list[dict[str, Any]] | None:
    """The MIG devices on the node's GPU 0 as the hardware has them; None while its MIG mode is off."""
    return mig_devices(cluster.node(node).gpus_state).get(0)


def pool(cluster: Cluster, node: str) -> dict[str, dict[str, Any]]:
    """{device: its attributes as plain values} of the node's pool of our driver, as the scheduler
    takes it (`pool_devices`)."""
    items = cluster.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    return pool_devices(
        [s for s in items if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == node]
    )


def offered(devices: dict[str, dict[str, Any]]) -> tuple[set[str], set[str]]:
    """(the whole GPUs, the products of the on-demand MIG devices) of a pool."""
    whole = {name for name, a in devices.items() if a.get("type") == "gpu"}
    ondemand = {a["productName"] for name, a in devices.items() if "-at-" in name}
    return whole, ondemand


def ready(cluster: Cluster, node: str) -> bool:
    """The agent's /readyz answers (on DRA: the kubelet confirmed the plugin's registration)."""
    probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9402/readyz', timeout=5)"
    try:
        cluster.agent_exec(node, "python3", "-c", probe)
    except AssertionError:
        return False
    return True


def relabel(cluster: Cluster, node: str, *labels: str) -> None:
    cluster.kubectl("label", "node", node, *labels, "--overwrite")


@pytest.fixture(scope="module")
def dra_nodes(dra_chart: Cluster) -> Iterator[Cluster]:
    cluster = dra_chart
    patch = json.dumps({"data": CONFIGS})
    cluster.kubectl(
        "-n", "gpu-sharing", "patch", "configmap", "gpu-sharing-config", "--type=merge", "-p", patch
    )
    try:
        # MIG on with nothing made first: a dynamic GPU keeps whatever instances it finds.
        for node in DYNAMIC:
            relabel(cluster, node, f"{CONFIG_LABEL}=dra-empty-{node[-1]}")
        for node in DYNAMIC:
            poll(
                f"{node}'s GPU 0 in MIG mode, empty",
                lambda n=node: gpu0_mig(cluster, n),
                lambda d: d == [],
                180,
            )
            relabel(cluster, node, f"{FRONTEND}=dra", f"{CONFIG_LABEL}=dra-{node[-1]}")
        for node, product in DYNAMIC.items():
            poll(
                f"{node}'s pool: GPUs {WHOLE[node]} whole, on-demand devices of its {product}",
                lambda n=node: offered(pool(cluster, n)),
                lambda seen, n=node, p=product: seen == (WHOLE[n], {p}),
                180,
            )
            poll(
                f"no device-plugin resources on {node}",
                lambda n=node: cluster.allocatable(n),
                lambda a: not a,
            )
            poll(f"{node}'s DRA plugin registered", lambda n=node: ready(cluster, n), bool, 120)
        yield cluster
    finally:
        cluster.delete_pods()
        for node in DYNAMIC:
            relabel(cluster, node, f"{FRONTEND}-", f"{CONFIG_LABEL}={NODES[node][1]}")
        for node in DYNAMIC:
            cluster.wait_converged(node, NODES[node][2])
        gone = json.dumps({"data": dict.fromkeys(CONFIGS)})
        cluster.kubectl(
            "-n", "gpu-sharing", "patch", "configmap", "gpu-sharing-config", "--type=merge", "-p", gone
        )


@dataclass
class Claims:
    """Claims and pods of one test, placed by the scheduler; deleted after it."""

    cluster: Cluster
    objects: list[tuple[str, str]] = field(default_factory=list)

    def apply(self, obj: dict[str, Any]) -> str:
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
        name = str(obj["metadata"]["name"])
        self.objects.append((obj["kind"].lower(), name))
        return name

    def claim(self, requests: list[dict[str, Any]], **devices: Any) -> str:
        return self.apply(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"c-{uuid.uuid4().hex[:6]}", "namespace": "default"},
                "spec": {"devices": {"requests": requests, **devices}},
            }
        )

    def pod(self, claim: str) -> str:
        return self.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"p-{uuid.uuid4().hex[:6]}", "namespace": "default"},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "localhost/toolbox:1",
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["sleep", "1000000"],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                },
            }
        )

    def allocated(self, claim: str) -> list[tuple[str, str]]:
        """(pool, device) of each device of our driver allocated to the claim."""
        status = self.cluster.get(f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{claim}")
        results = status.get("status", {}).get("allocation", {}).get("devices", {}).get("results", [])
        return [(r["pool"], r["device"]) for r in results if r["driver"] == DRIVER]

    def seen(self, pod: str) -> set[str]:
        """The device UUIDs the pod's container sees (the env of its claim's CDI spec)."""
        lines = self.cluster.kubectl("exec", pod, "--", "env").splitlines()
        return {
            v for k, _, v in (line.partition("=") for line in lines) if k.startswith("GPU_SHARING_DEVICE_")
        }

    def cleanup(self) -> None:
        for kind in ("pod", "resourceclaim"):
            names = [n for k, n in self.objects if k == kind]
            if names:
                self.cluster.kubectl("delete", kind, "--ignore-not-found", "--timeout=120s", *names)
        self.objects.clear()


def no_instances(cluster: Cluster) -> None:
    """No instance on either dynamic GPU, and the pools published again without them: a test reads
    and claims from the pool, which the agent republishes after the hardware has changed."""
    for node in DYNAMIC:
        poll(
            f"no instance on {node}'s dynamic GPU, its whole room offered",
            lambda n=node: (gpu0_mig(cluster, n), offers_whole(pool(cluster, n), (0,))),
            lambda seen: seen == ([], True),
            120,
        )


@pytest.fixture
def claims(dra_nodes: Cluster) -> Iterator[Claims]:
    made = Claims(dra_nodes)
    no_instances(dra_nodes)
    try:
        yield made
    finally:
        made.cleanup()
        no_instances(dra_nodes)


def mig_class(profile: str) -> list[dict[str, Any]]:
    return [{"name": "mig", "exactly": {"deviceClassName": f"mig-{profile}.nvidia.com"}}]


def test_a_3g_20gb_claim_lands_on_the_one_node_with_a_free_placement(claims: Claims) -> None:
    """Both DRA nodes have an empty dynamic GPU; only node-a's A100-40GB has 3g.20gb placements
    (node-c's H200 has 3g.71gb ones, node-b is on the device plugins)."""
    cluster = claims.cluster
    claim = claims.claim(mig_class("3g.20gb"))
    pod = claims.pod(claim)
    got = cluster.wait_running(pod, 120)
    assert "node-a" == got["spec"]["nodeName"]
    ((at, device),) = claims.allocated(claim)
    assert "node-a" == at
    assert device.startswith("gpu-0-mig-3g-20gb-at-"), device
    # The instance was made for the claim, at that placement, and it is what the container sees.
    (instance,) = gpu0(cluster, "node-a")["instances"]
    assert "3g.20gb" == instance["profile"]
    assert {instance["uuid"]} == claims.seen(pod)
    assert [] == gpu0(cluster, "node-c")["instances"]


def test_two_mig_devices_of_one_gpu_by_matching_their_parent(claims: Claims) -> None:
    cluster = claims.cluster
    claim = claims.claim(
        [{"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com", "count": 2}}],
        constraints=[{"requests": ["mig"], "matchAttribute": f"{DRIVER}/parentUUID"}],
    )
    pod = claims.pod(claim)
    got = cluster.wait_running(pod, 120)
    node = got["spec"]["nodeName"]
    allocated = claims.allocated(claim)
    assert 2 == len(allocated)
    assert {node} == {at for at, _ in allocated}
    devices = pool(cluster, node)
    parents = {devices[d]["parentUUID"] for _, d in allocated}
    assert 1 == len(parents), allocated
    # Two MIG devices made on that one GPU, both given to the container.
    (gpu,) = [g for g in export(cluster, node)["gpus"] if g["uuid"] in parents]
    assert 2 == len(gpu["instances"])
    assert {i["uuid"] for i in gpu["instances"]} == claims.seen(pod)


def test_a_claim_no_node_can_serve_stays_pending_with_the_schedulers_reason(claims: Claims) -> None:
    """Three 3g.20gb in one claim: node-a's A100-40GB holds two, no other GPU of the cluster any."""
    cluster = claims.cluster
    claim = claims.claim(
        [{"name": "mig", "exactly": {"deviceClassName": "mig-3g.20gb.nvidia.com", "count": 3}}]
    )
    pod = claims.pod(claim)

    def unschedulable(p: dict[str, Any]) -> bool:
        conditions = p.get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    got = poll("the pod unschedulable", lambda: cluster.pod(pod), unschedulable, 90)
    (scheduled,) = [c for c in got["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "0/3 nodes are available" in scheduled["message"], scheduled
    assert "cannot allocate all claims" in scheduled["message"], scheduled
    assert "Pending" == got["status"]["phase"]
    assert not got["spec"].get("nodeName")
    assert [] == claims.allocated(claim)
    for node in DYNAMIC:
        assert [] == gpu0(cluster, node)["instances"]


def test_the_mixed_node_offers_its_l4s_whole_beside_its_dynamic_h200(claims: Claims) -> None:
    cluster = claims.cluster
    devices = pool(cluster, "node-c")
    gpus = {g["index"]: g for g in export(cluster, "node-c")["gpus"]}
    for name in WHOLE["node-c"]:
        index = int(name.removeprefix("gpu-"))
        assert ("gpu", "NVIDIA L4", gpus[index]["uuid"]) == (
            devices[name]["type"],
            devices[name]["productName"],
            devices[name]["uuid"],
        )
    ondemand = {n: a for n, a in devices.items() if "-at-" in n}
    assert {"1g.18gb", "3g.71gb", "7g.141gb"} <= {a["profile"] for a in ondemand.values()}
    assert {gpus[0]["uuid"]} == {a["parentUUID"] for a in ondemand.values()}
    # Both kinds at once, on that node: an L4 whole and a 1g.18gb made on the H200.
    cel = f"device.attributes['{DRIVER}'].productName == 'NVIDIA L4'"
    l4 = claims.claim(
        [
            {
                "name": "gpu",
                "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": cel}}]},
            }
        ]
    )
    slice_ = claims.claim(mig_class("1g.18gb"))
    pods = {claims.pod(l4): l4, claims.pod(slice_): slice_}
    for pod in pods:
        assert "node-c" == cluster.wait_running(pod, 120)["spec"]["nodeName"]
    ((_, whole),) = claims.allocated(l4)
    assert whole in WHOLE["node-c"]
    (instance,) = gpu0(cluster, "node-c")["instances"]
    assert "1g.18gb" == instance["profile"]
    seen = {claim: claims.seen(pod) for pod, claim in pods.items()}
    assert {l4: {devices[whole]["uuid"]}, slice_: {instance["uuid"]}} == seen
