"""Every query of the chart's Grafana dashboard returns series from a scrape of the agent on the real
node, evaluated by Prometheus's own promtool over the series Prometheus would store from it
(tests/integration/test_monitoring.py: the ServiceMonitor's target labels, promtool's rule unit tests).

The node serves every kind of slice the dashboard shows: MIG devices of the A100s, replicas of a
time-sliced H100 and MPS clients of the other, with pods holding a MIG device and a replica, each
running a "GPU process" (its container's host PID in the fake driver's state, as
tests/node/test_usage.py does), and a process of no pod on the time-sliced GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import lab
import pytest
from lab.helm import NAMESPACE

from tests.integration.test_monitoring import ON, empty_dashboard_queries, helm_template
from tests.node.conftest import CONFIG, CONFIG_LABEL, HTTP_PORT, NodeUnderTest
from tests.node.test_mps import A100S
from tests.node.test_usage import Processes, held_by, host_pids
from tests.polling import poll

pytestmark = pytest.mark.node

SHARED = "nvidia.com/gpu.shared"
MONITORED = (
    "version: v1\nmigStrategy: mixed\nsharing:\n  renameByDefault: true\ngpus:\n"
    f"  - devices: [2]\n    mps: {{replicas: 2}}\n  - devices: [3]\n    replicas: 2\n{A100S}"
)
EXPECTED = {
    "nvidia.com/mig-1g.5gb": "4",
    "nvidia.com/mig-3g.20gb": "2",
    "nvidia.com/mig-2g.10gb.shared": "4",
    SHARED: "4",
}


@pytest.fixture
def monitored(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The node on config `monitored`: MIG on the A100s, GPU 2 shared by MPS, GPU 3 time-sliced."""
    node.patch_configs({"monitored": MONITORED})
    try:
        node.label(CONFIG_LABEL, "monitored")
        node.wait_allocatable(EXPECTED, timeout=120)
        yield node
    finally:
        node.delete_pods()
        node.label(CONFIG_LABEL, CONFIG)
        node.wait_allocatable(timeout=120)
        node.patch_configs({"monitored": None})


def test_every_dashboard_query_returns_series_from_the_agents_scrape(
    monitored: NodeUnderTest, cluster_binaries: lab.Binaries, tmp_path: Path
) -> None:
    node = monitored
    mig, shared = node.start_pod("nvidia.com/mig-1g.5gb"), node.start_pod(SHARED)
    pods = {name: node.wait_running(name) for name in (mig, shared)}
    document = node.status()
    on_mig, on_replica = held_by(document, mig), held_by(document, shared)
    processes = Processes(node.node.gpus_state)
    try:
        (pid_mig,), (pid_shared,) = host_pids(node, pods[mig]), host_pids(node, pods[shared])
        processes.run(on_mig["device"], pid_mig, 1024, 0)
        processes.run(on_replica["device"], pid_shared, 2048, 30)
        processes.run(on_replica["device"], 1, 256, 5)  # the host's init: a process of no pod
        (agent,) = node.agent_pods()
        url = f"http://{agent['status']['podIP']}:{HTTP_PORT}/metrics"

        def scrape() -> str:  # from a pod on the pod network, as Prometheus scrapes it
            return node.kubectl("exec", shared, "--", "wget", "-qO-", url)

        wanted = (
            "gpu_sharing_slice_sm_active_ratio{",
            "gpu_sharing_slice_rightsize_info{",
            "gpu_sharing_unattributed_memory_used_bytes{",
            "gpu_sharing_mps_daemon_healthy{",
        )
        text = poll("the usage series in /metrics", scrape, lambda t: all(w in t for w in wanted), 90)
    finally:
        for uuid, pid in list(processes.started):
            processes.end(uuid, pid)
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in helm_template(cluster_binaries, *ON)}
    assert [] == empty_dashboard_queries(cluster_binaries, rendered, text, tmp_path), json.dumps(
        {"agent": f"{NAMESPACE}/{agent['metadata']['name']}"}
    )
