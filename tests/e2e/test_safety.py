"""Reconfiguring while pods hold slices and parts of the node fail: nothing handed out, destroyed or
advertised wrongly. Each test reproduces a defect found by using the agent as a new user and an
attacker would, against a real kube-apiserver and the kubelet's own device manager.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lab
import pytest

from tests.e2e.conftest import AgentProcess, GpuNode
from tests.e2e.test_agent import DEMO, allocatable, capacity, mig_and_shared
from tests.polling import poll

pytestmark = pytest.mark.integration

STATE = "nvidia.com/mig.config.state"


def state_is(value: str) -> Callable[[dict[str, str]], bool]:
    return lambda labels: labels.get(STATE) == value


def gpu_of(node: GpuNode, mig_uuid: str) -> dict[str, Any]:
    return next(g for g in node.export()["gpus"] if any(i["uuid"] == mig_uuid for i in g["instances"]))


def test_a_gpu_whose_change_is_blocked_is_never_advertised_whole(gpu_node: GpuNode) -> None:
    """Pods hold MIG devices of one A100; a config turning MIG off must not hand that GPU out whole."""
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    pod = gpu_node.kubelet.admit("holder", {"main": {"nvidia.com/mig-1g.5gb": 1}})
    (held,) = pod["containers"][0]["devices"]["nvidia.com/mig-1g.5gb"]
    blocked = gpu_of(gpu_node, held)
    gpu_node.label("all-replicas-4")
    gpu_node.wait_labels(state_is("failed"))
    assert "default/holder" in gpu_node.wait_event("ConfigApplyBlocked")["message"]
    resources = gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 12), timeout=30)["resources"]
    whole = resources["nvidia.com/gpu"]["healthy"]
    assert not [i for i in whole if i.startswith(blocked["uuid"])]
    # The blocked A100 keeps its slices, under the names of the config in effect on it: the held one
    # too, still the holder's.
    assert 2 == resources["nvidia.com/mig-1g.5gb"]["capacity"]
    assert held in resources["nvidia.com/mig-1g.5gb"]["healthy"]
    assert {"holder": [held]} == {
        p["name"]: [d for c in p["containers"] for d in c["devices"].get("nvidia.com/mig-1g.5gb", [])]
        for p in gpu_node.kubelet.pods()
    }
    labels = gpu_node.node()["metadata"]["labels"]
    assert "2" == labels["nvidia.com/mig-1g.5gb.count"]
    taker = gpu_node.kubelet.admit("taker", {"main": {"nvidia.com/gpu": 12}})
    assert not [
        i for i in taker["containers"][0]["devices"]["nvidia.com/gpu"] if i.startswith(blocked["uuid"])
    ]
    gpu_node.kubelet.delete_pod("taker")
    gpu_node.kubelet.delete_pod("holder")
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 16), timeout=30)
    gpu_node.wait_labels(state_is("success"))


def logged(agent: AgentProcess, event: str, text: str = "") -> int:
    """How many lines of the agent's JSON log are `event` (and contain `text`)."""
    lines = agent.log.read_text(errors="replace").splitlines()
    return sum(
        1
        for line in lines
        if line.startswith("{") and json.loads(line).get("event") == event and text in line
    )


def test_a_kubelet_that_restarts_while_a_change_waits_destroys_nothing_a_pod_holds(gpu_node: GpuNode) -> None:
    """Tried on the real node: a pod held a 1g.5gb, a config that turns MIG off waited for it, the
    kubelet restarted and the held slice was destroyed within 10 s while the pod kept running. A
    starting kubelet serves PodResources before it has learned its pods: List came back empty, and
    the waiting change's re-check took that for "the pod has gone"."""
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.wait_labels(state_is("success"))
    gpu_node.bind_pod("holder", {"main": {"nvidia.com/mig-1g.5gb": 1}})
    pod = gpu_node.kubelet.admit("holder", {"main": {"nvidia.com/mig-1g.5gb": 1}})
    (held,) = pod["containers"][0]["devices"]["nvidia.com/mig-1g.5gb"]
    gpu_node.label("all-replicas-4")  # MIG off on every GPU: the holder's A100 waits
    gpu_node.wait_labels(state_is("failed"))
    assert "default/holder" in gpu_node.wait_event("ConfigApplyBlocked")["message"]
    agent = gpu_node.agent
    for _ in range(3):
        short = logged(agent, "holders_unknown", "default/holder")
        gpu_node.kubelet.restart(learn_later=True)
        # The change's re-check reads the short List: it says so, or it destroys the slice.
        poll(
            "the agent reading the kubelet's short List",
            lambda: (logged(agent, "holders_unknown", "default/holder"), held in gpu_node.export_mig_uuids()),
            lambda seen, short=short: seen[0] > short or not seen[1],
            timeout=30,
        )
        assert held in gpu_node.export_mig_uuids()
        known = logged(agent, "holders_known_again")
        gpu_node.kubelet.learn()
        poll(
            "the agent believing List again",
            lambda: logged(agent, "holders_known_again"),
            lambda n, known=known: n > known,
        )
        assert held in gpu_node.export_mig_uuids()
        assert "failed" == gpu_node.node()["metadata"]["labels"][STATE]
    # Once the pod has gone, the change finishes.
    gpu_node.unbind_pod("holder")
    gpu_node.kubelet.delete_pod("holder")
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/gpu", 16), timeout=30)
    gpu_node.wait_labels(state_is("success"))
    assert held not in gpu_node.export_mig_uuids()


def test_unreadable_pod_resources_destroy_nothing(gpu_node: GpuNode) -> None:
    """The agent cannot tell who holds what: it must act as if every device were held (fail closed)."""
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.stop_agent()
    gpu_node.start_agent(extra=("--pod-resources-socket", str(gpu_node.tmp / "no-such.sock")))
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=30)  # the new agent's plugins
    pod = gpu_node.kubelet.admit("trainer", {"main": {"nvidia.com/mig-1g.5gb": 1}})
    (held,) = pod["containers"][0]["devices"]["nvidia.com/mig-1g.5gb"]
    before = gpu_node.export_mig_uuids()
    gpu_node.label("all-3g")
    gpu_node.wait_labels(state_is("failed"))
    event = gpu_node.wait_event("ConfigApplyBlocked")
    assert "Warning" == event["type"]
    assert "PodResources cannot be read" in event["message"]
    assert held in gpu_node.export_mig_uuids()
    assert before <= gpu_node.export_mig_uuids()  # nothing was destroyed at all


def test_devices_are_withdrawn_from_the_kubelet_before_they_are_destroyed(gpu_node: GpuNode) -> None:
    gate = gpu_node.tmp / "gate"
    gpu_node.agent.stop()
    opener = _GateOpener(gate)
    opener.start()
    try:
        gpu_node.start_agent(env={"SHARING_SIM_GATE": str(gate)})
        gpu_node.label("all-1g")
        gpu_node.kubelet.wait_resources(capacity("nvidia.com/mig-1g.5gb", 14), timeout=90)
        gpu_node.wait_labels(state_is("success"))
        opener.hold()
        gpu_node.label("all-3g")  # every 1g instance goes
        opener.wait_for_a_waiting_change()
        # The first hardware step is about to run: the kubelet offers none of the doomed devices
        # (the harness samples its device manager every 100 ms) ...
        gpu_node.kubelet.wait_resources(
            lambda r: all(
                r.get(n, {}).get("allocatable", 0) == 0
                for n in ("nvidia.com/mig-1g.5gb", "nvidia.com/mig-1g.10gb")
            ),
            timeout=2,
        )
        # ... so a pod arriving now cannot get one.
        with pytest.raises(lab.AdmissionError):
            gpu_node.kubelet.admit("late", {"main": {"nvidia.com/mig-1g.5gb": 1}})
    finally:
        opener.release()
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/mig-3g.20gb", 4), timeout=90)
    gpu_node.wait_labels(state_is("success"))


def test_a_corrupt_journal_is_reported_and_the_node_still_converges(gpu_node: GpuNode) -> None:
    gpu_node.agent.stop()
    journal = gpu_node.tmp / "journal.jsonl"
    journal.write_bytes(b"\x00\xff garbage that no run ever wrote \x80\n" * 1000)
    gpu_node.start_agent()
    gpu_node.label(DEMO)
    event = gpu_node.wait_event("JournalCorrupt")
    assert "Warning" == event["type"]
    assert "moved to" in event["message"]
    assert len(event["message"]) < 1024
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.wait_labels(state_is("success"))
    assert (gpu_node.tmp / "journal.jsonl.corrupt").exists()


RESYNC_S = 5
RECONCILES = "gpu_sharing_reconcile_duration_seconds_count"


def reconciles(node: GpuNode) -> int:
    """Reconciles the agent has run, per its /metrics."""
    status, text = node.agent.get("/metrics")
    assert 200 == status, text
    (count,) = [line for line in text.splitlines() if line.startswith(RECONCILES + " ")]
    return int(float(count.split()[1]))


def test_an_api_server_restart_leaves_an_idle_agent_quiet(gpu_node: GpuNode) -> None:
    """The ConfigMap watch used to spin at ~230 requests/s after a restart (resuming from an old version)."""
    gpu_node.stop_agent()
    gpu_node.start_agent(extra=("--resync-seconds", str(RESYNC_S)))
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.wait_labels(state_is("success"))
    gpu_node.control_plane.restart_apiserver()
    gpu_node.label("all-replicas-2")  # proves the watches came back
    # The change is done (its labels and state written) before the measured window starts.
    applied = state_is("success")
    gpu_node.wait_labels(
        lambda labels: labels.get("nvidia.com/gpu.replicas") == "2" and applied(labels), timeout=60
    )
    # The window: at least three reconciles (one every RESYNC_S, and any the change's own writes
    # trigger), counted on /metrics as each ends. The count is read before the window opens (read
    # after, a reconcile ending in between would count as before the window, its requests inside)
    # and again once it has closed: a request in the window belongs to a reconcile that ended in it
    # or to the one running as it closes (the loop runs one at a time), which `ran` counts too.
    before = reconciles(gpu_node)
    start = time.time()
    poll("three reconciles", lambda: reconciles(gpu_node), lambda n: n >= before + 3, 5 * RESYNC_S)
    end = time.time()
    ran = reconciles(gpu_node) - before + 1
    requests = gpu_node.agent_requests(start, end)
    # A reconcile asks which pods are bound here each time it reads the holders (the check of the
    # kubelet's List; at most twice: to plan, and to plan again after a withdrawal); nothing else is
    # needed while idle: no watch spins, nothing is patched.
    bound = [r for r in requests if r.startswith("list /api/v1/pods?")]
    others = [r for r in requests if r not in bound]
    assert len(bound) <= 2 * ran, f"pods listed more than twice in each of {ran} reconciles: {bound}"
    assert len(others) <= ran, f"{len(others)} requests in {ran} idle reconciles after a restart: {others}"


class _GateOpener(threading.Thread):
    """Lets the simulator's hardware changes through one by one, until told to hold them."""

    def __init__(self, gate: Path) -> None:
        super().__init__(daemon=True)
        self.gate = gate
        self.waiting = Path(f"{gate}.waiting")
        self._hold = threading.Event()
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            if self.waiting.exists() and not self._hold.is_set() and not self.gate.exists():
                self.gate.touch()
            self._stop.wait(0.01)

    def hold(self) -> None:
        self._hold.set()

    def wait_for_a_waiting_change(self, timeout: float = 60) -> None:
        poll("a hardware change waiting at the gate", self.waiting.exists, bool, timeout)

    def release(self) -> None:
        self._hold.clear()
        self.gate.touch()


@pytest.fixture(autouse=True)
def _no_leftover_pods(gpu_node: GpuNode) -> Iterator[None]:
    yield
    for pod in gpu_node.kubelet.pods():
        gpu_node.kubelet.delete_pod(pod["uid"])


def test_a_lost_gpu_does_not_block_the_others(gpu_node: GpuNode) -> None:
    """All GPUs used to be read in one call: one GPU's error failed every reconcile for all of them."""
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    lost = gpu_node.export()["gpus"][3]["uuid"]  # an H100, time-sliced 4 ways
    gpu_node.sharing("sim", "lost", "--sim-state", str(gpu_node.sim), "--gpu", "3")
    gpu_node.label("all-1g")
    resources = gpu_node.kubelet.wait_resources(
        lambda r: capacity("nvidia.com/mig-1g.5gb", 14)(r) and capacity("nvidia.com/mig-1g.10gb", 7)(r),
        timeout=60,
    )["resources"]
    # The lost GPU's replicas stay listed, unhealthy: nothing can be handed out on it.
    assert 4 == resources["nvidia.com/gpu"]["capacity"]
    assert 0 == resources["nvidia.com/gpu"]["allocatable"]
    event = gpu_node.wait_event("ConfigApplyFailed")
    assert "GPU 3: cannot be read" in event["message"]
    gpu_node.wait_labels(state_is("failed"))
    gpu_node.sharing("sim", "found", "--sim-state", str(gpu_node.sim), "--gpu", "3")
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/mig-1g.10gb", 14), timeout=90)
    gpu_node.wait_labels(state_is("success"))
    assert lost == gpu_node.export()["gpus"][3]["uuid"]


ALL_3G_TIME_SLICED = (
    "version: v1\nmigStrategy: mixed\ngpus:\n"
    "  - devices: {product: A100-SXM4-40GB}\n    mig: {3g.20gb: 2}\n    replicas: 2\n"
    "  - devices: {product: H100-80GB-HBM3}\n    mig: {3g.40gb: 2}\n    replicas: 2\n"
)
ALL_REPLICAS_2_RENAMED = (
    "version: v1\nsharing:\n  renameByDefault: true\n"
    "gpus:\n  - devices: all\n    mig: disabled\n    replicas: 2\n"
)


@dataclass(frozen=True)
class Reform:
    before: str
    """Preset the holder is admitted under."""
    after: str
    """Preset name, or the YAML of a config of the test's own."""
    held_as: str
    offered_as: str
    others: int
    """How many devices nobody holds the next config offers as `offered_as` ..."""
    replicas: bool
    """... as replicas (`<uuid>::<n>`) or not."""


@pytest.mark.parametrize(
    "case",
    [
        # A pod holds a 3g.40gb MIG device for itself; the next config keeps the slice and time-slices it.
        Reform("all-3g", ALL_3G_TIME_SLICED, "nvidia.com/mig-3g.40gb", "nvidia.com/mig-3g.40gb", 6, True),
        # A pod holds a replica of a time-sliced GPU; the next config hands whole GPUs out.
        Reform("all-replicas-2", "all-disabled", "nvidia.com/gpu", "nvidia.com/gpu", 3, False),
        # The same replica IDs under a new name: the kubelet does not know they are taken.
        Reform("all-replicas-2", ALL_REPLICAS_2_RENAMED, "nvidia.com/gpu", "nvidia.com/gpu.shared", 6, True),
    ],
    ids=["held-whole-then-time-sliced", "held-replica-then-whole", "held-replica-then-renamed"],
)
def test_a_held_device_is_not_offered_again_in_another_form(gpu_node: GpuNode, case: Reform) -> None:
    """Found by the soak: a config that changes only how a held device is shared (replicas, names)
    made the kubelet hand it to a second pod while the first still held it."""
    gpu_node.label(case.before)
    gpu_node.kubelet.wait_resources(lambda r: r.get(case.held_as, {}).get("allocatable", 0) >= 4, timeout=60)
    holder = gpu_node.kubelet.admit("holder", {"main": {case.held_as: 1}})
    (held,) = holder["containers"][0]["devices"][case.held_as]
    device = held.partition("::")[0]
    gpu_node.label(gpu_node.put_config(case.after) if "\n" in case.after else case.after)

    def others_offered(r: dict[str, Any]) -> bool:
        ids = r.get(case.offered_as, {}).get("healthy", [])
        new = [i for i in ids if ("::" in i) == case.replicas and not i.startswith(device)]
        return len(new) >= case.others

    # The devices nobody holds are offered in their new form ...
    resources = gpu_node.kubelet.wait_resources(others_offered, timeout=60)["resources"]
    healthy = resources[case.offered_as]["healthy"]
    # ... and the held one in no form that a second pod could get.
    assert [] == [i for i in healthy if i.startswith(device) and i != held]
    free = [i for i in healthy if i != held]
    taker = gpu_node.kubelet.admit("taker", {"main": {case.offered_as: len(free)}})
    assert [] == [i for i in taker["containers"][0]["devices"][case.offered_as] if i.startswith(device)]
    # The config waits for the pod, and says so.
    gpu_node.wait_labels(state_is("failed"))
    assert "held by pods default/holder" in gpu_node.wait_event("ConfigApplyBlocked")["message"]
    # Once the holder has gone, the device is offered in the new form too.
    gpu_node.kubelet.delete_pod("holder")
    gpu_node.kubelet.wait_resources(
        lambda r: any(i.startswith(device) for i in r.get(case.offered_as, {}).get("healthy", [])), timeout=30
    )
    gpu_node.wait_labels(state_is("success"))


def test_a_pod_gone_before_the_agent_saw_it_does_not_block_a_change(gpu_node: GpuNode) -> None:
    """Found by the soak: a device handed out to a pod deleted before the agent read PodResources
    counted as held for 30 s (the plugins' memory of recent Allocates), so the node took half a
    minute to converge after its last pod had gone."""
    gpu_node.label("all-3g")
    gpu_node.wait_labels(state_is("success"))
    # What the admission needs: the kubelet offers all four (capacity counts unhealthy ones too).
    gpu_node.kubelet.wait_resources(allocatable("nvidia.com/mig-3g.20gb", 4), timeout=60)
    pod = gpu_node.kubelet.admit("brief", {"main": {"nvidia.com/mig-3g.20gb": 4}})
    held = pod["containers"][0]["devices"]["nvidia.com/mig-3g.20gb"]
    gpu_node.kubelet.delete_pod("brief")
    gpu_node.label("all-1g")  # destroys every 3g.20gb: nothing holds them any more
    gpu_node.kubelet.wait_resources(capacity("nvidia.com/mig-1g.5gb", 14), timeout=15)
    gpu_node.wait_labels(state_is("success"), timeout=5)
    assert not set(held) & gpu_node.export_mig_uuids()


def test_a_restart_with_a_missing_config_keeps_the_last_good_one(gpu_node: GpuNode) -> None:
    """The config last applied names the devices after a restart, even if the label names nothing."""
    gpu_node.label(DEMO)
    gpu_node.kubelet.wait_resources(mig_and_shared, timeout=60)
    gpu_node.wait_labels(state_is("success"))
    gpu_node.stop_agent()
    gpu_node.label("no-such-config")
    gpu_node.start_agent()
    gpu_node.wait_labels(state_is("failed"))
    gpu_node.wait_event("ConfigRejected")
    # Still four H100 replicas each and the A100s' slices: what the last good config gives.
    assert mig_and_shared(gpu_node.kubelet.wait_resources(mig_and_shared, timeout=30)["resources"])
    notes = gpu_node.node()["metadata"]["annotations"]
    assert DEMO == notes["nvidia.com/gpu-sharing.config"]


def test_no_config_at_all_clears_the_state_label(gpu_node: GpuNode) -> None:
    gpu_node.label("no-such-config")
    gpu_node.wait_labels(state_is("failed"))
    gpu_node.kubectl("label", "node", gpu_node.name, "nvidia.com/device-plugin.config-")
    gpu_node.wait_labels(lambda labels: STATE not in labels)
