"""Operating the agent: who holds which slice, metrics, the Node's annotations, Events, probes, and
how devices reach containers (NVIDIA's device-list strategies, CDI), against a real kube-apiserver and
the kubelet's own device manager.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import GpuNode
from tests.e2e.test_agent import DEMO, capacity, mig_and_shared
from tests.polling import poll

pytestmark = pytest.mark.integration

CONFIG_NOTE = "nvidia.com/gpu-sharing.config"
LAYOUT_NOTE = "nvidia.com/gpu-sharing.layout"


def status(node: GpuNode, *args: str) -> dict[str, Any]:
    out = node.sharing("status", "--json", "--port", str(node.agent.port), *args)
    return dict(json.loads(out))


def held(document: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """{device ID: (namespace, pod, container)} from a status document."""
    return {
        s["id"]: (s["pod"]["namespace"], s["pod"]["pod"], s["pod"]["container"])
        for g in document["gpus"]
        for s in g["slices"]
        if s["pod"]
    }


def test_status_names_the_pods_holding_slices_as_the_kubelet_does(gpu_node: GpuNode) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    a = gpu_node.kubelet.admit("trainer", {"main": {"nvidia.com/mig-3g.20gb": 1}}, namespace="ml")
    b = gpu_node.kubelet.admit("notebook", {"lab": {"nvidia.com/gpu": 2}}, namespace="team-a")
    expected = {
        **dict.fromkeys(a["containers"][0]["devices"]["nvidia.com/mig-3g.20gb"], ("ml", "trainer", "main")),
        **dict.fromkeys(b["containers"][0]["devices"]["nvidia.com/gpu"], ("team-a", "notebook", "lab")),
    }
    # PodResources is the kubelet's own answer; the status must agree with it.
    from_kubelet = {
        i: (p["namespace"], p["name"], c["name"])
        for p in gpu_node.kubelet.pods()
        for c in p["containers"]
        for ids in c.get("devices", {}).values()
        for i in ids
    }
    assert expected == from_kubelet
    document = status(gpu_node)
    assert expected == held(document)
    assert "a100-mig-h100-time-sliced" == document["config"]["selected"]
    assert "success" == document["config"]["state"]
    assert "ConfigApplied" == document["lastChange"]["reason"]
    (trainer_slice,) = [
        s for g in document["gpus"] for s in g["slices"] if s["pod"] and s["pod"]["pod"] == "trainer"
    ]
    assert ("nvidia.com/mig-3g.20gb", "3g.20gb", "Healthy") == (
        trainer_slice["resource"], trainer_slice["profile"], trainer_slice["health"]
    )  # fmt: skip
    table = gpu_node.sharing("status", "--port", str(gpu_node.agent.port))
    assert "ml/trainer/main" in table
    assert "team-a/notebook/lab" in table
    # The metrics tell the same story.
    code, text = gpu_node.agent.get("/metrics")
    assert 200 == code
    families = {f.name: f for f in text_string_to_metric_families(text)}
    owners = {
        s.labels["device"]: (s.labels["namespace"], s.labels["pod"], s.labels["container"])
        for s in families["gpu_sharing_slice_owner_info"].samples
    }
    assert expected == owners
    allocated = {s.labels["resource"]: s.value for s in families["gpu_sharing_slices_allocated"].samples}
    assert {
        "nvidia.com/gpu": 2,
        "nvidia.com/mig-1g.5gb": 0,
        "nvidia.com/mig-2g.10gb": 0,
        "nvidia.com/mig-3g.20gb": 1,
    } == allocated
    advertised = {s.labels["resource"]: s.value for s in families["gpu_sharing_slices_advertised"].samples}
    assert {
        "nvidia.com/gpu": 8,
        "nvidia.com/mig-1g.5gb": 4,
        "nvidia.com/mig-2g.10gb": 2,
        "nvidia.com/mig-3g.20gb": 2,
    } == advertised
    state = {s.labels["state"]: s.value for s in families["gpu_sharing_config_state"].samples}
    assert {"pending": 0, "success": 1, "failed": 0} == state
    steps = sum(s.value for s in families["gpu_sharing_hardware_steps"].samples if s.name.endswith("_total"))
    assert steps >= 2 * 5  # each A100: enable MIG and 4 creations
    registered = {s.labels["resource"]: s.value for s in families["gpu_sharing_plugin_registered"].samples}
    assert set(registered.values()) == {1}


def test_the_node_says_what_is_in_effect_after_success_failure_and_a_blocked_change(
    gpu_node: GpuNode,
) -> None:
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    node = gpu_node.wait_node(lambda n: n["metadata"].get("annotations", {}).get(CONFIG_NOTE) == DEMO)
    layout = node["metadata"]["annotations"][LAYOUT_NOTE].splitlines()
    assert 4 == len(layout)
    assert re.match(r"GPU 0 NVIDIA A100-SXM4-40GB \[a100-mig-h100-time-sliced\]: MIG .*3g\.20gb@4", layout[0])
    assert layout[2].endswith("nvidia.com/gpu x4")
    # A config that does not exist: the Node still names the config in effect.
    gpu_node.label("no-such-config")
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "failed")
    assert DEMO == gpu_node.node()["metadata"]["annotations"][CONFIG_NOTE]
    gpu_node.wait_event("ConfigRejected")
    # A change a pod blocks: one Event naming the pod and saying it is retried; then applied.
    gpu_node.label(DEMO)
    gpu_node.wait_labels(lambda labels: labels.get("nvidia.com/mig.config.state") == "success")
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)  # what the admission needs
    gpu_node.kubelet.admit("holder", {"main": {"nvidia.com/mig-2g.10gb": 1}})
    gpu_node.label("all-1g")
    blocked = gpu_node.wait_event("ConfigApplyBlocked")
    assert "held by pods default/holder" in blocked["message"]
    assert "GPU 0 (NVIDIA A100-SXM4-40GB, GPU 0" not in blocked["message"]  # no duplicated prefixes
    assert len(blocked["message"]) <= 1024
    assert DEMO == gpu_node.node()["metadata"]["annotations"][CONFIG_NOTE]
    gpu_node.kubelet.delete_pod("holder")
    applied = poll(
        "the blocked change applied",
        lambda: [e for e in gpu_node.events("ConfigApplied") if "all-1g" in e["message"]],
        bool,
        60,
    )[-1]
    assert "'all-1g' applied" in applied["message"]
    gpu_node.wait_node(lambda n: n["metadata"]["annotations"].get(CONFIG_NOTE) == "all-1g")
    blocked_events = [e for e in gpu_node.events("ConfigApplyBlocked") if "all-1g" in e["message"]]
    assert 1 == len(blocked_events)  # said once, not on every re-check


def test_both_config_labels_set_and_different_say_which_one_wins(gpu_node: GpuNode) -> None:
    gpu_node.kubectl("label", "node", gpu_node.name, "nvidia.com/mig.config=all-3g", "--overwrite")
    gpu_node.label("all-1g")
    event = gpu_node.wait_event("ConfigLabelsDisagree")
    assert "'all-1g' is used" in event["message"]
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/mig-1g.5gb", 14), timeout=60)


def test_probes_follow_the_agent(gpu_node: GpuNode) -> None:
    poll("/readyz", lambda: gpu_node.agent.get("/readyz")[0], lambda code: code == 200, 30)
    assert (200, "ok\n") == gpu_node.agent.get("/healthz")
    # An agent whose kubelet is not there is alive but not ready, and says what it waits for.
    gpu_node.agent.stop()
    lonely = gpu_node.tmp / "no-kubelet"
    lonely.mkdir()
    gpu_node.start_agent(extra=("--device-plugin-dir", str(lonely)))
    # Until its plugins exist it says "pending"; then it names the resource it waits for.
    wanted = (503, "not registered with the kubelet: nvidia.com/gpu\n")
    poll(
        "/readyz naming the resource",
        lambda: gpu_node.agent.get("/readyz"),
        lambda answer: answer == wanted,
        30,
    )
    assert 200 == gpu_node.agent.get("/healthz")[0]
    gpu_node.agent.stop()
    gpu_node.start_agent()
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    poll("/readyz after the change", lambda: gpu_node.agent.get("/readyz")[0], lambda code: code == 200, 30)


@pytest.mark.parametrize(
    ("strategy", "ids"),
    [
        pytest.param("volume-mounts", "uuid", id="volume-mounts"),
        pytest.param("cdi-cri", "uuid", id="cdi-cri"),
        pytest.param("cdi-annotations,envvar", "index", id="cdi-annotations-and-envvar-by-index"),
    ],
)
def test_devices_reach_the_container_as_the_strategy_says(gpu_node: GpuNode, strategy: str, ids: str) -> None:
    gpu_node.agent.stop()
    gpu_node.start_agent(extra=("--device-list-strategy", strategy, "--device-id-strategy", ids))
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    pod = gpu_node.kubelet.admit("user", {"main": {"nvidia.com/mig-1g.5gb": 1}})
    (container,) = pod["containers"]
    (device,) = container["devices"]["nvidia.com/mig-1g.5gb"]
    gpu = next(g for g in gpu_node.export()["gpus"] if any(i["uuid"] == device for i in g["instances"]))
    name = device if ids == "uuid" else _index_of(gpu, device)
    kind = "k8s.gpu-sharing.io/gpu"
    if "volume-mounts" in strategy:
        assert "/var/run/nvidia-container-devices" == container["envs"]["NVIDIA_VISIBLE_DEVICES"]
        assert [f"/var/run/nvidia-container-devices/{name}"] == [
            m["containerPath"] for m in container["mounts"]
        ]
    if "envvar" in strategy:
        assert name == container["envs"]["NVIDIA_VISIBLE_DEVICES"]
    if strategy == "cdi-cri":
        assert [f"{kind}={name}"] == container["cdiDevices"]
        assert "NVIDIA_VISIBLE_DEVICES" not in container["envs"]
    if "cdi-annotations" in strategy:
        assert {"cdi.k8s.io/gpu-sharing_mig-1g.5gb": f"{kind}={name}"} == container["annotations"]
    if "cdi" in strategy:
        spec = json.loads((gpu_node.tmp / "cdi" / "k8s.gpu-sharing.io-gpu.json").read_text())
        names = {d["name"] for d in spec["devices"]}
        advertised = {
            s["device"] for g in status(gpu_node)["gpus"] for s in g["slices"]
        }  # every advertised device, by UUID
        assert len(advertised) == len(names)
        assert name in names
        entry = next(d for d in spec["devices"] if d["name"] == name)
        assert [f"GPU_SHARING_DEVICE_{re.sub('[^A-Za-z0-9]', '_', name).upper()}={device}"] == entry[
            "containerEdits"
        ]["env"]
        if sys.platform == "linux":  # stand-in device nodes under the simulator's directory
            paths = [n["path"] for n in entry["containerEdits"]["deviceNodes"]]
            assert paths[0] == f"/dev/nvidia{gpu['index']}"
            assert all(p.startswith("/dev/nvidia") for p in paths)


def _index_of(gpu: dict[str, Any], device: str) -> str:
    """`<GPU index>:<MIG device index>`, the MIG device index as NVML enumerates it."""
    (instance,) = [i for i in gpu["instances"] if i["uuid"] == device]
    return f"{gpu['index']}:{instance['migIndex']}"
