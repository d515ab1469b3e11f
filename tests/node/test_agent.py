"""What the agent itself offers on the real node: `sharing status` inside its pod, and probes the
kubelet acts on (its CDI injection through containerd: tests/node/test_cdi.py).

A test that changes the chart's values puts them back.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from lab.helm import NAMESPACE, RELEASE, lab_values

from tests.node.conftest import ALL_KINDS, CONFIG, HTTP_PORT, NodeUnderTest, container_status
from tests.polling import poll

pytestmark = pytest.mark.node


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
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "agent")
    assert "/readyz" == container["readinessProbe"]["httpGet"]["path"]
    assert "/healthz" == container["livenessProbe"]["httpGet"]["path"]
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    assert "True" == ready["status"]
    assert 0 == container_status(pod, "agent")["restartCount"]  # liveness never failed
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
        text = node.kubectl("exec", scraper, "--", "wget", "-qO-", f"http://{address}:{HTTP_PORT}/metrics")
        assert 'gpu_sharing_slices_advertised{resource="nvidia.com/mig-1g.5gb"} 4.0' in text
        assert 'gpu_sharing_config_state{state="success"} 1.0' in text
    finally:
        node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
    assert 1 == node.node.kubectl("get", "service", "gpu-sharing-metrics", "-n", NAMESPACE).returncode
