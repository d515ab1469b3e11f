"""The test infrastructure itself: real control plane, kubelet harness, stub device plugin."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import lab
import pytest

from tests.polling import poll

pytestmark = pytest.mark.integration

DEV = "example.com/dev"


def kubectl_json(cp: lab.ControlPlane, *args: str) -> Any:
    r = cp.kubectl(*args, "-o", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def node_or_none(cp: lab.ControlPlane, name: str) -> Any:
    r = cp.kubectl("get", "node", name, "-o", "json")
    return json.loads(r.stdout) if r.returncode == 0 else None


def dev(resources: dict[str, Any]) -> dict[str, Any]:
    return resources.get(DEV, {})


def node_counts(cp: lab.ControlPlane, node: str | None) -> tuple[str, str] | None:
    """(capacity, allocatable) of DEV in the Node's status, as strings."""
    n = node_or_none(cp, node or "")
    if not n:
        return None
    return n["status"].get("capacity", {}).get(DEV), n["status"].get("allocatable", {}).get(DEV)


# ---- control plane ------------------------------------------------------------------------


def test_kubectl_talks_to_the_control_plane(control_plane: lab.ControlPlane) -> None:
    ns = kubectl_json(control_plane, "get", "ns", "default")
    assert ns["metadata"]["name"] == "default"
    version = kubectl_json(control_plane, "version")
    assert version["serverVersion"]["gitVersion"] == lab.kubernetes_version()
    assert control_plane.server.startswith("https://127.0.0.1:")


def test_rbac_applies_to_service_account_tokens(control_plane: lab.ControlPlane) -> None:
    cp = control_plane
    ns = f"rbac-{uuid.uuid4().hex[:6]}"
    for args in (("create", "namespace", ns), ("-n", ns, "create", "serviceaccount", "reader")):
        r = cp.kubectl(*args)
        assert r.returncode == 0, r.stderr
    # TokenRequest API (needs the service-account signing key flags).
    r = cp.kubectl("-n", ns, "create", "token", "reader")
    assert r.returncode == 0, r.stderr
    reader = cp.token_kubeconfig(r.stdout.strip(), "reader")

    denied = cp.kubectl("-n", ns, "get", "secrets", kubeconfig=reader)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr
    assert f"system:serviceaccount:{ns}:reader" in denied.stderr

    for args in (
        ("-n", ns, "create", "role", "secret-reader", "--verb=list", "--resource=secrets"),
        (
            "-n",
            ns,
            "create",
            "rolebinding",
            "reader",
            "--role=secret-reader",
            f"--serviceaccount={ns}:reader",
        ),
    ):
        r = cp.kubectl(*args)
        assert r.returncode == 0, r.stderr
    # The RBAC authorizer reads bindings from an informer: allow it a moment.
    poll(
        "the RoleBinding to take effect",
        lambda: cp.kubectl("-n", ns, "get", "secrets", kubeconfig=reader).returncode == 0,
        bool,
        10,
    )


def test_apiserver_restart_keeps_data(control_plane: lab.ControlPlane) -> None:
    cp = control_plane
    name = f"survivor-{uuid.uuid4().hex[:6]}"
    r = cp.kubectl("create", "configmap", name, "--from-literal=key=value")
    assert r.returncode == 0, r.stderr
    server = cp.server
    cp.restart_apiserver()
    assert cp.server == server
    cm = kubectl_json(cp, "get", "configmap", name)
    assert cm["data"] == {"key": "value"}


# ---- kubelet harness ------------------------------------------------------------------------


def test_harness_starts_with_kubelet_socket(kubelet: lab.KubeletHarness) -> None:
    assert kubelet.healthy()
    assert kubelet.kubelet_socket.is_socket()
    assert kubelet.pod_resources_socket.is_socket()
    assert kubelet.resources() == {"resources": {}, "generation": 0}


def test_harness_registers_a_ready_node(control_plane: lab.ControlPlane, kubelet: lab.KubeletHarness) -> None:
    assert kubelet.node_name
    node = poll("the Node", lambda: node_or_none(control_plane, kubelet.node_name or ""), bool, 10)
    node = poll(
        "the Node status",
        lambda: (
            (n := node_or_none(control_plane, kubelet.node_name or ""))
            and n["status"].get("conditions")
            and n
        ),
        bool,
        10,
    )
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True"
    assert int(node["status"]["capacity"]["pods"]) == 110
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith(lab.kubernetes_version())


def test_device_capacity_reaches_node_status(
    control_plane: lab.ControlPlane,
    kubelet: lab.KubeletHarness,
    make_stub_plugin: Callable[..., lab.StubDevicePlugin],
) -> None:
    plugin = make_stub_plugin(kubelet.device_plugin_dir, DEV, ["Dev-1", "Dev-2", "Dev-3 Unhealthy"])
    reply = kubelet.wait_resources(lambda r: dev(r).get("capacity") == 3 and dev(r).get("allocatable") == 2)
    assert dev(reply["resources"])["healthy"] == ["Dev-1", "Dev-2"]

    def node_has(capacity: str, allocatable: str) -> bool:
        return node_counts(control_plane, kubelet.node_name) == (capacity, allocatable)

    poll("Node capacity 3 / allocatable 2", lambda: node_has("3", "2"), bool, 10)

    plugin.set_devices(["Dev-1"])
    kubelet.wait_resources(lambda r: dev(r).get("capacity") == 1 and dev(r).get("allocatable") == 1)
    poll("Node capacity 1 / allocatable 1", lambda: node_has("1", "1"), bool, 10)

    # Plugin gone: the kubelet keeps capacity (grace period) and drops allocatable to 0.
    plugin.stop()
    kubelet.wait_resources(lambda r: dev(r).get("capacity") == 1 and dev(r).get("allocatable") == 0)
    poll("Node allocatable 0 after the plugin stopped", lambda: node_has("1", "0"), bool, 10)


def test_admission_drives_preferred_allocation_and_allocate(
    kubelet: lab.KubeletHarness, make_stub_plugin: Callable[..., lab.StubDevicePlugin]
) -> None:
    make_stub_plugin(kubelet.device_plugin_dir, DEV, ["Dev-1", "Dev-2", "Dev-3", "Dev-4"], preferred=True)
    kubelet.wait_resources(lambda r: dev(r).get("allocatable") == 4)

    pod = kubelet.admit("p1", {"c": {DEV: 2}})
    (c,) = pod["containers"]
    # The stub prefers the highest IDs, so these came through GetPreferredAllocation.
    assert c["devices"] == {DEV: ["Dev-3", "Dev-4"]}
    assert sorted(c["envs"]["STUB_VISIBLE_DEVICES"].split(",")) == ["Dev-3", "Dev-4"]
    assert sorted(c["cdiDevices"]) == [f"{DEV}=Dev-3", f"{DEV}=Dev-4"]

    with pytest.raises(lab.AdmissionError) as rejected:
        kubelet.admit("p2", {"c": {DEV: 3}})
    assert rejected.value.reason == "UnexpectedAdmissionError"
    assert "requested number of devices unavailable" in rejected.value.error

    kubelet.delete_pod("p1")
    pod2 = kubelet.admit("p2", {"c": {DEV: 3}})
    assert len(pod2["containers"][0]["devices"][DEV]) == 3


def test_kubelet_restart_makes_plugins_register_again(
    kubelet: lab.KubeletHarness, make_stub_plugin: Callable[..., lab.StubDevicePlugin]
) -> None:
    make_stub_plugin(kubelet.device_plugin_dir, DEV, ["Dev-1", "Dev-2"])
    kubelet.wait_resources(lambda r: dev(r).get("allocatable") == 2)
    pod = kubelet.admit("keeper", {"c": {DEV: 1}})
    held = pod["containers"][0]["devices"][DEV]
    assert kubelet.checkpoint.is_file()
    (old_plugin_sock,) = kubelet.device_plugin_dir.glob("stub-*.sock")

    kubelet.restart()
    # The new device manager deleted the plugin's socket; the stub sees the new kubelet.sock and
    # registers again on a fresh socket. Until then the resource is known (from the checkpoint)
    # but empty.
    kubelet.wait_resources(lambda r: dev(r).get("allocatable") == 2, timeout=30)
    assert not old_plugin_sock.exists()
    assert len(list(kubelet.device_plugin_dir.glob("stub-*.sock"))) == 1
    (kept,) = kubelet.pods()
    assert kept["containers"][0]["devices"][DEV] == held  # restored from the checkpoint


def test_pod_resources_lists_admitted_devices(
    kubelet: lab.KubeletHarness, make_stub_plugin: Callable[..., lab.StubDevicePlugin]
) -> None:
    grpc = pytest.importorskip("grpc")
    make_stub_plugin(kubelet.device_plugin_dir, DEV, ["Dev-1", "Dev-2"])
    kubelet.wait_resources(lambda r: dev(r).get("allocatable") == 2)
    kubelet.admit("listed", {"c": {DEV: 1}})

    # No generated stubs needed: an empty request is zero bytes; the reply's strings are visible
    # in the raw protobuf encoding.
    def call(ch: Any, method: str) -> bytes:
        rpc = ch.unary_unary(
            f"/v1.PodResourcesLister/{method}",
            request_serializer=lambda _: b"",
            response_deserializer=lambda b: b,
        )
        return bytes(rpc(None, timeout=10))

    with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as ch:
        raw = call(ch, "List")
        alloc = call(ch, "GetAllocatableResources")
    assert b"listed" in raw
    assert DEV.encode() in raw
    assert b"Dev-1" in alloc
    assert b"Dev-2" in alloc


def test_node_status_sync_survives_apiserver_restart(
    control_plane: lab.ControlPlane,
    kubelet: lab.KubeletHarness,
    make_stub_plugin: Callable[..., lab.StubDevicePlugin],
) -> None:
    plugin = make_stub_plugin(kubelet.device_plugin_dir, DEV, ["Dev-1"])
    poll("Node count 1", lambda: node_counts(control_plane, kubelet.node_name) == ("1", "1"), bool, 10)
    control_plane.restart_apiserver()
    plugin.set_devices(["Dev-1", "Dev-2"])
    poll("Node count 2", lambda: node_counts(control_plane, kubelet.node_name) == ("2", "2"), bool, 15)


def test_failed_start_reports_the_log_tail(cluster_binaries: lab.Binaries) -> None:
    cp = lab.ControlPlane(bins=cluster_binaries, extra_apiserver_args=["--no-such-flag"])
    with pytest.raises(lab.ClusterError) as failed:
        cp.start()
    message = str(failed.value)
    assert "kube-apiserver exited" in message
    assert "unknown flag: --no-such-flag" in message
    assert cp.pids == {}  # etcd was stopped too
