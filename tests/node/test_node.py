"""The agent as users run it: the chart's DaemonSet pod on a real kubelet, real pods getting slices.

All on the session's node (tests/node/conftest.py), each test on its own in any order: install,
pods of every resource kind, a pod that cannot fit, kubelet restart, agent pod deletion, helm
upgrade, uninstall (the last two put the chart back afterwards). What a pod's container sees is
checked against what the kubelet recorded from Allocate and against `sharing export` run inside the
agent's pod.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from lab.api import ApiError
from lab.helm import NAMESPACE, RELEASE, lab_values

from tests.node.conftest import ALL_KINDS, CONFIG, CONFIG_LABEL, EXPECTED, NODE, NodeUnderTest
from tests.polling import poll

pytestmark = pytest.mark.node

VISIBLE = "NVIDIA_VISIBLE_DEVICES"


def test_the_chart_runs_the_agent_as_a_daemonset_pod_registered_with_the_kubelet(node: NodeUnderTest) -> None:
    assert "deployed" == node.helm.status()["info"]["status"]
    daemonset = node.get("daemonset", RELEASE, "-n", NAMESPACE)
    assert (1, 1) == (daemonset["status"]["desiredNumberScheduled"], daemonset["status"]["numberReady"])
    (pod,) = node.agent_pods()
    assert NODE == pod["spec"]["nodeName"]
    assert "Running" == pod["status"]["phase"]
    # The kubelet lists a resource only after the plugin registered and sent its devices (and keeps
    # one at 0 for 5 minutes after its plugin went: an earlier test's config may have made it).
    assert EXPECTED == node.offered()
    assert set(EXPECTED) == _registered(node.agent_log())


def _registered(log: str) -> set[str]:
    """The resources whose plugins the agent's log says are registered with the kubelet now: registered
    and not removed since. The modules before this one share the agent's pod and its log, and their
    configs register resources of their own (tests/node/test_usage.py's recommended config a
    `mig-2g.10gb`)."""
    now: set[str] = set()
    for event, resource in _plugin_events(log.splitlines()):
        if event == "plugin_registered":
            now.add(resource)
        else:
            now.discard(resource)
    return now


def _plugin_events(lines: list[str]) -> list[tuple[str, str]]:
    """(plugin_registered or plugin_removed, resource) in the agent's log lines, console or JSON."""
    found = []
    for line in lines:
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") in ("plugin_registered", "plugin_removed"):
                found.append((event["event"], event["resource"]))
            continue
        words = line.split()
        for name in ("plugin_registered", "plugin_removed"):
            if name in words:
                found += [(name, w.removeprefix("resource=")) for w in words if w.startswith("resource=")]
    return found


def _gpus(export: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["uuid"]: g for g in export["gpus"]}


def _mig(export: dict[str, Any]) -> dict[str, tuple[int, str]]:
    return {i["uuid"]: (g["index"], i["profile"]) for g in export["gpus"] for i in g["instances"]}


@pytest.mark.parametrize(
    ("resource", "kind"),
    [
        pytest.param("nvidia.com/mig-1g.5gb", "mig", id="mig-device"),
        pytest.param("nvidia.com/gpu", "gpu", id="whole-gpu"),
        pytest.param("nvidia.com/gpu.shared", "gpu-replica", id="time-sliced-replica"),
        pytest.param("nvidia.com/mig-2g.10gb.shared", "mig-replica", id="replica-of-a-mig-device"),
    ],
)
def test_a_pod_sees_exactly_the_device_allocate_handed_out(
    node: NodeUnderTest, resource: str, kind: str
) -> None:
    name = node.start_pod(resource)
    pod = node.wait_running(name)
    assert NODE == pod["spec"]["nodeName"]  # placed by the scheduler: the spec named no node
    ids, response = node.allocation(pod, resource)
    assert 1 == len(ids)
    device, _, replica = ids[0].partition("::")
    assert (kind.endswith("replica")) == bool(replica)
    # The container's env is exactly Allocate's, and names the device behind the ID.
    assert {VISIBLE: device} == response
    assert device == node.env(name)[VISIBLE]
    export = node.export()
    if kind.startswith("mig"):
        index, profile = _mig(export)[device]
        assert resource.removeprefix("nvidia.com/mig-").removesuffix(".shared") == profile
        assert index in (0, 1)  # the A100s
    else:
        gpu = _gpus(export)[device]
        assert (False, "NVIDIA H100 80GB HBM3") == (gpu["migEnabled"], gpu["product"])
        assert (2 if kind == "gpu" else 3) == gpu["index"]


def test_a_pod_asking_for_more_than_is_free_stays_pending(node: NodeUnderTest) -> None:
    name = node.start_pod("nvidia.com/mig-3g.20gb", count=3)

    def unschedulable(pod: dict[str, Any]) -> bool:
        conditions = pod["status"].get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    pod = poll("the scheduler's verdict", lambda: node.pod(name), unschedulable)
    (condition,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "Insufficient nvidia.com/mig-3g.20gb" in condition["message"]
    assert "Pending" == pod["status"]["phase"]


def _holding_pod(node: NodeUnderTest) -> tuple[str, str, str]:
    name = node.start_pod("nvidia.com/mig-3g.20gb")
    pod = node.wait_running(name)
    return name, pod["status"]["containerStatuses"][0]["containerID"], node.env(name)[VISIBLE]


def _still_holding(node: NodeUnderTest, name: str, container: str, visible: str) -> None:
    pod = node.wait_running(name)
    status = pod["status"]["containerStatuses"][0]
    assert (container, 0) == (status["containerID"], status["restartCount"])
    assert visible == node.env(name)[VISIBLE]


def test_kubelet_restart_the_agent_registers_again_and_running_pods_keep_their_devices(
    node: NodeUnderTest,
) -> None:
    name, container, visible = _holding_pod(node)
    _restart_kubelet(node)
    node.wait_allocatable()
    _still_holding(node, name, container, visible)


def _restart_kubelet(node: NodeUnderTest) -> None:
    """SIGTERM, the same flags and state; back once the agent has registered every plugin again."""
    before = node.agent_log().splitlines()
    serving: dict[str, str] = {}  # per resource, the agent's last word on its plugin
    for event, resource in _plugin_events(before):
        serving[resource] = event
    plugins = {r for r, event in serving.items() if event == "plugin_registered"}
    node.node.restart_kubelet()

    def registered() -> set[str]:  # empty while the new kubelet cannot serve the log yet
        try:
            log = node.agent_log()
        except ApiError:
            return set()
        return {r for e, r in _plugin_events(log.splitlines()[len(before) :]) if e == "plugin_registered"}

    # A restarted kubelet deletes every plugin socket; only a new registration brings a resource back.
    # The agent's log, not the Node's allocatable, says which plugins it serves: the kubelet reports
    # a plugin's removal in the Node's status only at its next status update.
    poll("every plugin registered again after the restart", registered, lambda r: plugins <= r)


# The A100s in two 3g.20gb: a 1g.5gb slice a pod holds cannot stay. Only resources the all-kinds
# config has too (the Node keeps a 0 for a resource that is gone, which later tests do not expect).
TWO_3G = """version: v1
migStrategy: mixed
gpus:
  - devices: {product: A100-SXM4-40GB}
    mig: {3g.20gb: 2}
  - devices: all
    mig: disabled
"""


def test_kubelet_restarts_while_a_change_waits_destroy_nothing_a_pod_holds(node: NodeUnderTest) -> None:
    """Tried as a user would: a held 1g.5gb was destroyed within 10 s of a kubelet restart while its
    pod kept running (a starting kubelet's PodResources List is short until it knows its pods)."""
    name = node.start_pod("nvidia.com/mig-1g.5gb")
    pod = node.wait_running(name)
    container = pod["status"]["containerStatuses"][0]["containerID"]
    held = node.env(name)[VISIBLE]
    node.patch_configs({"two-3g": TWO_3G})
    try:
        node.label(CONFIG_LABEL, "two-3g")
        poll(
            "the change waiting for the pod",
            lambda: node.events("ConfigApplyBlocked"),
            lambda messages: any(f"default/{name}" in m for m in messages),
            90,
        )
        for _ in range(3):
            _restart_kubelet(node)
            assert held in _mig_uuids(node)
            _still_holding(node, name, container, held)
        node.delete_pods()
        poll(
            "the change applied once the pod has gone",
            node.offered,
            lambda a: a == {"nvidia.com/mig-3g.20gb": "4", "nvidia.com/gpu": "2"},
            90,
        )
        assert held not in _mig_uuids(node)
    finally:
        node.delete_pods()
        node.label(CONFIG_LABEL, CONFIG)
        node.patch_configs({"two-3g": None})
        node.wait_allocatable()


def _mig_uuids(node: NodeUnderTest) -> set[str]:
    return {i["uuid"] for g in node.export()["gpus"] for i in g["instances"]}


def test_a_deleted_agent_pod_is_recreated_and_running_pods_keep_their_devices(node: NodeUnderTest) -> None:
    name, container, visible = _holding_pod(node)
    (old,) = node.agent_pods()
    node.delete("pod", old["metadata"]["name"], namespace=NAMESPACE, wait=False)
    new = node.running_agent(not_uid=old["metadata"]["uid"])
    assert old["metadata"]["name"] != new["metadata"]["name"]
    node.wait_allocatable()
    assert "plugin_registered" in node.agent_log()
    _still_holding(node, name, container, visible)


USER_EDIT = "version: v1\ngpus:\n  - devices: all\n    replicas: 3\n"


@pytest.fixture
def chart(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The user's own config `mine` in their ConfigMap; afterwards, the chart as the session
    installed it again (its values, the agent Running, every slice allocatable) and `mine` gone."""
    node.patch_configs({"mine": USER_EDIT})
    yield node
    node.delete_pods()
    before = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
    node.running_agent(not_uid=before[0]["metadata"]["uid"] if before else None)
    node.wait_allocatable()
    node.patch_configs({"mine": None})


def test_helm_upgrade_with_a_changed_value_keeps_the_users_configmap_edits(chart: NodeUnderTest) -> None:
    node = chart
    (old,) = node.agent_pods()
    revision = node.helm.status()["version"]
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, logFormat="json"))
    new = node.running_agent(not_uid=old["metadata"]["uid"])
    env = {e["name"]: e.get("value") for e in new["spec"]["containers"][0]["env"]}
    assert "json" == env["SHARING_LOG_FORMAT"]
    assert revision + 1 == node.helm.status()["version"]
    data = node.get("configmap", "gpu-sharing-config", "-n", NAMESPACE)["data"]
    assert USER_EDIT == data["mine"]
    assert ALL_KINDS == data[CONFIG]
    node.wait_allocatable()


def test_helm_uninstall_removes_the_agent_and_keeps_the_users_configmap(chart: NodeUnderTest) -> None:
    node = chart
    node.helm.uninstall()
    poll("the agent's pods gone", node.agent_pods, lambda pods: not pods)
    assert 1 == node.node.kubectl("-n", NAMESPACE, "get", "daemonset", RELEASE).returncode
    assert 1 == node.node.kubectl("-n", NAMESPACE, "get", "configmap", "gpu-sharing-presets").returncode
    data = node.get("configmap", "gpu-sharing-config", "-n", NAMESPACE)["data"]
    assert (USER_EDIT, ALL_KINDS) == (data["mine"], data[CONFIG])
