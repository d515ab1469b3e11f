"""MPS: the fake nvidia-cuda-mps-control, and the agent's control daemons over it and the real pynvml,
started by the agent itself or by the MPS keeper.

The fake tool's commands and output formats are NVIDIA's (hack/fakedriver/src/mpsctl.c cites them);
what a daemon was told is read back from its record beside the state, the way a test of a real
node would read `get_default_*` from the daemon.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sharing.config.spec import MigMode, MpsLimits, Replicas, Rule, Selector, Sharing, SharingConfig
from sharing.deviceplugin import Fleet
from sharing.devices import MpsSettings
from sharing.gpu import mpskeeper, simstate
from sharing.gpu.mps import Enforced, MpsDaemons, Readiness
from sharing.gpu.mpscontrol import CONTROL
from sharing.gpu.nvml import NvmlBackend
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.labels import ConfigState
from sharing.mig import Outcome
from sharing.mig.catalog import default_catalog
from sharing.rollout import Rollout
from sharing.store.journal import Journal
from tests.fakedriver.conftest import REPO, Nvml, NvmlError, State
from tests.polling import live_parent, poll, process
from tests.unit.fakekubelet import FakeKubelet

CATALOG = default_catalog()
A100 = "A100-SXM4-40GB"
GPU = "nvidia.com/gpu"
EXCLUSIVE_PROCESS = 3  # nvml.h NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


# ---- the fake tool ---------------------------------------------------------------------------


class Daemon:
    """One fake control daemon's pipe and log directories, driven as the agent drives it."""

    def __init__(self, tool: Path, state: Path, where: Path) -> None:
        self.tool, self.state = tool, state
        self.pipe, self.log = where / "pipe", where / "log"

    def env(self, gpu: str | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            "FAKE_NVML_STATE": str(self.state),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log),
        }
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return env

    def start(self, gpu: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.tool), "-d"], check=False, env=self.env(gpu), capture_output=True, text=True, timeout=30
        )

    def tell(self, *commands: str) -> subprocess.CompletedProcess[str]:
        stdin = "".join(c + "\n" for c in commands)
        return subprocess.run(
            [str(self.tool)],
            check=False,
            input=stdin,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )

    def attach(self) -> socket.socket:
        """A client of the daemon's server (the fake's stand-in for a CUDA process)."""
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(self.pipe / "control"))
        client.sendall(b"fake_attach")
        assert b"attached\n" == client.recv(64)
        return client


def records(state: Path) -> list[dict[str, Any]]:
    """The records of the live fake daemons beside the state: a killed daemon's is left behind, and
    its lock (held by a live daemon) can be taken."""
    found = []
    for path in sorted((state.parent / "mps").glob("*.json")):
        with open(path.with_suffix(".lock"), "rb") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                found.append(json.loads(path.read_text()))
    return found


def record_of(state: Path, gpu: str) -> dict[str, Any] | None:
    """The live record of `gpu`'s daemon."""
    return next((r for r in records(state) if r["gpus"] == [gpu]), None)


@pytest.fixture
def daemon(driver_root: Path, machine: State, tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(driver_root / CONTROL, machine.path, tmp_path / "mps")
    yield d
    d.tell("quit")


def test_the_daemon_enforces_and_records_what_it_is_told(daemon: Daemon, machine: State) -> None:
    uuids = machine.init(f"{A100}:2")
    assert 0 == daemon.start(uuids[1]).returncode
    told = daemon.tell(
        "set_default_active_thread_percentage 25", "set_default_device_pinned_mem_limit 0 10240M"
    )
    assert ("", 0) == (told.stdout, told.returncode)
    asked = daemon.tell("get_default_active_thread_percentage", "get_default_device_pinned_mem_limit 0")
    assert "25.0\n10G\n" == asked.stdout
    record = record_of(machine.path, uuids[1])
    assert record is not None
    assert (25, [10240], []) == (
        record["activeThreadPercentage"],
        record["pinnedMemLimitMiB"],
        record["clients"],
    )
    assert str(daemon.pipe) == record["pipeDirectory"]
    assert "Starting control daemon" in (daemon.log / "control.log").read_text()
    again = daemon.start(uuids[1])
    assert (1, "An instance of this daemon is already running\n") == (again.returncode, again.stderr)


def test_a_daemon_that_quits_leaves_no_record_and_no_pipe_that_answers(
    daemon: Daemon, machine: State
) -> None:
    uuids = machine.init(A100)
    assert 0 == daemon.start(uuids[0]).returncode
    assert 0 == daemon.tell("quit").returncode
    poll("the record gone", lambda: records(machine.path), lambda r: r == [])
    gone = daemon.tell("get_server_list")
    assert (1, "Cannot find MPS control daemon process\n") == (gone.returncode, gone.stderr)


def test_a_connection_that_sends_nothing_holds_up_no_other_command(daemon: Daemon, machine: State) -> None:
    uuids = machine.init(A100)
    assert 0 == daemon.start(uuids[0]).returncode
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(str(daemon.pipe / "control"))
    try:
        asked = daemon.tell("get_default_active_thread_percentage")
        assert ("100.0\n", 0) == (asked.stdout, asked.returncode)
        client = daemon.attach()
        client.close()
    finally:
        silent.close()


def test_unknown_visible_devices_and_the_refuse_start_hook_fail_the_start(
    daemon: Daemon, machine: State
) -> None:
    uuids = machine.init(A100)
    bad = daemon.start("GPU-00000000-0000-0000-0000-000000000000")
    assert 1 == bad.returncode
    assert "CUDA_VISIBLE_DEVICES names no GPU" in bad.stderr
    hook = machine.path.parent / "mps/refuse-start"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.touch()
    assert 1 == daemon.start(uuids[0]).returncode
    hook.unlink()
    assert 0 == daemon.start(uuids[0]).returncode


def test_clients_show_as_nvml_processes_of_their_gpu(daemon: Daemon, machine: State, nvml_for: Any) -> None:
    uuids = machine.init(f"{A100}:2")
    assert 0 == daemon.start(uuids[1]).returncode
    worker: Nvml = nvml_for(machine)
    handles = [worker.call("nvmlDeviceGetHandleByIndex", i) for i in (0, 1)]
    client = daemon.attach()
    try:
        server = int(daemon.tell("get_server_list").stdout)
        processes = worker.call("nvmlDeviceGetComputeRunningProcesses", handles[1])
        assert [server] == [p["pid"] for p in processes]
        clients = worker.call("nvmlDeviceGetMPSComputeRunningProcesses", handles[1])
        assert [os.getpid()] == [p["pid"] for p in clients]
        assert f"{os.getpid()}\n" == daemon.tell(f"get_client_list {server}").stdout
        assert [] == worker.call("nvmlDeviceGetComputeRunningProcesses", handles[0])
    finally:
        client.close()
    poll(
        "no MPS clients once the client has gone",
        lambda: worker.call("nvmlDeviceGetMPSComputeRunningProcesses", handles[1]),
        lambda p: p == [],
    )
    # The idle server stays, a compute process of its GPU, until the daemon quits.
    assert f"{server}\n" == daemon.tell("get_server_list").stdout
    assert "" == daemon.tell(f"get_client_list {server}").stdout
    assert [server] == [p["pid"] for p in worker.call("nvmlDeviceGetComputeRunningProcesses", handles[1])]
    assert 0 == daemon.tell("quit").returncode
    poll(
        "the server gone with its daemon",
        lambda: worker.call("nvmlDeviceGetComputeRunningProcesses", handles[1]),
        lambda p: p == [],
    )


def test_a_killed_daemon_is_no_server_for_nvml(daemon: Daemon, machine: State, nvml_for: Any) -> None:
    uuids = machine.init(A100)
    assert 0 == daemon.start(uuids[0]).returncode
    worker: Nvml = nvml_for(machine)
    handle = worker.call("nvmlDeviceGetHandleByIndex", 0)
    client = daemon.attach()
    try:
        record = record_of(machine.path, uuids[0])
        assert record is not None
        os.kill(record["pid"], signal.SIGKILL)
        poll(
            "no processes after the daemon was killed",
            lambda: worker.call("nvmlDeviceGetComputeRunningProcesses", handle),
            lambda p: p == [],
        )
        assert [] == worker.call("nvmlDeviceGetMPSComputeRunningProcesses", handle)
    finally:
        client.close()
    assert 1 == daemon.tell("get_default_active_thread_percentage").returncode


def test_compute_mode_is_set_and_read_through_nvml(machine: State, nvml_for: Any) -> None:
    machine.init(A100)
    worker: Nvml = nvml_for(machine)
    handle = worker.call("nvmlDeviceGetHandleByIndex", 0)
    assert 0 == worker.call("nvmlDeviceGetComputeMode", handle)  # NVML_COMPUTEMODE_DEFAULT
    worker.call("nvmlDeviceSetComputeMode", handle, EXCLUSIVE_PROCESS)
    assert EXCLUSIVE_PROCESS == worker.call("nvmlDeviceGetComputeMode", handle)
    assert EXCLUSIVE_PROCESS == machine.read()["gpus"][0]["computeMode"]
    with pytest.raises(NvmlError) as refused:
        worker.call("nvmlDeviceSetComputeMode", handle, 1)  # EXCLUSIVE_THREAD: "Support Removed"
    assert 2 == refused.value.code  # NVML_ERROR_INVALID_ARGUMENT


# ---- the agent's daemons over the real pynvml ------------------------------------------------


@pytest.fixture
async def backend(state: Path, nvml: Any) -> AsyncIterator[NvmlBackend]:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, A100)] * 2)
    b = NvmlBackend(nvml, CATALOG)
    yield b
    await b.close()


@pytest.fixture
async def daemons(backend: NvmlBackend, node_root: Path) -> AsyncIterator[MpsDaemons]:
    root = Path(tempfile.mkdtemp(prefix="gs-mps-", dir="/tmp"))  # short: unix socket paths are limited
    d = MpsDaemons(root, node_root / CONTROL, backend.set_compute_mode)
    yield d
    for pipe in root.glob("*/pipe"):
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
        subprocess.run(
            [str(d.control)], input=b"quit\n", env=env, capture_output=True, timeout=30, check=False
        )
    shutil.rmtree(root, ignore_errors=True)


def limits(state: Path, gpu: str) -> tuple[int, list[int]] | None:
    """What the GPU's live daemon was told (None: no record)."""
    record = record_of(state, gpu)
    return None if record is None else (record["activeThreadPercentage"], record["pinnedMemLimitMiB"])


def compute_modes(state: Path) -> list[int]:
    return [g.get("computeMode", 0) for g in json.loads(state.read_text())["gpus"]]


def attach(daemons: MpsDaemons, gpu: str) -> socket.socket:
    client = socket.socket(socket.AF_UNIX)
    client.connect(str(daemons.pipe_dir(gpu) / "control"))
    client.sendall(b"fake_attach")
    assert b"attached\n" == client.recv(64)
    return client


FOUR = MpsSettings(replicas=4, active_thread_percentage=25, pinned_memory_mib=10240)
TWO = MpsSettings(replicas=2, active_thread_percentage=50, pinned_memory_mib=20480)


async def test_one_daemon_per_gpu_enforces_its_limits_in_exclusive_process_mode(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path
) -> None:
    node = await backend.observe()
    u0, u1 = (g.uuid for g in node.gpus)
    assert {u0: Outcome.APPLIED} == {
        u: r.outcome for u, r in (await daemons.enforce({u0: FOUR}, node)).items()
    }
    assert (25, [10240]) == limits(state, u0)
    assert None is limits(state, u1)
    assert [EXCLUSIVE_PROCESS, 0] == compute_modes(state)
    assert Readiness.READY is daemons.readiness(u0, FOUR)
    pid = record_of(state, u0)["pid"]  # type: ignore[index]
    again = await daemons.enforce({u0: FOUR}, await backend.observe())
    assert {u0: Outcome.UNCHANGED} == {u: r.outcome for u, r in again.items()}
    assert pid == record_of(state, u0)["pid"]  # type: ignore[index]


async def test_the_usage_reader_counts_each_mps_client_as_a_process_of_its_gpu(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path
) -> None:
    """An MPS client is listed by nvmlDeviceGetMPSComputeRunningProcesses, its server by
    nvmlDeviceGetComputeRunningProcesses: the usage reader reads both, so a pod using an MPS replica
    gets its own process's memory (the server's is no pod's)."""
    node = await backend.observe()
    u0, _ = (g.uuid for g in node.gpus)
    await daemons.enforce({u0: FOUR}, node)
    reader = backend.usage_reader()
    client = attach(daemons, u0)
    try:
        server = record_of(state, u0)["serverPid"]  # type: ignore[index]
        (device,) = reader.read().gpus[0].devices
        assert [server, os.getpid()] == [p.pid for p in device.processes or ()]
    finally:
        client.close()
        reader.close()


async def test_a_reload_restarts_only_the_daemon_whose_limits_changed(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path
) -> None:
    node = await backend.observe()
    u0, u1 = (g.uuid for g in node.gpus)
    await daemons.enforce({u0: FOUR, u1: FOUR}, node)
    pids = {u: record_of(state, u)["pid"] for u in (u0, u1)}  # type: ignore[index]
    done = await daemons.enforce({u0: FOUR, u1: TWO}, await backend.observe())
    assert {u0: Outcome.UNCHANGED, u1: Outcome.APPLIED} == {u: r.outcome for u, r in done.items()}
    assert pids[u0] == record_of(state, u0)["pid"]  # type: ignore[index]
    assert pids[u1] != record_of(state, u1)["pid"]  # type: ignore[index]
    assert [(25, [10240]), (50, [20480])] == [limits(state, u0), limits(state, u1)]


async def test_a_reload_waits_while_the_gpu_has_clients(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path
) -> None:
    node = await backend.observe()
    u0 = node.gpus[0].uuid
    await daemons.enforce({u0: FOUR}, node)
    client = attach(daemons, u0)
    try:
        busy = await backend.observe()
        assert busy.gpus[0].busy  # the MPS server is a compute process of the GPU
        waited = await daemons.enforce({u0: TWO}, busy)
        assert Outcome.BLOCKED is waited[u0].outcome
        assert "processes run on GPU 0" in waited[u0].reason
        assert (25, [10240]) == limits(state, u0)  # the clients' daemon is left alone
        assert (Readiness.READY, Readiness.PENDING) == (
            daemons.readiness(u0, FOUR),
            daemons.readiness(u0, TWO),
        )
    finally:
        client.close()
    poll("the client gone", lambda: has_clients(state), lambda b: not b)
    lingering = await backend.observe()
    assert lingering.gpus[0].busy  # its server stays without clients; the daemon's own, no user
    applied = await daemons.enforce({u0: TWO}, lingering)
    assert Outcome.APPLIED is applied[u0].outcome
    assert (50, [20480]) == limits(state, u0)


def has_clients(state: Path) -> bool:
    """Whether the GPU's daemon has clients, per its record."""
    return any(r["clients"] for r in records(state))


async def test_a_killed_daemon_is_down_until_it_is_started_again(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path
) -> None:
    node = await backend.observe()
    u0 = node.gpus[0].uuid
    await daemons.enforce({u0: FOUR}, node)
    assert not await daemons.check()
    os.kill(record_of(state, u0)["pid"], signal.SIGKILL)  # type: ignore[index]
    assert await daemons.check()
    assert Readiness.DOWN is daemons.readiness(u0, FOUR)
    assert [0] == [s.restarts for s in daemons.status()]
    restarted = await daemons.enforce({u0: FOUR}, await backend.observe())
    assert Outcome.APPLIED is restarted[u0].outcome
    assert Readiness.READY is daemons.readiness(u0, FOUR)
    assert [(1, True, Enforced(25, 10240))] == [(s.restarts, s.healthy, s.enforced) for s in daemons.status()]


async def test_a_gpu_no_longer_shared_with_mps_loses_its_daemon_and_exclusive_mode(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path
) -> None:
    node = await backend.observe()
    u0 = node.gpus[0].uuid
    await daemons.enforce({u0: FOUR}, node)
    stopped = await daemons.enforce({}, await backend.observe())
    assert {u0: Outcome.APPLIED} == {u: r.outcome for u, r in stopped.items()}
    poll("the daemon's record gone", lambda: records(state), lambda r: r == [])
    assert [0, 0] == compute_modes(state)
    assert () == daemons.status()


# ---- the rollout: advertised only once enforced; a daemon gone makes its replicas unhealthy ---


def mps(replicas: int, limits_: MpsLimits | None = None) -> SharingConfig:
    rule = Rule(Selector(indices=(0,)), MigMode.DISABLED, replicas=Replicas(replicas), sharing=Sharing.MPS,
                mps=limits_ or MpsLimits())  # fmt: skip
    return SharingConfig(name=f"mps-{replicas}", fail_requests_greater_than_one=True, rules=(rule,))


async def nothing() -> None:
    pass


@pytest.fixture
async def fake_kubelet(plugin_dir: Path) -> AsyncIterator[FakeKubelet]:
    k = await FakeKubelet(plugin_dir).start()
    yield k
    await k.stop()


@pytest.fixture
def rollout(backend: NvmlBackend, daemons: MpsDaemons, tmp_path: Path, fleet: Fleet) -> Rollout:
    return Rollout(backend=backend, fleet=fleet, catalog=CATALOG, journal=Journal(tmp_path / "j"),
                   pod_resources=None, mps=daemons)  # fmt: skip


async def test_mps_replicas_are_advertised_once_enforced_and_unhealthy_while_the_daemon_is_gone(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path, rollout: Rollout, fake_kubelet: FakeKubelet
) -> None:
    config = mps(4)
    verdict, after = await rollout.roll_out(config, await backend.observe(), nothing)
    assert ConfigState.SUCCESS is verdict.state
    await rollout.advertise(after, config)
    u0, u1 = (g.uuid for g in after.gpus)
    replicas = {f"{u0}::{n}": "Healthy" for n in range(4)}
    await fake_kubelet.wait(lambda: fake_kubelet.devices(GPU) == {**replicas, u1: "Healthy"})
    assert (25, [10240]) == limits(state, u0)  # 100 // 4, 40960 MiB // 4

    os.kill(record_of(state, u0)["pid"], signal.SIGKILL)  # type: ignore[index]
    assert await daemons.check()
    await rollout.republish()
    unhealthy = dict.fromkeys(replicas, "Unhealthy")
    await fake_kubelet.wait(lambda: fake_kubelet.devices(GPU) == {**unhealthy, u1: "Healthy"})

    verdict, after = await rollout.roll_out(config, await backend.observe(), nothing)
    await rollout.advertise(after, config)
    assert ConfigState.SUCCESS is verdict.state
    await fake_kubelet.wait(lambda: fake_kubelet.devices(GPU) == {**replicas, u1: "Healthy"})


async def test_a_new_layout_waits_for_the_clients_and_the_old_one_stays_advertised(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path, rollout: Rollout, fake_kubelet: FakeKubelet
) -> None:
    old = mps(4)
    _, after = await rollout.roll_out(old, await backend.observe(), nothing)
    await rollout.advertise(after, old)
    u0 = after.gpus[0].uuid
    client = attach(daemons, u0)
    try:
        new = mps(4, MpsLimits(active_thread_percentage=40))
        verdict, after = await rollout.roll_out(new, await backend.observe(), nothing)
        await rollout.advertise(after, new)
        assert ("ConfigApplyBlocked", frozenset({u0})) == (verdict.reason, verdict.blockers)
        assert "processes run on GPU 0 (MPS clients or others)" in verdict.message
        assert {u0} == rollout.mps_blocked
        assert (25, [10240]) == limits(state, u0)
        await fake_kubelet.wait(lambda: {f"{u0}::{n}" for n in range(4)} <= set(fake_kubelet.devices(GPU)))
    finally:
        client.close()
    poll("the client gone", lambda: has_clients(state), lambda b: not b)
    verdict, after = await rollout.roll_out(new, await backend.observe(), nothing)
    assert ConfigState.SUCCESS is verdict.state
    assert (40, [10240]) == limits(state, u0)


async def test_mig_waits_for_the_mps_clients_and_not_for_the_idle_server_they_leave(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path, rollout: Rollout
) -> None:
    _, after = await rollout.roll_out(mps(4), await backend.observe(), nothing)
    u0 = after.gpus[0].uuid
    rule = Rule(Selector(indices=(0,)), MigMode.ENABLED, instances=(("3g.20gb", 2),))
    mig = SharingConfig(name="mig", rules=(rule,))
    client = attach(daemons, u0)
    try:
        verdict, after = await rollout.roll_out(mig, await backend.observe(), nothing)
        assert ("ConfigApplyBlocked", frozenset({u0})) == (verdict.reason, verdict.blockers)
        assert (False, (25, [10240])) == (after.gpus[0].mig_enabled, limits(state, u0))
    finally:
        client.close()
    poll("the client gone", lambda: has_clients(state), lambda b: not b)
    lingering = await backend.observe()
    assert lingering.gpus[0].busy  # its idle server, which ends with the daemon
    verdict, after = await rollout.roll_out(mig, lingering, nothing)
    assert ConfigState.SUCCESS is verdict.state
    assert (True, [2, 0]) == (after.gpus[0].mig_enabled, [len(g.instances) for g in after.gpus])
    assert ([], [0, 0]) == (records(state), compute_modes(state))


async def test_allocate_hands_an_mps_replica_its_daemons_pipe_and_shared_memory(
    backend: NvmlBackend, rollout: Rollout, fake_kubelet: FakeKubelet
) -> None:
    config = mps(2)
    _, after = await rollout.roll_out(config, await backend.observe(), nothing)
    await rollout.advertise(after, config)
    u0 = after.gpus[0].uuid
    await fake_kubelet.wait(lambda: f"{u0}::1" in fake_kubelet.devices(GPU))
    got = await fake_kubelet.plugin(GPU).Allocate(
        api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=[f"{u0}::1"])])
    )
    response = got.container_responses[0]
    pipe = f"/mps/{u0}/pipe"
    assert {"NVIDIA_VISIBLE_DEVICES": u0, "CUDA_MPS_PIPE_DIRECTORY": pipe} == dict(response.envs)
    root = "/run/nvidia/mps"  # the fleet's default mpsRoot (the host directory mounted in the agent)
    assert [(pipe, f"{root}/{u0}/pipe", False), ("/dev/shm", f"{root}/shm", False)] == [
        (m.container_path, m.host_path, m.read_only) for m in response.mounts
    ]


# ---- the keeper: daemons it starts outlive the agent, which adopts them --------------------
# The keeper is a real `sharing mps-keeper` process; an agent that restarts is a new MpsDaemons (all it
# keeps is what the daemons answer). A real container restart is the node test's
# (tests/node/test_mps.py).


class Keeper:
    """A `sharing mps-keeper` process, its socket and its MPS root."""

    def __init__(self, proc: subprocess.Popen[bytes], where: Path) -> None:
        self.proc, self.socket, self.root = proc, where / "keeper.sock", where / "mps"


@pytest.fixture
def keeper(node_root: Path) -> Iterator[Keeper]:
    """The keeper over this process's fake driver (the same driver root and state as `backend`)."""
    where = Path(tempfile.mkdtemp(prefix="gs-mpsk-", dir="/tmp"))  # short: unix socket paths are limited
    with open(where / "keeper.log", "wb") as logs:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sharing", "mps-keeper", "--mps-keeper-socket", str(where / "keeper.sock"),
             "--driver-root", str(node_root), "--mps-root", str(where / "mps"), "--log-format", "json"],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=logs,
            stderr=logs,
        )  # fmt: skip
    kept = Keeper(proc, where)
    try:
        poll("the keeper's socket", kept.socket.is_socket, bool, 30)
        yield kept
    finally:
        for pipe in kept.root.glob("*/pipe"):
            env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
            subprocess.run(
                [str(node_root / CONTROL)],
                input=b"quit\n",
                env=env,
                capture_output=True,
                timeout=30,
                check=False,
            )
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(where, ignore_errors=True)


def agent(gpus: NvmlBackend, node_root: Path, kept: Keeper, socket: Path | None = None) -> MpsDaemons:
    """The agent's daemons, starting them through the keeper (at `socket`, by default its own)."""
    return MpsDaemons(kept.root, node_root / CONTROL, gpus.set_compute_mode, keeper=socket or kept.socket)


async def test_a_daemon_the_keeper_started_outlives_its_agent_and_is_adopted_without_a_restart(
    backend: NvmlBackend, node_root: Path, state: Path, keeper: Keeper
) -> None:
    node = await backend.observe()
    u0 = node.gpus[0].uuid
    first = agent(backend, node_root, keeper)
    assert {u0: Outcome.APPLIED} == {u: r.outcome for u, r in (await first.enforce({u0: FOUR}, node)).items()}
    started = record_of(state, u0)
    assert started is not None
    assert (25, [10240]) == limits(state, u0)
    # The daemon is the keeper's child (its subreaper, as PID 1 of its container is), not this
    # process's: whatever ends the agent's container leaves it.
    assert keeper.proc.pid == live_parent(started["pid"])
    client = attach(first, u0)
    try:
        attached = poll(
            "the client attached", lambda: record_of(state, u0), lambda r: bool(r and r["clients"])
        )
        del first  # the agent is gone; a new one knows only what the daemons answer
        second = agent(backend, node_root, keeper)
        busy = await backend.observe()
        assert busy.gpus[0].busy  # the client's MPS server
        adopted = await second.enforce({u0: FOUR}, busy)
        assert {u0: Outcome.UNCHANGED} == {u: r.outcome for u, r in adopted.items()}
        assert attached == record_of(state, u0)  # the same daemon and client, nothing told again
        assert Readiness.READY is second.readiness(u0, FOUR)
        assert [(0, True)] == [(s.restarts, s.healthy) for s in second.status()]
    finally:
        client.close()
    poll("the client gone", lambda: has_clients(state), lambda b: not b)
    stopped = await second.enforce({}, await backend.observe())
    assert {u0: Outcome.APPLIED} == {u: r.outcome for u, r in stopped.items()}
    # `quit` ended it; the keeper waited for it (a zombie would still have a /proc entry).
    poll("the daemon waited for", lambda: process(started["pid"]), lambda p: p is None, 30)


async def test_a_keeper_that_does_not_answer_fails_the_start_and_the_next_try_goes_through(
    backend: NvmlBackend, node_root: Path, state: Path, keeper: Keeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mpskeeper, "CONNECT_WAIT_S", 0.1)
    node = await backend.observe()
    u0 = node.gpus[0].uuid
    absent = keeper.socket.with_name("absent.sock")
    failed = (await agent(backend, node_root, keeper, absent).enforce({u0: FOUR}, node))[u0]
    assert Outcome.FAILED is failed.outcome
    assert f"the MPS keeper does not answer at {absent}" in failed.reason
    assert record_of(state, u0) is None
    daemons = agent(backend, node_root, keeper)
    hook = state.parent / "mps" / "refuse-start"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.touch()  # -d exits 1: the keeper answers its status, with nothing else taking it
    try:
        refused = (await daemons.enforce({u0: FOUR}, await backend.observe()))[u0]
    finally:
        hook.unlink()
    assert Outcome.FAILED is refused.outcome
    assert "nvidia-cuda-mps-control -d failed: " in refused.reason
    assert "the daemon could not start (fake driver: refuse-start)" in refused.reason
    retried = (await daemons.enforce({u0: FOUR}, await backend.observe()))[u0]
    assert Outcome.APPLIED is retried.outcome
    assert (25, [10240]) == limits(state, u0)
