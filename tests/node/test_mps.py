"""MPS on the real node: the agent's control daemons under the node's fake driver (hack/fakedriver).

The H100s (GPUs 2 and 3) are shared with MPS by a config in the user's ConfigMap; a pod that asks
for a replica gets its GPU's pipe directory and the MPS shared memory. A client is a pod that
connects to the pipe and stays, and exits (failing its pod) if its daemon goes (the fake daemon's
stand-in for a CUDA process, in the agent's image, which has Python). The daemons are started by
the MPS keeper, a DaemonSet of its own, and live in its pod's PID namespace: the PID in a
daemon's record is one there. What each daemon enforces is read from its record under the node's
driver root. The node's label and ConfigMap are put back afterwards.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab.api import ApiError
from lab.helm import NAMESPACE, RELEASE, lab_values
from lab.images import agent_image

from tests.node.conftest import ALL_KINDS, CONFIG, CONFIG_LABEL, NodeUnderTest, container_status
from tests.polling import poll

pytestmark = pytest.mark.node

SHARED = "nvidia.com/gpu.shared"
KEEPER = f"{RELEASE}-mps-keeper"
"""The MPS keeper's DaemonSet: the daemons live in its pod, not the agent's."""
A100S = """  - devices: {product: A100-SXM4-40GB}
    mig: {1g.5gb: 2, 2g.10gb: 1, 3g.20gb: 1}
    replicas: {2g.10gb: 2}
"""


def mps_config(gpu2: str, gpu3: str) -> str:
    """The session's config with the H100s shared by MPS (`mps:` of each rule as given)."""
    return (
        "version: v1\nmigStrategy: mixed\nsharing:\n  renameByDefault: true\ngpus:\n"
        f"  - devices: [2]\n    mps: {gpu2}\n  - devices: [3]\n    mps: {gpu3}\n{A100S}"
    )


EXPECTED = {
    "nvidia.com/mig-1g.5gb": "4",
    "nvidia.com/mig-3g.20gb": "2",
    "nvidia.com/mig-2g.10gb.shared": "4",
    SHARED: "6",
}


def records(node: NodeUnderTest) -> list[dict[str, Any]]:
    """The live fake daemons' records under the node's driver root (a killed one's lock is free)."""
    found = []
    for path in sorted((node.node.driver_root / "var/lib/fake-nvidia/mps").glob("*.json")):
        try:
            with open(path.with_suffix(".lock"), "rb") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    found.append(json.loads(path.read_text()))
        except FileNotFoundError:
            continue  # a daemon that quit meanwhile
    return found


def daemon(node: NodeUnderTest, gpu: str) -> dict[str, Any] | None:
    return next((r for r in records(node) if r["gpus"] == [gpu]), None)


def h100s(node: NodeUnderTest) -> tuple[str, str]:
    gpus = {g["index"]: g["uuid"] for g in node.export()["gpus"]}
    return gpus[2], gpus[3]


@pytest.fixture
def mps(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The node on config `mps`: GPU 2 in 4 MPS replicas, GPU 3 in 2, every daemon enforcing."""
    node.patch_configs({"mps": mps_config("{replicas: 4}", "{replicas: 2}")})
    try:
        node.label(CONFIG_LABEL, "mps")
        node.wait_allocatable(EXPECTED, timeout=120)
        yield node
    finally:
        node.delete_pods()
        hook = node.node.driver_root / "var/lib/fake-nvidia/mps/refuse-start"
        hook.unlink(missing_ok=True)
        node.label(CONFIG_LABEL, CONFIG)
        node.wait_allocatable(timeout=120)
        node.patch_configs({"mps": None})


def client_pod(node: NodeUnderTest) -> str:
    """A pod holding one MPS replica whose process stays attached to its GPU's MPS server, and fails
    (the pod with it) when the daemon goes."""
    name = f"mps-{uuid.uuid4().hex[:6]}"
    attach = (
        "import os, socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.connect(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '/control')\n"
        "s.sendall(b'fake_attach')\n"
        "assert s.recv(64) == b'attached\\n'\n"
        "s.recv(1)\n"  # the daemon sends nothing more: this returns when it closes
        "raise SystemExit('the MPS control daemon went away')\n"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": agent_image(),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", attach],
                    "resources": {"limits": {SHARED: "1"}},
                }
            ],
        },
    }
    node.create(pod)
    node.pods.append(name)
    node.wait_running(name)
    return name


def test_a_pod_requesting_an_mps_replica_sees_its_gpus_pipe_directory_and_shared_memory(
    mps: NodeUnderTest,
) -> None:
    gpu2, gpu3 = h100s(mps)
    name = mps.start_pod(SHARED)
    mps.wait_running(name)
    pipe = mps.env(name)["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe in (f"/mps/{gpu2}/pipe", f"/mps/{gpu3}/pipe")
    assert "control" in mps.kubectl("exec", name, "--", "ls", pipe).split()
    mps.kubectl("exec", name, "--", "sh", "-c", f"echo {name} > /dev/shm/{name}")
    holder = next(r for r in mps.node.records if r.name == "namespace-holder")
    shared = Path(f"/proc/{holder.pid}/root/run/nvidia/mps/shm/{name}")  # the node's mpsRoot
    assert f"{name}\n" == shared.read_text()
    shared.unlink()
    assert (25, 50) == tuple(daemon(mps, g)["activeThreadPercentage"] for g in (gpu2, gpu3))  # type: ignore[index]


def test_a_killed_daemon_makes_its_replicas_unhealthy_until_it_is_restarted(mps: NodeUnderTest) -> None:
    _, gpu3 = h100s(mps)
    before = daemon(mps, gpu3)
    assert before is not None
    hook = mps.node.driver_root / "var/lib/fake-nvidia/mps/refuse-start"
    hook.touch()  # the fake driver's hook: the next start fails, so the unhealthy state can be seen
    keeper(mps, "python3", "-c", f"import os, signal; os.kill({before['pid']}, signal.SIGKILL)")
    mps.wait_allocatable({**EXPECTED, SHARED: "4"}, timeout=60)  # GPU 3's 2 replicas unhealthy
    # The keeper waits for the daemon it was left (a zombie would keep its /proc entry).
    gone = f"import os; print(os.path.exists('/proc/{before['pid']}'))"
    poll(
        "the daemon waited for",
        lambda: keeper(mps, "python3", "-c", gone).strip(),
        lambda out: out == "False",
    )
    down = "the MPS control daemon of GPU 3 (NVIDIA H100 80GB HBM3) does not answer"
    poll("the Event", lambda: mps.events("MpsDaemonDown"), lambda found: any(down in m for m in found))
    hook.unlink()
    mps.wait_allocatable(EXPECTED, timeout=120)
    back = "the MPS control daemon of GPU 3 (NVIDIA H100 80GB HBM3) answers again"
    poll("the Event", lambda: mps.events("MpsDaemonHealthy"), lambda found: back in found)
    after = daemon(mps, gpu3)
    assert after is not None
    assert after["pid"] != before["pid"]
    limits = ("activeThreadPercentage", "pinnedMemLimitMiB")
    assert [before[k] for k in limits] == [after[k] for k in limits]


def test_a_reload_waits_for_the_client_and_restarts_only_the_daemon_whose_limits_changed(
    mps: NodeUnderTest,
) -> None:
    gpu2, gpu3 = h100s(mps)
    name = client_pod(mps)
    held = mps.env(name)["CUDA_MPS_PIPE_DIRECTORY"].split("/")[2]
    free = gpu3 if held == gpu2 else gpu2
    poll("the client attached", lambda: daemon(mps, held), lambda r: r is not None and bool(r["clients"]))
    pids = {g: daemon(mps, g)["pid"] for g in (gpu2, gpu3)}  # type: ignore[index]
    mps.patch_configs(
        {
            "mps": mps_config(
                "{replicas: 4, activeThreadPercentage: 20}", "{replicas: 2, activeThreadPercentage: 40}"
            )
        },
    )
    new = {gpu2: 20, gpu3: 40}
    poll(
        "the daemon without clients restarted with its new limits",
        lambda: daemon(mps, free),
        lambda r: r is not None and r["activeThreadPercentage"] == new[free],
        120,
    )
    messages = poll(
        "the change waiting for the client",
        lambda: mps.events("ConfigApplyBlocked"),
        lambda found: any("processes run on GPU" in m for m in found),
        90,
    )
    assert any(f"default/{name}" in m for m in messages)
    kept = daemon(mps, held)
    assert kept is not None
    assert (pids[held], 25 if held == gpu2 else 50) == (kept["pid"], kept["activeThreadPercentage"])
    assert pids[free] != daemon(mps, free)["pid"]  # type: ignore[index]
    mps.delete_pods()
    poll(
        "the waiting daemon restarted once its client has gone",
        lambda: daemon(mps, held),
        lambda r: r is not None and r["activeThreadPercentage"] == new[held],
        120,
    )
    mps.wait_allocatable(EXPECTED, timeout=120)


def keeper(node: NodeUnderTest, *command: str) -> str:
    """Run a command in the MPS keeper's pod, the daemons' PID namespace."""
    return node.kubectl("-n", NAMESPACE, "exec", f"ds/{KEEPER}", "--", *command)


def test_a_reload_without_clients_restarts_only_the_daemon_whose_limits_changed(mps: NodeUnderTest) -> None:
    gpu2, gpu3 = h100s(mps)
    pids = {g: daemon(mps, g)["pid"] for g in (gpu2, gpu3)}  # type: ignore[index]
    mps.patch_configs({"mps": mps_config("{replicas: 4, activeThreadPercentage: 10}", "{replicas: 2}")})
    restarted = poll(
        "GPU 2's daemon restarted with its new limit",
        lambda: daemon(mps, gpu2),
        lambda r: r is not None and r["activeThreadPercentage"] == 10,
        120,
    )
    assert pids[gpu2] != restarted["pid"]
    assert (pids[gpu3], 50) == (daemon(mps, gpu3)["pid"], daemon(mps, gpu3)["activeThreadPercentage"])  # type: ignore[index]
    mps.wait_allocatable(EXPECTED, timeout=120)


@pytest.fixture
def mps_cdi(mps: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The MPS node with the chart upgraded to hand devices out by CDI names only (cdi-cri): the
    agent's pod is replaced, and the new one finds the daemons the keeper kept."""
    (old,) = mps.agent_pods()
    mps.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, deviceListStrategy="cdi-cri"))
    try:
        mps.running_agent(not_uid=old["metadata"]["uid"])
        mps.wait_allocatable(EXPECTED, timeout=120)
        yield mps
    finally:
        mps.delete_pods()
        (old,) = mps.agent_pods()
        mps.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
        mps.running_agent(not_uid=old["metadata"]["uid"])
        mps.wait_allocatable(EXPECTED, timeout=120)


def test_with_cdi_the_spec_gives_an_mps_replica_its_pipe_directory_and_shared_memory(
    mps_cdi: NodeUnderTest,
) -> None:
    name = mps_cdi.start_pod(SHARED)
    pod = mps_cdi.wait_running(name)
    (device,), envs = mps_cdi.allocation(pod, SHARED)
    assert {} == envs  # every strategy is CDI: the spec carries the variable, as it carries the device
    gpu = device.partition("::")[0]
    pipe = f"/mps/{gpu}/pipe"
    assert pipe == mps_cdi.env(name)["CUDA_MPS_PIPE_DIRECTORY"]
    assert "control" in mps_cdi.kubectl("exec", name, "--", "ls", pipe).split()
    mps_cdi.kubectl("exec", name, "--", "sh", "-c", f"echo {name} > /dev/shm/{name}")
    holder = next(r for r in mps_cdi.node.records if r.name == "namespace-holder")
    shared = Path(f"/proc/{holder.pid}/root/run/nvidia/mps/shm/{name}")
    assert f"{name}\n" == shared.read_text()
    shared.unlink()


# ---- the agent's container killed: the daemons live in the keeper's -------------------------


@pytest.fixture
def agent_restored(mps: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The MPS node; afterwards a new agent pod if its agent's container was restarted (other tests
    read that container's restart count as "its liveness probe never failed")."""
    yield mps
    (pod,) = mps.agent_pods()
    if container_status(pod, "agent")["restartCount"] == 0:
        return
    mps.delete_pods()
    mps.delete("pod", pod["metadata"]["name"], namespace=NAMESPACE, timeout=90)
    mps.running_agent(not_uid=pod["metadata"]["uid"])
    mps.wait_allocatable(EXPECTED, timeout=120)


def container_init(node: NodeUnderTest, container_id: str) -> int:
    """The node's PID of a container's first process (PID 1 of its own PID namespace), by its cgroup."""
    found = set()
    for pid in node.node.cgroup.pids():
        try:
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # ended meanwhile
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if container_id.partition("://")[2] in cgroup and nspid[-1:] == ["1"]:
            found.add(pid)
    (pid,) = found
    return pid


def mps_status(node: NodeUnderTest) -> dict[str, tuple[bool, int, int]]:
    """Per MPS GPU, as the agent says (`sharing status`): whether its daemon answers with the GPU's
    limits, how often the agent restarted it, and how many of its replicas it advertises healthy."""
    try:
        document = node.status()
    except (ApiError, IndexError):
        return {}  # the agent's pod is not there or not serving yet
    return {
        g["uuid"]: (
            g["mps"]["healthy"],
            g["mps"]["restarts"],
            sum(s["health"] == "Healthy" for s in g["slices"]),
        )
        for g in document["gpus"]
        if g["mps"]
    }


ASK = (  # a client's command over its pipe, from inside its pod
    "import os, socket\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.connect(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '/control')\n"
    "s.sendall(b'get_default_active_thread_percentage\\n')\n"
    "s.shutdown(socket.SHUT_WR)\n"
    "print(s.recv(64).decode().strip())\n"
)


def test_a_killed_agent_container_leaves_the_mps_daemons_serving_and_the_new_agent_adopts_them(
    agent_restored: NodeUnderTest,
) -> None:
    mps = agent_restored
    gpu2, gpu3 = h100s(mps)
    name = client_pod(mps)
    held = mps.env(name)["CUDA_MPS_PIPE_DIRECTORY"].split("/")[2]
    poll("the client attached", lambda: daemon(mps, held), lambda r: r is not None and bool(r["clients"]))
    before = {g: daemon(mps, g) for g in (gpu2, gpu3)}
    (pod,) = mps.agent_pods()
    agent, kept = container_status(pod, "agent"), container_status(keeper_pod(mps), "mps-keeper")
    starts = keeper_log(mps).count("mps_keeper_started")
    init = container_init(mps, agent["containerID"])
    assert b"agent" in Path(f"/proc/{init}/cmdline").read_bytes().split(b"\0")
    os.kill(init, signal.SIGKILL)  # as an OOM kill would: the kernel ends its whole PID namespace

    def restarted(pods: list[dict[str, Any]]) -> bool:
        status = container_status(pods[0], "agent") if len(pods) == 1 else {}
        return status.get("restartCount") == agent["restartCount"] + 1 and bool(status.get("ready"))

    (after,) = poll("the agent's container restarted and ready", mps.agent_pods, restarted, 120)
    assert pod["metadata"]["uid"] == after["metadata"]["uid"]
    keeper_now = container_status(keeper_pod(mps), "mps-keeper")
    assert (kept["containerID"], kept["restartCount"]) == (
        keeper_now["containerID"],
        keeper_now["restartCount"],
    )
    # The new agent found both daemons answering with their limits: healthy, never restarted, their
    # replicas advertised again.
    adopted = {gpu2: (True, 0, 4), gpu3: (True, 0, 2)}
    poll("the new agent's view of the daemons", lambda: mps_status(mps), lambda s: s == adopted, 120)
    mps.wait_allocatable(EXPECTED, timeout=120)
    assert {g: r["pid"] for g, r in before.items()} == {g: daemon(mps, g)["pid"] for g in before}  # type: ignore[index]
    client = mps.pod(name)
    assert ("Running", 0) == (client["status"]["phase"], container_status(client, "main")["restartCount"])
    assert daemon(mps, held)["clients"]  # type: ignore[index]
    assert {gpu2: "25.0", gpu3: "50.0"}[held] == mps.kubectl("exec", name, "--", "python3", "-c", ASK).strip()
    assert "mps_daemon_started" not in mps.agent_log()
    assert starts == keeper_log(mps).count("mps_keeper_started")


def keeper_log(node: NodeUnderTest) -> str:
    return node.kubectl("-n", NAMESPACE, "logs", f"ds/{KEEPER}")


def keeper_pod(node: NodeUnderTest) -> dict[str, Any]:
    (pod,) = node.get("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/name={KEEPER}")["items"]
    return dict(pod)
