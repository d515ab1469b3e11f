"""What the slices are doing, on the real node: each pod time-sharing a GPU gets its own figures.

The fake driver stands in for CUDA: a test writes into its state (`sharing sim busy`'s format) a
process with the host PID of a pod's container, found from the host as the kubelet made it (the
node's cgroups: cgroup v1, the cgroupfs driver under the kubelet's cgroupRoot `/<node's cgroup
tree>`, the layout `<root>/kubepods/besteffort/pod<uid>/<container id>`), with the memory and SM
share it "uses". The agent, installed by its chart, reads that through NVML, finds the process's
pod in the host's /proc (mounted into its pod read-only, no hostPID) and shows it per slice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab.cgroups import ROOT
from lab.helm import NAMESPACE, RELEASE
from prometheus_client.parser import text_string_to_metric_families

from sharing.gpu import simstate
from tests.node.conftest import NodeUnderTest, container_status
from tests.polling import poll

pytestmark = pytest.mark.node

MIB = 1 << 20
SHARED = "nvidia.com/gpu.shared"


def host_pids(node: NodeUnderTest, pod: dict[str, Any]) -> list[int]:
    """The host PIDs of the pod's container `main`, from its cgroup on the node."""
    uid = pod["metadata"]["uid"]
    container = container_status(pod, "main")["containerID"].rpartition("://")[2]
    tree = ROOT / "pids" / node.node.cgroup.name
    (cgroup,) = tree.rglob(f"pod{uid}/{container}")
    return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]


def status(node: NodeUnderTest) -> dict[str, Any]:
    out = node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "status", "--json")
    return dict(json.loads(out))


def gpu_of(document: dict[str, Any], uuid: str) -> dict[str, Any]:
    return dict(next(g for g in document["gpus"] if g["uuid"] == uuid))


def held_by(document: dict[str, Any], pod: str) -> dict[str, Any]:
    (entry,) = [s for g in document["gpus"] for s in g["slices"] if s["pod"] and s["pod"]["pod"] == pod]
    return dict(entry)


class Processes:
    """The processes a test runs on the fake driver's devices (ended after it)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.started: list[tuple[str, int]] = []

    def run(self, uuid: str, pid: int, mib: int, sm: int) -> None:
        simstate.start_process(self.state, uuid, pid, used_mib=mib, sm=sm)
        self.started.append((uuid, pid))


@pytest.fixture
def processes(node: NodeUnderTest) -> Iterator[Processes]:
    running = Processes(node.node.gpus_state)
    yield running
    for uuid, pid in running.started:
        simstate.stop_processes(running.state, uuid, pid)


def two_pods_sharing_a_gpu(node: NodeUnderTest) -> tuple[str, str, dict[str, Any], dict[str, Any], str]:
    """Two pods on replicas of the time-sliced H100 (GPU 3): their names, pods, and the GPU's UUID."""
    first, second = node.start_pod(SHARED), node.start_pod(SHARED)
    a, b = node.wait_running(first), node.wait_running(second)
    gpus = {held_by(status(node), name)["device"].partition("::")[0] for name in (first, second)}
    (gpu,) = gpus  # GPU 3 is the only time-sliced one
    return first, second, a, b, gpu


def test_two_pods_time_sharing_a_gpu_each_get_their_own_use_and_the_gpu_their_sum(
    node: NodeUnderTest, processes: Processes
) -> None:
    first, second, a, b, gpu = two_pods_sharing_a_gpu(node)
    (pid_a,), (pid_b,) = host_pids(node, a), host_pids(node, b)
    processes.run(gpu, pid_a, 3000, 60)
    processes.run(gpu, pid_b, 1000, 20)

    def both_seen(document: dict[str, Any]) -> bool:
        uses = [held_by(document, name)["usage"] for name in (first, second)]
        return all(u and u["pids"] for u in uses)

    document = poll("both pods' processes in `sharing status`", lambda: status(node), both_seen, timeout=60)
    use_a, use_b = (held_by(document, name)["usage"] for name in (first, second))
    assert ([pid_a], 3000 * MIB, 0.6) == (use_a["pids"], use_a["memoryUsedBytes"], use_a["smActive"])
    assert ([pid_b], 1000 * MIB, 0.2) == (use_b["pids"], use_b["memoryUsedBytes"], use_b["smActive"])
    assert (0.0, 0.0) == (use_a["idleSeconds"], use_b["idleSeconds"])
    # Never the GPU's figure copied: the GPU's is their sum, and nothing is left unattributed.
    total = gpu_of(document, gpu)["usage"]
    assert total["memoryUsedBytes"] == use_a["memoryUsedBytes"] + use_b["memoryUsedBytes"]
    assert [] == total["unattributed"]
    assert total["utilization"] == pytest.approx(use_a["smActive"] + use_b["smActive"])
    assert use_a["memoryTotalBytes"] == use_b["memoryTotalBytes"] == total["memoryTotalBytes"]
    table = node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "status", "--usage")
    line = next(line for line in table.splitlines() if f"default/{first}/main" in line)
    row = [cell.strip() for cell in line.split("  ") if cell.strip()]
    assert ["2.9 GiB of 79.6 GiB", "60 %", "in use"] == row[5:8]  # memory of its size, SM, idle for


def test_a_process_of_no_pod_is_counted_as_unattributed(node: NodeUnderTest, processes: Processes) -> None:
    first, _, a, _, gpu = two_pods_sharing_a_gpu(node)
    (pid_a,) = host_pids(node, a)
    host = os.getpid()  # this test's own process: a host process, in no pod's cgroup
    processes.run(gpu, pid_a, 2048, 30)
    processes.run(gpu, host, 512, 10)

    def unattributed(document: dict[str, Any]) -> list[dict[str, Any]]:
        return list(gpu_of(document, gpu)["usage"]["unattributed"])

    document = poll(
        "the host process, unattributed", lambda: status(node), lambda d: bool(unattributed(d)), 60
    )
    assert [{"device": gpu, "memoryUsedBytes": 512 * MIB, "pids": [host]}] == unattributed(document)
    use = held_by(document, first)["usage"]
    assert ([pid_a], 2048 * MIB) == (use["pids"], use["memoryUsedBytes"])  # its own, not the host's
    assert gpu_of(document, gpu)["usage"]["memoryUsedBytes"] == (2048 + 512) * MIB


def test_the_metrics_port_serves_each_slices_own_use(node: NodeUnderTest, processes: Processes) -> None:
    first, second, a, b, gpu = two_pods_sharing_a_gpu(node)
    (pid_a,), (pid_b,) = host_pids(node, a), host_pids(node, b)
    processes.run(gpu, pid_a, 4096, 45)
    processes.run(gpu, pid_b, 256, 5)
    (agent,) = node.agent_pods()
    address = agent["status"]["podIP"]

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample the agent's port `metrics` serves to a pod on the pod network."""
        text = node.kubectl("exec", second, "--", "wget", "-qO-", f"http://{address}:9402/metrics")
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    document = status(node)
    index = gpu_of(document, gpu)["index"]

    def held(name: str, pod: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        labels = {"container": "main", "device": held_by(document, pod)["id"], "namespace": "default",
                  "pod": pod, "resource": SHARED}  # fmt: skip
        return f"gpu_sharing_{name}", tuple(sorted(labels.items()))

    def of_gpu(name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return f"gpu_sharing_{name}", (("gpu", str(index)), ("uuid", gpu))

    want = held("slice_memory_used_bytes", first)
    metrics = poll("pod a's memory in /metrics", scrape, lambda m: m.get(want) == 4096 * MIB, timeout=60)
    assert 256 * MIB == metrics[held("slice_memory_used_bytes", second)]
    assert (0.45, 0.05) == (
        metrics[held("slice_sm_active_ratio", first)],
        metrics[held("slice_sm_active_ratio", second)],
    )
    assert (0.0, 0.0) == (
        metrics[held("slice_idle_seconds", first)],
        metrics[held("slice_idle_seconds", second)],
    )
    assert (4096 + 256) * MIB == metrics[of_gpu("gpu_memory_used_bytes")]
    assert 0.5 == metrics[of_gpu("gpu_utilization_ratio")]
    for name in ("gpu_power_watts", "gpu_temperature_celsius", "gpu_memory_total_bytes"):
        assert of_gpu(name) in metrics, name
    assert ("gpu_sharing_usage_last_sample_timestamp_seconds", ()) in metrics


def test_the_agent_reads_the_hosts_proc_read_only_and_not_the_hosts_pids(node: NodeUnderTest) -> None:
    (pod,) = node.agent_pods()
    assert not pod["spec"].get("hostPID")
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "agent")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/host/proc"]
    assert mount["readOnly"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert "/proc" == volume["hostPath"]["path"]
