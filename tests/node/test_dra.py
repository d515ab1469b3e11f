"""DRA on the real node: the session node of tests/node/conftest.py switched to the DRA front-end.

The module switches the node once (the chart's DRA on, the node's label `nvidia.com/gpu-sharing.frontend=dra`)
and back at its end (label removed, chart values as the session set them), so every other module
finds the node as the session made it; each test deletes the claims and pods it made. The claims
are written as for NVIDIA's DRA driver (driver gpu.nvidia.com, classes gpu.nvidia.com and
mig.nvidia.com, its attribute names), and what a container sees is compared with the GPUs as
`sharing export` in the agent's pod reads them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from lab.api import ApiError
from lab.helm import NAMESPACE, lab_values

from tests.apiserver import pool_devices
from tests.hardware import mig_devices
from tests.node.conftest import ALL_KINDS, CONFIG, NODE, TOOLBOX, NodeUnderTest, container_status
from tests.polling import poll

pytestmark = pytest.mark.node

FRONTEND = "nvidia.com/gpu-sharing.frontend"
STATE = "nvidia.com/mig.config.state"


def _agent(node: NodeUnderTest) -> tuple[str, int]:
    """The agent's pod UID and its container's restart count."""
    (pod,) = node.agent_pods()
    return pod["metadata"]["uid"], container_status(pod, "agent")["restartCount"]


def _labels(node: NodeUnderTest) -> dict[str, str]:
    return dict(node.get("node", NODE)["metadata"].get("labels", {}))


# --- DRA serving the node -----------------------------------------------------------------------

DRIVER = "gpu.nvidia.com"
A100 = "NVIDIA A100-SXM4-40GB"
# ALL_KINDS through DRA: per A100 its 4 MIG devices (replicas are shares of one device), the two H100s.
DEVICES = {
    *(f"gpu-{g}-mig-{m}" for g in (0, 1) for m in range(4)),
    "gpu-2",
    "gpu-3",
}


@dataclass
class DraNode:
    """The session node served through DRA, and the claims and pods a test made (deleted after it)."""

    node: NodeUnderTest
    objects: list[tuple[str, str]] = field(default_factory=list)

    def apply(self, obj: dict[str, Any]) -> str:
        self.node.create(obj)
        name = obj["metadata"]["name"]
        self.objects.append((obj["kind"].lower(), name))
        return str(name)

    def claim(self, requests: list[dict[str, Any]], **devices: Any) -> str:
        name = f"c-{uuid.uuid4().hex[:6]}"
        return self.apply(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": {"requests": requests, **devices}},
            }
        )

    def pod(self, claim: str | None = None, limits: dict[str, str] | None = None) -> str:
        name = f"p-{uuid.uuid4().hex[:6]}"
        container: dict[str, Any] = {"name": "main", "image": TOOLBOX, "command": ["sleep", "1000000"]}
        spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1}
        if claim is not None:
            spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
            container["resources"] = {"claims": [{"name": "gpu"}]}
        if limits is not None:
            container["resources"] = {"limits": limits}
        spec["containers"] = [container]
        return self.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "default"},
                "spec": spec,
            }
        )

    def allocated(self, claim: str) -> list[str]:
        """The devices of our pool the scheduler allocated to the claim."""
        status = self.node.get("resourceclaim", claim).get("status", {})
        results = status.get("allocation", {}).get("devices", {}).get("results", [])
        return [r["device"] for r in results if r["driver"] == DRIVER and r["pool"] == NODE]

    def seen(self, pod: str) -> set[str]:
        """The device UUIDs the pod's container sees (the env of the per-claim CDI spec)."""
        return {v for k, v in self.node.env(pod).items() if k.startswith("GPU_SHARING_DEVICE_")}

    def cleanup(self) -> None:
        for kind in ("pod", "resourceclaim"):
            names = [n for k, n in self.objects if k == kind]
            if names:
                self.node.delete(kind, *names)
        self.objects.clear()


def mig_request(cel: str, name: str = "mig", **extra: Any) -> list[dict[str, Any]]:
    """One request of the class mig.nvidia.com with a CEL selector."""
    exactly = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": cel}}], **extra}
    return [{"name": name, "exactly": exactly}]


def _slices(node: NodeUnderTest) -> list[dict[str, Any]]:
    items = node.get("resourceslices")["items"]
    return [s for s in items if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == NODE]


def _published(node: NodeUnderTest) -> dict[str, dict[str, Any]]:
    """{device name: its attributes as plain values} of the node's pool as the scheduler takes it
    (`pool_devices`)."""
    return pool_devices(_slices(node))


def _ready(node: NodeUnderTest) -> bool:
    """The agent's /readyz answers 200 (on DRA: the kubelet confirmed the plugin's registration)."""
    try:
        node.served("/readyz")
    except ApiError:
        return False
    return True


@dataclass(frozen=True)
class Switched:
    """The session node right after its switch to DRA, as a user saw it: the Node's allocatable
    nvidia.com/ resources when the pool first showed, and a pod asking by limits made at that moment,
    as it ended (Running, or failed by the kubelet)."""

    node: NodeUnderTest
    allocatable: dict[str, str]
    pod: dict[str, Any]


def _started_or_refused(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") in ("Running", "Failed")


@pytest.fixture(scope="module")
def switched(real_node: NodeUnderTest) -> Iterator[Switched]:
    """The session node switched to DRA (the chart's DRA on, the node's label), switched back after."""
    node = real_node
    node.delete_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, dra={"enabled": True}))
    try:
        node.label(FRONTEND, "dra")
        # What a user does (and the demo): once the pool shows, a pod asks by limits at once.
        poll("the pool's devices", lambda: set(_published(node)), lambda d: d == DEVICES, 120)
        shown = node.allocatable()
        first = DraNode(node)
        name = first.pod(limits={"nvidia.com/mig-1g.5gb": "1"})
        pod = poll(f"pod {name} Running or failed", lambda: node.pod(name), _started_or_refused, 60)
        first.cleanup()
        # The agent publishes its devices once the kubelet has confirmed the plugin's registration,
        # and is ready then.
        poll("the DRA plugin registered with the kubelet", lambda: _ready(node), lambda ok: ok, 120)
        yield Switched(node, shown, pod)
    finally:
        node.label(FRONTEND, None)
        node.wait_allocatable(timeout=120)
        node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
        node.running_agent()
        node.wait_allocatable()


@pytest.fixture(scope="module")
def dra_session(switched: Switched) -> NodeUnderTest:
    return switched.node


def test_once_the_pool_shows_the_node_offers_nothing_by_plugins_and_a_pod_by_limits_runs_through_dra(
    switched: Switched,
) -> None:
    """The scheduler sends a pod asking by limits to the device plugins while the Node's allocatable
    has the resource, and the kubelet then fails it ("no healthy devices present"): the pool must not
    show before the Node's allocatable says the plugins are gone."""
    assert dict.fromkeys(switched.allocatable, "0") == switched.allocatable
    status = switched.pod["status"]
    assert ("Running", "") == (status["phase"], status.get("message", ""))
    claimed = status["extendedResourceClaimStatus"]["requestMappings"]
    assert [("main", "nvidia.com/mig-1g.5gb")] == [(m["containerName"], m["resourceName"]) for m in claimed]


@pytest.fixture
def dra(dra_session: NodeUnderTest) -> Iterator[DraNode]:
    under = DraNode(dra_session)
    try:
        yield under
    finally:
        under.cleanup()


def _export_uuids(node: NodeUnderTest) -> dict[str, tuple[int, str, str]]:
    """{UUID: (GPU index, product, profile or 'gpu')} of every GPU and MIG device, per `sharing export`."""
    out: dict[str, tuple[int, str, str]] = {}
    for g in node.export()["gpus"]:
        out[g["uuid"]] = (g["index"], g["product"], "gpu")
        for i in g["instances"]:
            if i["uuid"]:
                out[i["uuid"]] = (g["index"], g["product"], i["profile"])
    return out


def test_the_pool_offers_every_device_with_nvidias_attributes(dra: DraNode) -> None:
    published = _published(dra.node)
    assert DEVICES == set(published)
    exported = _export_uuids(dra.node)
    for name, attrs in published.items():
        index, product, profile = exported[attrs["uuid"]]
        assert (product, "mig" if "-mig-" in name else "gpu") == (attrs["productName"], attrs["type"])
        if "-mig-" in name:
            assert (profile, exported[attrs["parentUUID"]][0]) == (attrs["profile"], index)
    print(dra.node.kubectl("get", "resourceslices", "-o", "yaml"))


def test_a_claim_by_class_gets_a_whole_gpu_and_its_container_sees_exactly_it(dra: DraNode) -> None:
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}])
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    (device,) = dra.allocated(claim)
    uuid_ = _published(dra.node)[device]["uuid"]
    assert {uuid_} == dra.seen(pod)
    assert "gpu" == _export_uuids(dra.node)[uuid_][2]


def test_a_claim_by_cel_on_profile_and_product_gets_that_mig_device(dra: DraNode) -> None:
    cel = (
        f"device.attributes['{DRIVER}'].profile == '1g.5gb' && "
        f"device.attributes['{DRIVER}'].productName == '{A100}'"
    )
    claim = dra.claim(
        [
            {
                "name": "mig",
                "exactly": {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": cel}}]},
            }
        ]
    )
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    (device,) = dra.allocated(claim)
    (seen,) = dra.seen(pod)
    assert _published(dra.node)[device]["uuid"] == seen
    _, product, profile = _export_uuids(dra.node)[seen]
    assert (A100, "1g.5gb") == (product, profile)
    print(dra.node.kubectl("get", "resourceclaim", claim, "-o", "yaml"))
    print(f"pod {pod} sees {dra.node.env(pod)}")


def test_two_mig_devices_on_one_gpu_by_matching_their_parent(dra: DraNode) -> None:
    cel = f"device.attributes['{DRIVER}'].profile == '1g.5gb'"
    claim = dra.claim(
        [
            {
                "name": "mig",
                "exactly": {
                    "deviceClassName": "mig.nvidia.com",
                    "count": 2,
                    "selectors": [{"cel": {"expression": cel}}],
                },
            }
        ],
        constraints=[{"matchAttribute": f"{DRIVER}/parentUUID"}],
    )
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    seen = dra.seen(pod)
    exported = _export_uuids(dra.node)
    assert 2 == len(seen)
    assert 1 == len({exported[u][0] for u in seen})
    assert {"1g.5gb"} == {exported[u][2] for u in seen}


def test_one_claim_shared_by_two_pods_gives_both_the_same_device(dra: DraNode) -> None:
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    first, second = dra.pod(claim), dra.pod(claim)
    dra.node.wait_running(first)
    dra.node.wait_running(second)
    assert dra.seen(first) == dra.seen(second)
    assert 1 == len(dra.seen(first))


def test_a_claim_that_cannot_be_satisfied_stays_pending_with_the_schedulers_reason(dra: DraNode) -> None:
    cel = f"device.attributes['{DRIVER}'].profile == '7g.40gb'"
    claim = dra.claim(
        [
            {
                "name": "big",
                "exactly": {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": cel}}]},
            }
        ]
    )
    pod = dra.pod(claim)

    def unschedulable(p: dict[str, Any]) -> bool:
        conditions = p.get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    got = poll("the pod unschedulable", lambda: dra.node.pod(pod), unschedulable, 60)
    (scheduled,) = [c for c in got["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "cannot allocate all claims" in scheduled["message"]
    assert "Pending" == got["status"]["phase"]
    assert [] == dra.allocated(claim)


def test_extended_resource_limits_are_served_through_the_profiles_class(dra: DraNode) -> None:
    pod = dra.pod(limits={"nvidia.com/mig-1g.5gb": "1"})
    got = dra.node.wait_running(pod)
    claim = got["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    (seen,) = dra.seen(pod)
    assert "1g.5gb" == _export_uuids(dra.node)[seen][2]
    (device,) = dra.allocated(claim)
    assert seen == _published(dra.node)[device]["uuid"]


def test_invalid_opaque_parameters_are_an_event_on_the_pod_and_the_agent_goes_on(dra: DraNode) -> None:
    before = _agent(dra.node)
    bad = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "TurboConfig"}
    claim = dra.claim(
        [{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}],
        config=[{"opaque": {"driver": DRIVER, "parameters": bad}}],
    )
    pod = dra.pod(claim)

    def said() -> list[str]:
        selector = f"involvedObject.kind=Pod,involvedObject.name={pod}"
        return [
            e["message"]
            for e in dra.node.get("events", "--field-selector", selector)["items"]
            if e["type"] == "Warning"
        ]

    messages = poll("a Warning Event on the pod", said, lambda m: any("TurboConfig" in x for x in m), 60)
    (message,) = {m for m in messages if "TurboConfig" in m}
    assert message.startswith("Failed to prepare dynamic resources: "), message
    assert f"ResourceClaim {claim}" in message, message
    assert "TurboConfig" in message, message
    assert "is not a config of driver gpu.nvidia.com" in message, message
    assert "Running" != dra.node.pod(pod)["status"].get("phase")
    assert before == _agent(dra.node)


def test_an_unknown_device_class_leaves_the_pod_pending_with_a_reason(dra: DraNode) -> None:
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "tpu.nvidia.com"}}])
    pod = dra.pod(claim)

    def reason(p: dict[str, Any]) -> str:
        conditions = p.get("status", {}).get("conditions", [])
        return next((c.get("message", "") for c in conditions if c["type"] == "PodScheduled"), "")

    message = poll("the scheduler's reason", lambda: reason(dra.node.pod(pod)), bool, 60)
    assert "tpu.nvidia.com" in message


def test_a_restarted_agent_unprepares_what_the_one_before_prepared(dra: DraNode) -> None:
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    (old,) = dra.node.agent_pods()
    dra.node.delete("pod", old["metadata"]["name"], namespace=NAMESPACE)
    dra.node.running_agent(not_uid=old["metadata"]["uid"])
    assert 1 == len(dra.seen(pod))  # still running on its device
    dra.node.delete("pod", pod)  # returns once unprepared
    # The node's /var/run/cdi is a tmpfs in its namespace: read through the agent's mount of it.
    specs = dra.node.kubectl("-n", NAMESPACE, "exec", "ds/gpu-sharing", "--", "ls", "/var/run/cdi")
    uid = dra.node.get("resourceclaim", claim)["metadata"]["uid"]
    assert uid not in specs


def test_a_kubelet_restarted_between_prepare_and_unprepare_loses_nothing(dra: DraNode) -> None:
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    pod = dra.pod(claim)
    before = dra.node.wait_running(pod)["status"]["containerStatuses"][0]["containerID"]
    seen = dra.seen(pod)
    dra.node.node.restart_kubelet()
    poll("the pool re-published", lambda: set(_published(dra.node)), lambda d: d == DEVICES, 120)

    def exec_env() -> tuple[int, str]:  # the restarted kubelet serves exec once it runs the pod again
        done = dra.node.node.kubectl("exec", pod, "--", "env")
        return done.returncode, done.stderr

    poll("exec into the pod", exec_env, lambda d: d[0] == 0, 120)
    after = dra.node.wait_running(pod)["status"]["containerStatuses"][0]
    assert (before, 0) == (after["containerID"], after["restartCount"])
    assert seen == dra.seen(pod)
    dra.node.delete("pod", pod)  # returns once unprepared
    second = dra.pod(claim)
    dra.node.wait_running(second)
    assert seen == dra.seen(second)


def test_a_claim_made_while_the_agent_restarts_runs_without_a_failed_prepare(dra: DraNode) -> None:
    """The pool used to stay while no agent served it, and the next agent published before the
    kubelet had registered it: the scheduler placed the pod, the kubelet failed it "DRA driver
    gpu.nvidia.com is not registered" and tried again only at its pod resync, a minute later. Now
    the pod waits unscheduled until the next agent is registered and has published."""
    (old,) = dra.node.agent_pods()
    dra.node.delete("pod", old["metadata"]["name"], namespace=NAMESPACE)
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    pod = dra.pod(claim)
    dra.node.running_agent(not_uid=old["metadata"]["uid"])
    dra.node.wait_running(pod)
    selector = f"involvedObject.name={pod},reason=FailedPrepareDynamicResources"
    assert [] == dra.node.get("events", "--field-selector", selector)["items"]


def test_a_claim_deleted_while_the_agent_is_down_is_unprepared_when_it_is_back(dra: DraNode) -> None:
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    (old,) = dra.node.agent_pods()
    # The agent's pod goes and the claim with the pod while no new one serves yet.
    dra.node.delete("pod", old["metadata"]["name"], namespace=NAMESPACE, wait=False)
    dra.node.delete("pod", pod, wait=False)
    dra.node.delete("resourceclaim", claim, wait=False)
    dra.node.running_agent(not_uid=old["metadata"]["uid"])
    poll("the pod gone", lambda: dra.node.exists("pod", pod), lambda found: not found, 90)
    poll("the claim gone", lambda: dra.node.exists("resourceclaim", claim), lambda found: not found, 90)


def test_the_node_runs_what_dra_needs(dra: DraNode) -> None:
    """resource.k8s.io/v1 served, the kubelet's plugin dirs made, the resourceclaim controller running
    (it makes the claims of templates and of extended-resource requests), the agent's pod mounting them."""
    node = dra.node
    served = node.kubectl("api-resources", "--api-group=resource.k8s.io", "-o", "name").split()
    assert {
        "deviceclasses.resource.k8s.io",
        "resourceclaims.resource.k8s.io",
        "resourceclaimtemplates.resource.k8s.io",
        "resourceslices.resource.k8s.io",
    } <= set(served)
    kubelet_root = node.node.state / "kubelet"
    assert (True, True) == ((kubelet_root / "plugins_registry").is_dir(), (kubelet_root / "plugins").is_dir())
    manager = (node.node.logs() / "kube-controller-manager.log").read_text()
    assert "Starting resource claim controller" in manager
    (pod,) = node.agent_pods()
    mounts = {m["mountPath"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])}
    assert {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= mounts


# The A100s cut into 1g.5gb slices only: a change that would destroy every MIG device they have now.
SMALL = ALL_KINDS.replace(
    "mig: {1g.5gb: 2, 2g.10gb: 1, 3g.20gb: 1}\n    replicas: {2g.10gb: 2}", "mig: {1g.5gb: 7}"
)
SMALL_DEVICES = {*(f"gpu-{g}-mig-{m}" for g in (0, 1) for m in range(7)), "gpu-2", "gpu-3"}


def test_a_config_change_leaves_a_claimed_device_alone_and_finishes_when_it_is_free(dra: DraNode) -> None:
    cel = f"device.attributes['{DRIVER}'].profile == '3g.20gb'"
    claim = dra.claim(
        [
            {
                "name": "mig",
                "exactly": {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": cel}}]},
            }
        ]
    )
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    (held,) = dra.seen(pod)
    gpu = _export_uuids(dra.node)[held][0]
    said = len(dra.node.events("ConfigApplyBlocked"))
    try:
        dra.node.patch_configs({CONFIG: SMALL})
        waits = poll(
            "ConfigApplyBlocked", lambda: dra.node.events("ConfigApplyBlocked"), lambda m: len(m) > said, 90
        )
        assert f"claim default/{claim} (pod default/{pod})" in waits[-1]
        other = 1 - gpu
        profiles = poll(
            "the other A100 re-cut",
            lambda: {
                i: [x["profile"] for x in rows]
                for i, rows in mig_devices(dra.node.node.gpus_state, A100).items()
            },
            lambda p: p.get(other) == ["1g.5gb"] * 7,
            90,
        )
        assert held in _export_uuids(dra.node)  # untouched while the claim holds it
        assert "3g.20gb" in profiles[gpu]
        assert {held} == dra.seen(pod)
        dra.cleanup()
        poll("the change finished", lambda: set(_published(dra.node)), lambda d: d == SMALL_DEVICES, 120)
        assert held not in _export_uuids(dra.node)
    finally:
        dra.cleanup()
        dra.node.patch_configs({CONFIG: ALL_KINDS})
        poll("the pool as before", lambda: set(_published(dra.node)), lambda d: d == DEVICES, 120)


def test_switching_the_front_end_with_pods_running_waits_for_them(dra: DraNode) -> None:
    node = dra.node
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    pod = dra.pod(claim)
    node.wait_running(pod)
    blocked = len(node.events("FrontendSwitchBlocked"))
    switched = len(node.events("FrontendSwitched"))
    try:
        node.label(FRONTEND, "deviceplugin")
        waits = poll(
            "the switch waits", lambda: node.events("FrontendSwitchBlocked"), lambda m: len(m) > blocked, 60
        )
        assert f"claim default/{claim} (pod default/{pod})" in waits[-1]
        assert [] == _slices(node)  # withdrawn: nothing new is allocated
        assert set(node.allocatable().values()) <= {"0"}  # and not offered through device plugins yet
        assert 1 == len(dra.seen(pod))  # the running pod keeps its device
        dra.cleanup()
        poll("switched", lambda: node.events("FrontendSwitched"), lambda m: len(m) > switched, 90)
        node.wait_allocatable()
        name = node.start_pod("nvidia.com/mig-1g.5gb")
        node.wait_running(name)
        # Back to DRA: now a device-plugin pod holds the switch.
        blocked = len(node.events("FrontendSwitchBlocked"))
        node.label(FRONTEND, "dra")
        waits = poll(
            "the switch back waits",
            lambda: node.events("FrontendSwitchBlocked"),
            lambda m: len(m) > blocked,
            60,
        )
        assert f"default/{name}" in waits[-1]
        assert [] == _slices(node)
        node.delete_pods()
    finally:
        dra.cleanup()
        node.delete_pods()
        node.label(FRONTEND, "dra")
        poll("the pool back", lambda: set(_published(node)), lambda d: d == DEVICES, 120)


def test_sharing_status_shows_the_claim_and_its_pod_beside_the_device(dra: DraNode) -> None:
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    (seen,) = dra.seen(pod)

    def claims(document: dict[str, Any]) -> list[Any]:
        return [s["claims"] for g in document["gpus"] for s in g["slices"] if s["id"] == seen]

    # The agent reads who holds what at most once a second.
    document = poll("the claim in `sharing status`", dra.node.status, lambda d: any(claims(d)), 30)
    assert "dra" == document["frontend"]
    assert [[{"namespace": "default", "name": claim, "pods": [f"default/{pod}"]}]] == claims(document)
    table = dra.node.kubectl("-n", NAMESPACE, "exec", "ds/gpu-sharing", "--", "sharing", "status")
    assert f"claim default/{claim} (pod default/{pod})" in table


def test_the_metrics_count_prepared_claims_and_time_their_prepare(dra: DraNode) -> None:
    def metrics() -> dict[str, float]:
        values = {}
        for line in dra.node.metrics():
            name, _, value = line.partition(" ")
            if name.startswith("gpu_sharing_dra_"):
                values[name] = float(value)
        return values

    before = metrics()
    claim = dra.claim([{"name": "gpu", "exactly": {"deviceClassName": "mig.nvidia.com"}}])
    pod = dra.pod(claim)
    dra.node.wait_running(pod)
    # /metrics renders at most once a second: look until it shows the claim.
    after = poll(
        "the prepared claim in /metrics", metrics, lambda m: m["gpu_sharing_dra_prepared_claims"] == 1, 30
    )

    def prepares(values: dict[str, float]) -> float:  # of every profile
        return sum(
            v for k, v in values.items() if k.startswith("gpu_sharing_dra_prepare_duration_seconds_count{")
        )

    assert prepares(after) > prepares(before)
