"""What the agent itself offers on the real node: CDI injection through containerd, `sharing status`
inside its pod, and probes the kubelet acts on.

A test that changes the chart's values puts them back.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from lab.helm import NAMESPACE, RELEASE, lab_values

from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from tests.node.conftest import ALL_KINDS, CONFIG, NodeUnderTest
from tests.polling import poll

pytestmark = pytest.mark.node

KIND = "k8s.gpu-sharing.io/gpu"


@pytest.fixture
def cdi(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The chart upgraded to hand devices out by CDI names only (cdi-cri); put back afterwards."""
    (old,) = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, deviceListStrategy="cdi-cri"))
    node.running_agent(not_uid=old["metadata"]["uid"])
    node.wait_allocatable()
    yield node
    node.delete_pods()
    (old,) = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
    node.running_agent(not_uid=old["metadata"]["uid"])
    node.wait_allocatable()


def _cdi_devices(node: NodeUnderTest, pod_uid: str, resource: str) -> tuple[list[str], list[str]]:
    """(device IDs, CDI names) the kubelet recorded from Allocate, read from its checkpoint."""
    path = node.node.state / "kubelet" / "device-plugins" / "kubelet_internal_checkpoint"
    for entry in json.loads(path.read_text())["Data"]["PodDeviceEntries"]:
        if entry["PodUID"] == pod_uid and entry["ResourceName"] == resource:
            response = api.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
            ids = [i for numa in entry["DeviceIDs"].values() for i in numa]
            return ids, [d.name for d in response.cdi_devices]
    raise AssertionError(f"no checkpoint entry for {pod_uid} and {resource}")


def test_containerd_injects_the_agents_cdi_spec_into_a_pod(cdi: NodeUnderTest) -> None:
    name = cdi.start_pod("nvidia.com/mig-1g.5gb")
    pod = cdi.wait_running(name)
    (device,), names = _cdi_devices(cdi, pod["metadata"]["uid"], "nvidia.com/mig-1g.5gb")
    assert [f"{KIND}={device}"] == names
    env = cdi.env(name)
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # all strategies are CDI: no variable, as NVIDIA's plugin
    suffix = re.sub("[^A-Za-z0-9]", "_", device).upper()
    assert device == env[f"GPU_SHARING_DEVICE_{suffix}"]
    gpu = next(g for g in cdi.export()["gpus"] if any(i["uuid"] == device for i in g["instances"]))
    # The GPU's device node and the MIG device's two capability nodes, as /dev/null stand-ins.
    nodes = cdi.kubectl("exec", name, "--", "sh", "-c", "ls /dev/nvidia* /dev/nvidia-caps/").split()
    assert f"/dev/nvidia{gpu['index']}" in nodes
    caps = {n for n in nodes if n.startswith("nvidia-cap")}
    assert 2 == len(caps)
    seen = cdi.kubectl("exec", name, "--", "stat", "-c", "%F %t:%T", f"/dev/nvidia{gpu['index']}").strip()
    assert "character special file 1:3" == seen
    # The spec lists every advertised device and nothing else.
    status = json.loads(
        cdi.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "status", "--json")
    )
    advertised = {s["device"] for g in status["gpus"] for s in g["slices"]}
    spec = json.loads(
        cdi.kubectl(
            "-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "cat", "/var/run/cdi/k8s.gpu-sharing.io-gpu.json"
        )
    )
    assert advertised == {d["name"] for d in spec["devices"]}


def test_sharing_status_in_the_agents_pod_names_the_pod_holding_a_slice(node: NodeUnderTest) -> None:
    name = node.start_pod("nvidia.com/mig-3g.20gb")
    pod = node.wait_running(name)
    ids, _ = node.allocation(pod, "nvidia.com/mig-3g.20gb")

    def read_status() -> dict[str, Any]:
        out = node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "status", "--json")
        return dict(json.loads(out))

    def holders(status: dict[str, Any]) -> dict[str, Any]:
        slices = [s for g in status["gpus"] for s in g["slices"]]
        return {s["id"]: s["pod"] for s in slices if s["pod"] and s["pod"]["pod"] == name}

    # The agent reads who holds what at most once a second: a status asked for just before the pod
    # started (by another test, say) is answered again for up to a second.
    status = poll("the pod in `sharing status`", read_status, lambda s: bool(holders(s)), timeout=30)
    assert {ids[0]: {"namespace": "default", "pod": name, "container": "main"}} == holders(status)
    assert (CONFIG, "success") == (status["config"]["selected"], status["config"]["state"])
    table = node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "status")
    assert f"default/{name}/main" in table


def test_the_agents_pod_is_ready_by_its_readiness_probe(node: NodeUnderTest) -> None:
    (pod,) = node.agent_pods()
    container = pod["spec"]["containers"][0]
    assert "/readyz" == container["readinessProbe"]["httpGet"]["path"]
    assert "/healthz" == container["livenessProbe"]["httpGet"]["path"]
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    assert "True" == ready["status"]
    assert 0 == pod["status"]["containerStatuses"][0]["restartCount"]  # liveness never failed
    metrics = node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "status", "--json")
    assert json.loads(metrics)["holders"]["known"]  # the agent reads the real kubelet's PodResources


def test_prometheus_scrapes_the_agents_through_the_metrics_service(node: NodeUnderTest) -> None:
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, metrics={"service": {"enabled": True}}))
    try:
        service = node.get("service", "gpu-sharing-metrics", "-n", NAMESPACE)
        assert [("metrics", "metrics")] == [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]]
        slices = node.get(
            "endpointslices", "-n", NAMESPACE, "-l", "kubernetes.io/service-name=gpu-sharing-metrics"
        )
        (address,) = [a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]]
        scraper = node.start_pod("nvidia.com/gpu")  # any pod on the pod network can scrape
        node.wait_running(scraper)
        text = node.kubectl("exec", scraper, "--", "wget", "-qO-", f"http://{address}:9402/metrics")
        assert 'gpu_sharing_slices_advertised{resource="nvidia.com/mig-1g.5gb"} 4.0' in text
        assert 'gpu_sharing_config_state{state="success"} 1.0' in text
    finally:
        node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
    assert 1 == node.node.kubectl("get", "service", "gpu-sharing-metrics", "-n", NAMESPACE).returncode
