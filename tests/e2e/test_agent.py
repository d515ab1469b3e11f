"""The whole agent on a real control plane and the kubelet's own device manager, as an operator uses it.

The agent runs as a process with the ServiceAccount token of deploy/ (TokenRequest), so the RBAC there
is proven sufficient. GPUs are the fake NVIDIA driver's (hack/fakedriver), reached through the real pynvml.
Waits are for conditions (the harness's long-poll, or the API with a deadline), never fixed sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.conftest import CONFIGMAP, NAMESPACE, GpuNode
from tests.polling import poll

pytestmark = pytest.mark.integration

DEMO = "a100-mig-h100-time-sliced"


def mig_and_shared(resources: dict[str, Any]) -> bool:
    return (
        resources.get("nvidia.com/mig-1g.5gb", {}).get("allocatable") == 4
        and resources.get("nvidia.com/mig-2g.10gb", {}).get("allocatable") == 2
        and resources.get("nvidia.com/mig-3g.20gb", {}).get("allocatable") == 2
        and resources.get("nvidia.com/gpu", {}).get("allocatable") == 8
    )


def capacity(name: str, count: int) -> Callable[[dict[str, Any]], bool]:
    return lambda resources: resources.get(name, {}).get("capacity") == count


def allocatable(name: str, count: int) -> Callable[[dict[str, Any]], bool]:
    """The kubelet offers `count` healthy devices of `name`: what an admission of them needs."""
    return lambda resources: resources.get(name, {}).get("allocatable") == count


def test_label_change_carves_the_gpus_and_relabels_the_node(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    labels = gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "success")
    assert "4" == labels["nvidia.com/mig-1g.5gb.count"]
    assert "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb" == labels["nvidia.com/mig-3g.20gb.product"]
    assert "NVIDIA-H100-80GB-HBM3-SHARED" == labels["nvidia.com/gpu.product"]
    assert "4" == labels["nvidia.com/gpu.replicas"]
    # The kubelet copies the device manager's capacity into the Node, as `kubectl describe node` shows.
    status = gpu_node.wait_node(lambda n: n["status"]["capacity"].get("nvidia.com/mig-1g.5gb") == "4")
    assert "8" == status["status"]["allocatable"]["nvidia.com/gpu"]

    gpu_node.label("all-1g")
    gpu_node.kubelet.wait_resources(
        lambda r: capacity("nvidia.com/mig-1g.5gb", 14)(r) and capacity("nvidia.com/mig-1g.10gb", 14)(r),
        timeout=60,
    )
    labels = gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig-1g.10gb.count") == "14")
    assert "nvidia.com/mig-3g.20gb.count" not in labels
    # Every GPU has MIG on: as GFD does, gpu.* describes the physical GPUs (the first model), unshared.
    gpu = [labels[f"nvidia.com/gpu.{key}"] for key in ("product", "count", "replicas")]
    assert ["NVIDIA-A100-SXM4-40GB", "2", "0"] == gpu
    assert "success" == labels["nvidia.com/mig.config.state"]
    assert DEMO != labels["nvidia.com/device-plugin.config"]  # the user's label is never touched


def test_configmap_edit_is_applied_live(gpu_node: GpuNode) -> None:
    name = gpu_node.put_config("version: v1\ngpus:\n  - devices: all\n    replicas: 2\n")
    gpu_node.label(name)
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 8), timeout=60)
    gpu_node.put_config("version: v1\ngpus:\n  - devices: all\n    replicas: 3\n", name=name)
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 12), timeout=60)
    labels = gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/gpu.replicas") == "3")
    assert "success" == labels["nvidia.com/mig.config.state"]


def test_a_missing_config_fails_loudly_and_keeps_the_last_good_state(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    before = gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)["resources"]
    gpu_node.label("no-such-config")
    labels = gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "failed")
    assert "4" == labels["nvidia.com/mig-1g.5gb.count"]
    event = gpu_node.wait_event("ConfigRejected")
    assert "Warning" == event["type"]
    assert "config 'no-such-config'" in event["message"]
    assert "does not exist" in event["message"]
    assert before == gpu_node.kubelet.resources()["resources"]
    gpu_node.label(DEMO)
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "success")


def test_invalid_yaml_fails_with_the_path_and_recovers_when_fixed(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    name = gpu_node.put_config("version: v1\ngpus:\n  - devices: all\n    replicas: 0\n")
    gpu_node.label(name)
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "failed")
    event = gpu_node.wait_event("ConfigRejected")
    assert f"{name}: gpus[0].replicas" in event["message"]
    assert mig_and_shared(gpu_node.kubelet.resources()["resources"])
    gpu_node.put_config(
        "version: v1\ngpus:\n  - devices: all\n    mig: disabled\n    replicas: 2\n", name=name
    )
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 8), timeout=60)
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "success")


def test_mps_on_gpus_left_with_mig_on_is_refused_for_this_node_and_the_last_good_state_kept(
    gpu_node: GpuNode,
) -> None:
    """Valid on paper, impossible on this node (MPS shares whole GPUs): refused before anything changes."""
    gpu_node.label(DEMO)
    before = gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)["resources"]
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "success")
    name = gpu_node.put_config(
        "version: v1\ngpus:\n  - devices: {product: A100-SXM4-40GB}\n    mig: unchanged\n"
        "    mps: {replicas: 2}\n"
    )
    gpu_node.label(name)
    labels = gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "failed")
    event = gpu_node.wait_event("ConfigRejected")
    assert (
        f"{name}: gpus[0].mps: sharing using MPS is not supported for MIG devices: GPU 0 (A100-SXM4-40GB) "
        "has MIG enabled"
    ) in event["message"]
    assert before == gpu_node.kubelet.resources()["resources"]
    assert ("false", "4") == (labels["nvidia.com/mps.capable"], labels["nvidia.com/mig-1g.5gb.count"])


def test_a_hostile_key_beside_the_selected_config_is_named_and_the_agent_keeps_serving(
    gpu_node: GpuNode,
) -> None:
    """The demo node's crash loop: 480,000 list items (940 KB) in a key no node selects OOM-killed it."""
    name = gpu_node.put_config("version: v1\ngpus:\n  - devices: all\n    replicas: 2\n")
    gpu_node.label(name)
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 8), timeout=60)
    hostile = f"hostile-{name}"
    gpu_node.configs.append(hostile)  # removed again after the test
    patch = gpu_node.tmp / "hostile.json"  # too long for one command-line argument
    patch.write_text(
        json.dumps({"data": {hostile: "version: v1\ngpus: [" + ",".join(["0"] * 480_000) + "]\n"}})
    )
    gpu_node.kubectl(
        "patch", "configmap", CONFIGMAP, "-n", NAMESPACE, "--type=merge", "--patch-file", str(patch)
    )
    event = gpu_node.wait_event("ConfigInvalid")
    assert "Warning" == event["type"]
    assert f"{hostile}: 960020 bytes; the limit for one config is 262144 (256 KiB)" in event["message"]
    # Still serving, never restarted: the node's own config still changes the devices.
    gpu_node.put_config("version: v1\ngpus:\n  - devices: all\n    replicas: 3\n", name=name)
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 12), timeout=60)
    assert gpu_node.agent.process.poll() is None
    assert 200 == gpu_node.agent.get("/healthz")[0]


def test_a_slice_a_pod_holds_is_never_destroyed(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    pod = gpu_node.kubelet.admit("trainer", {"main": {"nvidia.com/mig-3g.20gb": 1}})
    (held,) = pod["containers"][0]["devices"]["nvidia.com/mig-3g.20gb"]
    # all-3g keeps a 3g.20gb on each A100: the held one stays where it is.
    gpu_node.label("all-3g")
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/mig-3g.20gb", 4), timeout=60)
    assert held in gpu_node.kubelet.resources()["resources"]["nvidia.com/mig-3g.20gb"]["healthy"]
    # all-1g has no room for it: the change waits, names the pod that blocks it, and the slice survives.
    gpu_node.label("all-1g")
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "failed")
    event = gpu_node.wait_event("ConfigApplyBlocked")
    assert "Warning" == event["type"]
    assert "held by pods default/trainer" in event["message"]
    assert "applied as soon as they are free" in event["message"]
    assert held in gpu_node.export_mig_uuids()
    # The pod ends: the change goes ahead by itself, long before the periodic resync.
    gpu_node.kubelet.delete_pod("trainer")
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "success", timeout=30)
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/mig-1g.5gb", 14), timeout=30)
    assert held not in gpu_node.export_mig_uuids()


def test_kubelet_restart_reregisters_everything(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.kubelet.restart()
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=10)


def test_api_server_restart_is_survived(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.control_plane.restart_apiserver()
    assert mig_and_shared(gpu_node.kubelet.resources()["resources"])  # the plugins kept serving
    gpu_node.label("all-replicas-2")
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 8), timeout=90)
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/gpu.replicas") == "2", timeout=60)


def test_agent_crash_mid_apply_converges_after_restart(gpu_node: GpuNode) -> None:
    gpu_node.agent.stop()
    crashing = gpu_node.start_agent(crash_after=5)
    gpu_node.label(DEMO)
    assert 137 == crashing.wait(timeout=60)
    gpu_node.start_agent()
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "success")
    exported = json.loads(gpu_node.sharing("export", "--driver-root", str(gpu_node.root), "--json"))
    for gpu in exported["gpus"][:2]:
        assert ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"] == sorted(i["profile"] for i in gpu["instances"])


def test_an_xid_marks_a_gpu_and_its_replicas_unhealthy_until_it_is_reset(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    exported = json.loads(gpu_node.sharing("export", "--driver-root", str(gpu_node.root), "--json"))
    h100s = [g["uuid"] for g in exported["gpus"] if "H100" in g["product"]]
    sim = ("--sim-state", str(gpu_node.sim))
    gpu_node.sharing("sim", "xid", *sim, "--uuid", h100s[0], "--xid", "13")  # an application error: ignored
    gpu_node.sharing("sim", "xid", *sim, "--uuid", h100s[1], "--xid", "79")  # fallen off the bus
    resources = gpu_node.kubelet.wait_resources(
        lambda r: r["nvidia.com/gpu"]["allocatable"] == 4 and r["nvidia.com/gpu"]["capacity"] == 8, timeout=30
    )["resources"]
    assert {f"{h100s[0]}::{n}" for n in range(4)} == set(resources["nvidia.com/gpu"]["healthy"])
    event = gpu_node.wait_event("GpuUnhealthy")
    index = next(g["index"] for g in exported["gpus"] if g["uuid"] == h100s[1])
    assert (
        f"GPU {index} (NVIDIA H100 80GB HBM3) reported XID 79 (GPU has fallen off the bus)"
        in event["message"]
    )
    gpu_node.sharing("sim", "reset", *sim, "--uuid", h100s[1])
    gpu_node.kubelet.wait_resources(lambda r: r["nvidia.com/gpu"]["allocatable"] == 8, timeout=30)
    assert "is healthy again" in gpu_node.wait_event("GpuHealthy")["message"]


def test_an_xid_during_an_api_server_outage_is_recorded_once_the_server_is_back(gpu_node: GpuNode) -> None:
    """Its devices turned unhealthy at once, as they should, but the `GpuUnhealthy` Event was dropped
    with the request that failed (`event_not_recorded`) and never tried again."""
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    exported = json.loads(gpu_node.sharing("export", "--driver-root", str(gpu_node.root), "--json"))
    h100 = next(g for g in exported["gpus"] if "H100" in g["product"])
    sim = ("--sim-state", str(gpu_node.sim))
    with gpu_node.control_plane.outage():
        gpu_node.sharing("sim", "xid", *sim, "--uuid", h100["uuid"], "--xid", "79")
        gpu_node.kubelet.wait_resources(lambda r: r["nvidia.com/gpu"]["allocatable"] == 4, timeout=30)
        poll(
            "the agent to find the API server down when it records the Event",
            gpu_node.agent.log.read_text,
            lambda log: '"event_deferred"' in log,
            timeout=30,
        )
    event = gpu_node.wait_event("GpuUnhealthy")
    assert f"GPU {h100['index']} (NVIDIA H100 80GB HBM3) reported XID 79" in event["message"]


def test_a_restart_without_the_api_server_serves_the_last_applied_config(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.agent.stop()
    gpu_node.kubelet.wait_resources(lambda r: r["nvidia.com/gpu"]["allocatable"] == 0, timeout=30)
    unreachable = gpu_node.tmp / "unreachable.kubeconfig"
    unreachable.write_text(
        gpu_node.kubeconfig.read_text().replace(gpu_node.control_plane.server, "https://127.0.0.1:9")
    )
    gpu_node.start_agent(kubeconfig=unreachable)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=30)
