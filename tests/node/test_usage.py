"""What the slices are doing, on the real node: each pod time-sharing a GPU gets its own figures, an
oversized slice its right size, an idle one its Event, and `sharing recommend` a config that converges.

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
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lab.cgroups import ROOT
from lab.helm import NAMESPACE, RELEASE, lab_values
from prometheus_client.parser import text_string_to_metric_families

from sharing.gpu import simstate
from tests.node.conftest import (
    ALL_KINDS,
    CONFIG,
    CONFIG_LABEL,
    HTTP_PORT,
    NODE,
    NodeUnderTest,
    container_status,
)
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

    def end(self, uuid: str, pid: int) -> None:
        """End one now (its device may be gone by the end of the test)."""
        simstate.stop_processes(self.state, uuid, pid)
        self.started.remove((uuid, pid))


@pytest.fixture
def processes(node: NodeUnderTest) -> Iterator[Processes]:
    running = Processes(node.node.gpus_state)
    yield running
    for uuid, pid in running.started:
        simstate.stop_processes(running.state, uuid, pid)


def scrape(node: NodeUnderTest, pod: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the agent's port `metrics` serves to `pod`, on the pod network."""
    (agent,) = node.agent_pods()
    address = agent["status"]["podIP"]
    text = node.kubectl("exec", pod, "--", "wget", "-qO-", f"http://{address}:{HTTP_PORT}/metrics")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def two_pods_sharing_a_gpu(node: NodeUnderTest) -> tuple[str, str, dict[str, Any], dict[str, Any], str]:
    """Two pods on replicas of the time-sliced H100 (GPU 3): their names, pods, and the GPU's UUID."""
    first, second = node.start_pod(SHARED), node.start_pod(SHARED)
    a, b = node.wait_running(first), node.wait_running(second)
    gpus = {held_by(node.status(), name)["device"].partition("::")[0] for name in (first, second)}
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

    document = poll("both pods' processes in `sharing status`", node.status, both_seen, timeout=60)
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

    document = poll("the host process, unattributed", node.status, lambda d: bool(unattributed(d)), 60)
    assert [{"device": gpu, "memoryUsedBytes": 512 * MIB, "pids": [host]}] == unattributed(document)
    use = held_by(document, first)["usage"]
    assert ([pid_a], 2048 * MIB) == (use["pids"], use["memoryUsedBytes"])  # its own, not the host's
    assert gpu_of(document, gpu)["usage"]["memoryUsedBytes"] == (2048 + 512) * MIB


def test_the_metrics_port_serves_each_slices_own_use(node: NodeUnderTest, processes: Processes) -> None:
    first, second, a, b, gpu = two_pods_sharing_a_gpu(node)
    (pid_a,), (pid_b,) = host_pids(node, a), host_pids(node, b)
    processes.run(gpu, pid_a, 4096, 45)
    processes.run(gpu, pid_b, 256, 5)
    document = node.status()
    index = gpu_of(document, gpu)["index"]

    def held(name: str, pod: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        labels = {"container": "main", "device": held_by(document, pod)["id"], "namespace": "default",
                  "pod": pod, "resource": SHARED}  # fmt: skip
        return f"gpu_sharing_{name}", tuple(sorted(labels.items()))

    def of_gpu(name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return f"gpu_sharing_{name}", (("gpu", str(index)), ("uuid", gpu))

    want = held("slice_memory_used_bytes", first)
    metrics = poll(
        "pod a's memory in /metrics", lambda: scrape(node, second), lambda m: m.get(want) == 4096 * MIB, 60
    )
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


def sized(name: str, peak: int) -> Any:
    """A predicate: the status shows pod `name`'s slice with a right size taken over a window that
    saw its process's `peak` bytes (a sample before the process started sizes the slice too, from
    nothing used)."""

    def ready(document: dict[str, Any]) -> bool:
        use = held_by(document, name)["usage"]
        size = use and use["rightSize"]
        return bool(size and size["profile"] and size["peakMemoryBytes"] >= peak)

    return ready


def test_a_pod_on_a_3g_20gb_using_2_gib_is_shown_as_fitting_a_1g_5gb(
    node: NodeUnderTest, processes: Processes
) -> None:
    name = node.start_pod("nvidia.com/mig-3g.20gb")
    (pid,) = host_pids(node, node.wait_running(name))
    mig = held_by(node.status(), name)["id"]
    processes.run(mig, pid, 2048, 0)
    document = poll("its right size in `sharing status`", node.status, sized(name, 2048 * MIB), timeout=60)
    # An A100 has no GPM: sized by memory alone, and said so.
    assert {"profile": "1g.5gb", "basis": "memory", "peakMemoryBytes": 2048 * MIB, "smActiveP95": None,
            "headroom": 0.1, "why": None} == held_by(document, name)["usage"]["rightSize"]  # fmt: skip
    labels = {"basis": "memory", "container": "main", "device": mig, "namespace": "default", "pod": name,
              "profile": "1g.5gb", "resource": "nvidia.com/mig-3g.20gb"}  # fmt: skip
    assert 1.0 == scrape(node, name)[("gpu_sharing_slice_rightsize_info", tuple(sorted(labels.items())))]
    table = node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "status", "--usage")
    line = next(line for line in table.splitlines() if f"default/{name}/main" in line)
    assert line.rstrip().endswith("2.0 GiB  -       1g.5gb (memory only)")


@pytest.fixture
def idling(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The chart with a short usage.idleAfter and idle Events on; afterwards the session's values."""
    (old,) = node.agent_pods()
    usage = {"intervalSeconds": 2, "idleAfter": "20s", "idleEvents": True}
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, usage=usage))
    new = node.running_agent(not_uid=old["metadata"]["uid"])
    node.wait_allocatable()
    yield node
    node.delete_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
    node.running_agent(not_uid=new["metadata"]["uid"])
    node.wait_allocatable()


def test_an_idle_held_slice_gets_its_slice_idle_event(idling: NodeUnderTest) -> None:
    node = idling
    name = node.start_pod("nvidia.com/mig-1g.5gb")
    node.wait_running(name)
    mig = held_by(node.status(), name)["id"]

    def mine(messages: list[str]) -> list[str]:
        return [m for m in messages if f"pod default/{name} " in m]

    (said,) = poll("its SliceIdle Event", lambda: mine(node.events("SliceIdle")), bool, timeout=90)
    slice_ = f"its slice {mig} (nvidia.com/mig-1g.5gb)"
    assert said.startswith(f"pod default/{name} (container main) has run no GPU process on {slice_}")
    assert "(usage.idleAfter 20s)" in said
    document = node.status()
    assert held_by(document, name)["usage"]["idle"]
    assert 20.0 == document["usage"]["idleAfterSeconds"]


# GPU 0 all 1g.5gb and GPU 1 two 3g.20gb: a pod on each sized down to a 1g.5gb, and free room to make.
SIZING = """version: v1
migStrategy: mixed
gpus:
  - devices: [0]
    mig: {1g.5gb: 7}
  - devices: [1]
    mig: {3g.20gb: 2}
  - devices: all
    mig: disabled
"""


@pytest.fixture
def sizing(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    node.patch_configs({"sizing": SIZING})
    node.label(CONFIG_LABEL, "sizing")
    want = {"nvidia.com/mig-1g.5gb": "7", "nvidia.com/mig-3g.20gb": "2", "nvidia.com/gpu": "2"}
    node.wait_allocatable(want)
    yield node
    node.delete_pods()
    node.label(CONFIG_LABEL, CONFIG)
    node.patch_configs({"sizing": None, "recommended": None})
    node.wait_allocatable()


def _profiles(document: dict[str, Any], index: int, held: bool) -> list[str]:
    gpu = next(g for g in document["gpus"] if g["index"] == index)
    return sorted(s["profile"] for s in gpu["slices"] if bool(s["pod"]) == held)


def test_sharing_recommends_a_config_that_converges_keeps_held_slices_and_frees_what_it_said(
    sizing: NodeUnderTest, processes: Processes, tmp_path: Path
) -> None:
    node = sizing
    small, big = node.start_pod("nvidia.com/mig-1g.5gb"), node.start_pod("nvidia.com/mig-3g.20gb")
    pods = {name: node.wait_running(name) for name in (small, big)}
    before = node.status()
    migs = {name: held_by(before, name)["id"] for name in (small, big)}
    for name in (small, big):
        (pid,) = host_pids(node, pods[name])
        processes.run(migs[name], pid, 2048, 0)
    poll(
        "both right sizes",
        node.status,
        lambda d: sized(small, 2048 * MIB)(d) and sized(big, 2048 * MIB)(d),
        timeout=60,
    )

    def recommend(*args: str) -> str:
        return node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "recommend", *args)

    advice = json.loads(recommend("--json"))
    text = recommend()
    gpus = {g["index"]: g for g in advice["gpus"]}
    # GPU 0: the small pod's 1g.5gb is its right size, kept, and its six free 1g.5gb stay as they are.
    assert (["1g.5gb"], ["1g.5gb"], [], {"computeSlices": 6, "memorySlices": 7}) == (
        gpus[0]["held"], gpus[0]["rightSized"], gpus[0]["changes"], gpus[0]["room"]
    )  # fmt: skip
    # GPU 1: the big pod's 3g.20gb holds 2 GiB: a 1g.5gb holds it, which frees 2 compute and 3 memory
    # slices, made into a 2g.10gb and a 1g.5gb beside the free 3g.20gb.
    (change,) = gpus[1]["changes"]
    assert {"holder": f"default/{big}/main", "device": migs[big], "profile": "3g.20gb", "to": "1g.5gb"} == {
        k: v for k, v in change.items() if k != "waits"
    }
    assert ({"computeSlices": 2, "memorySlices": 3}, ["2g.10gb", "1g.5gb"]) == (
        gpus[1]["frees"],
        gpus[1]["made"],
    )
    assert [False, False] == [gpus[2]["resized"], gpus[3]["resized"]]
    assert yaml.safe_load(text) == yaml.safe_load(advice["config"])
    assert f"#   default/{big}/main holds 3g.20gb {migs[big]}, right size 1g.5gb: " in text
    # Offline, on an export taken in the agent's pod: the same advice.
    exported = tmp_path / "export.json"
    exported.write_text(
        node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "sharing", "export", "--json")
    )
    offline = subprocess.run(
        [sys.executable, "-m", "sharing", "recommend", "--from", str(exported), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert advice == json.loads(offline.stdout)

    # Into the ConfigMap. Whether the agent can make GPU 1's layout around the big pod's 3g.20gb
    # depends on where that instance is (at slot 4 it is the new layout's 3g.20gb; at 0 it is in the
    # way): the rollout waits for the pod exactly where recommend said it would.
    node.patch_configs({"recommended": text})
    node.label(CONFIG_LABEL, "recommended")

    def settled(document: dict[str, Any]) -> bool:
        return document["config"]["state"] == "success" and document["config"]["inEffect"] == ["recommended"]

    if change["waits"]:
        poll("the change blocked by the big pod", lambda: node.events("ConfigApplyBlocked"),
             lambda m: any(f"default/{big}" in x for x in m), timeout=90)  # fmt: skip
    else:
        during = poll("the recommended config in effect beside the big pod", node.status, settled, 90)
        assert migs[big] == held_by(during, big)["id"]  # it keeps its slice while it runs
    processes.end(migs[big], host_pids(node, pods[big])[0])
    node.delete("pod", big, timeout=50)
    after = poll("the recommended config in effect", node.status, settled, timeout=90)
    # The small pod kept its slice: the same container, the same MIG device.
    assert migs[small] == held_by(after, small)["id"]
    now = node.pod(small)
    assert (
        container_status(now, "main")["containerID"] == container_status(pods[small], "main")["containerID"]
    )
    assert 0 == container_status(now, "main")["restartCount"]
    # What it said: on GPU 0 the held 1g.5gb and the free room; on GPU 1 the right size and the free room.
    assert (["1g.5gb"], sorted(gpus[0]["freeRoom"])) == (
        _profiles(after, 0, True),
        _profiles(after, 0, False),
    )
    assert sorted(gpus[1]["rightSized"] + gpus[1]["freeRoom"]) == _profiles(after, 1, False)
    assert "success" == node.get("node", NODE)["metadata"]["labels"]["nvidia.com/mig.config.state"]
