"""On-demand MIG instances over the real pynvml and the fake driver: made at an exact placement,
destroyed only when free, and a prepare a killed agent left half-done rolled forward or back from
the claim checkpoint at start (the instances it owns adopted, nothing else touched); the MPS daemon
of a claim that shares its device with MPS ends with the claim, and one that dies is said and started
again (`sharing.rollout.mps.watch_claim_mps`) as a GPU's is."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from sharing.config import Frontend
from sharing.deviceplugin import Fleet
from sharing.devices import Inventory
from sharing.dra import ClaimError, ClaimKey, OnDemand, Prepared, Preparer
from sharing.dra.ondemand import InstanceBusyError, Placement, occupant, placement_of
from sharing.gpu import simstate
from sharing.gpu.devfiles import DriverFiles
from sharing.gpu.mps import MpsDaemons
from sharing.gpu.mpscontrol import CONTROL
from sharing.gpu.nvml import NvmlBackend
from sharing.gpu.nvmlapi import Nvml
from sharing.kube.api import AllocatedConfig, AllocatedDevice, PodReference, ResourceClaimObject
from sharing.kubelet import Holders
from sharing.mig import Outcome, Target
from sharing.mig.catalog import default_catalog
from sharing.model import GpuUuid, NodeState
from sharing.ops import Metrics, Reporter
from sharing.rollout.mps import watch_claim_mps
from sharing.store import ClaimCheckpoint, Journal, OwnedInstance, PreparedClaim, PreparedDevice
from tests.fakedriver.conftest import make_gpu_instance, sim
from tests.fakedriver.test_mps import attach, record_of
from tests.polling import poll, until

CATALOG = default_catalog()
A100 = next(p for p in CATALOG.products if p.name == "A100-SXM4-40GB")
PROFILE_ID = {"1g.5gb": 19, "2g.10gb": 14, "3g.20gb": 9, "7g.40gb": 0}
"""nvidia-smi IDs on an A100-SXM4-40GB (NVIDIA MIG user guide, supported profiles)."""


@pytest.fixture
async def backend(state: Path, nvml: Nvml) -> AsyncIterator[NvmlBackend]:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")] * 2)
    b = NvmlBackend(nvml, CATALOG, event_poll_s=0.01)
    for gpu in (await b.observe()).gpus:
        assert await b.set_mig_mode(gpu.uuid, True) is False
    yield b
    await b.close()


@pytest.fixture
def ondemand(backend: NvmlBackend, tmp_path: Path) -> OnDemand:
    return OnDemand(backend, Journal(tmp_path / "journal.jsonl"), lock_wait_s=0.5)


def instances(state: Path) -> list[list[tuple[int, int, int]]]:
    """Per GPU, (profile id, start, size) of every GPU instance, from the fake driver's own state."""
    data = json.loads(state.read_text())
    return [
        sorted((g["profileId"], g["start"], g["size"]) for g in gpu["gpuInstances"]) for gpu in data["gpus"]
    ]


async def place(ondemand: OnDemand, device: str) -> Placement:
    return placement_of(await ondemand.observe(), device)


async def test_made_at_exactly_the_allocated_placement(ondemand: OnDemand, state: Path) -> None:
    gi = await ondemand.create("ns/a", await place(ondemand, "gpu-1-mig-3g-20gb-at-4"))
    await ondemand.create("ns/b", await place(ondemand, "gpu-1-mig-1g-5gb-at-2"))
    assert ((gi.profile, gi.start, gi.size), len(gi.compute_instances)) == (("3g.20gb", 4, 4), 1)
    assert instances(state) == [[], sorted([(9, 4, 4), (19, 2, 1)])]
    assert not Journal(ondemand.journal.path).path.exists()


@pytest.mark.parametrize(
    ("device", "error"),
    [
        ("gpu-0-mig-3g-20gb-at-2", "3g.20gb cannot start at slot 2 on GPU 0 (the driver's placements: 0, 4)"),
        ("gpu-0-mig-5g-25gb-at-0", "GPU 0 has no MIG profile 5g-25gb (it has"),
        ("gpu-7-mig-1g-5gb-at-0", "this node has no GPU 7"),
    ],
    ids=["invalid-start", "unknown-profile", "no-such-gpu"],
)
async def test_a_placement_the_driver_does_not_offer_is_refused(
    ondemand: OnDemand, state: Path, device: str, error: str
) -> None:
    with pytest.raises(ClaimError) as err:
        await place(ondemand, device)
    assert error in str(err.value)
    assert instances(state) == [[], []]


async def test_a_taken_placement_is_the_claims_error_and_nothing_is_destroyed(
    ondemand: OnDemand, state: Path, nvml: Nvml
) -> None:
    make_gpu_instance(nvml, 0, PROFILE_ID["2g.10gb"], 4, 2)  # not ours: no claim owns it
    where = await place(ondemand, "gpu-0-mig-3g-20gb-at-4")
    with pytest.raises(ClaimError) as err:
        occupant(where, {}, "uid-a", "ns/a")
    assert "is taken: GPU instance 0 (2g.10gb at slot 4) is there, held by no claim of this agent" in str(
        err.value
    )
    # The driver refuses the overlap too (INSUFFICIENT_RESOURCES), and the instance stays.
    with pytest.raises(ClaimError):
        await ondemand.create("ns/a", where)
    assert instances(state) == [[(14, 4, 2)], []]


async def test_an_instance_with_processes_is_not_destroyed(ondemand: OnDemand, state: Path) -> None:
    gi = await ondemand.create("ns/a", await place(ondemand, "gpu-0-mig-1g-5gb-at-6"))
    gpu = (await ondemand.observe()).gpus[0].uuid
    simstate.set_busy(state, gi.compute_instances[0].uuid, True)
    with pytest.raises(InstanceBusyError):
        await ondemand.destroy("ns/a", gpu, gi)
    assert instances(state) == [[(19, 6, 1)], []]
    simstate.set_busy(state, gi.compute_instances[0].uuid, False)
    await ondemand.destroy("ns/a", gpu, gi)
    assert instances(state) == [[], []]


class NoApiServer:
    """Start-up recovery works from the checkpoint and the GPUs alone: it reads no claim."""

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject:
        raise AssertionError(f"recovery read claim {namespace}/{name}")


def preparer(ondemand: OnDemand, tmp_path: Path, node: NodeState, claims: Any = None) -> Preparer:
    return Preparer(
        pool="node-a",
        claims=claims or NoApiServer(),
        inventory=Inventory,
        node=lambda: node,
        files=DriverFiles(tmp_path / "driver"),
        cdi_dir=tmp_path / "cdi",
        checkpoint=ClaimCheckpoint(tmp_path / "claims.json"),
        ondemand=ondemand,
    )


def intent(uid: str, gpu: GpuUuid, profile: str, start: int, size: int, **ids: Any) -> PreparedClaim:
    """A claim whose prepare was killed after its intent reached the checkpoint."""
    device = PreparedDevice(
        requests=("mig",), pool="node-a", device=f"gpu-0-mig-{profile.replace('.', '-')}-at-{start}",
        uuid=ids.pop("uuid", ""), gpu_uuid=gpu, cdi_ids=(f"k8s.gpu.nvidia.com/claim={uid}-x",),
        instance=OwnedInstance(gpu, profile, start, size, **ids),
    )  # fmt: skip
    return PreparedClaim("ns", uid, uid, (device,), pending=not device.uuid)


async def test_restart_rolls_back_a_half_built_instance_and_forward_a_complete_one(
    ondemand: OnDemand, state: Path, nvml: Nvml, tmp_path: Path
) -> None:
    node = await ondemand.observe()
    gpu, other = node.gpus[0].uuid, node.gpus[1].uuid
    # Killed after the GPU instance, before its compute instance: half-built at 0.
    make_gpu_instance(nvml, 0, PROFILE_ID["3g.20gb"], 0, 4)
    # Killed after both, before the checkpoint had their IDs: complete at 4.
    done = await ondemand.create("ns/b", placement_of(node, "gpu-0-mig-2g-10gb-at-4"))
    # Killed before the first NVML call: nothing at 6. And one not ours at slot 6 of GPU 1.
    make_gpu_instance(nvml, 1, PROFILE_ID["1g.5gb"], 6, 1)
    # Prepared before the restart, with its instance: adopted.
    adopted = await ondemand.create("ns/d", placement_of(node, "gpu-1-mig-1g-5gb-at-0"))
    checkpoint = ClaimCheckpoint(tmp_path / "claims.json")
    mig = adopted.compute_instances[0]
    checkpoint.save({
        "a": intent("a", gpu, "3g.20gb", 0, 4),
        "b": intent("b", gpu, "2g.10gb", 4, 2),
        "c": intent("c", gpu, "1g.5gb", 6, 1),
        "d": intent("d", other, "1g.5gb", 0, 1, uuid=mig.uuid, gi_id=adopted.id, ci_id=mig.id),
    })  # fmt: skip
    p = preparer(ondemand, tmp_path, node)
    await p.load()

    assert instances(state) == [[(14, 4, 2)], [(19, 0, 1), (19, 6, 1)]]
    claims = checkpoint.load()
    assert sorted(claims) == ["b", "d"]
    b = claims["b"].devices[0]
    assert (claims["b"].pending, b.uuid, b.instance) == (
        False,
        done.compute_instances[0].uuid,
        OwnedInstance(gpu, "2g.10gb", 4, 2, done.id, done.compute_instances[0].id),
    )
    assert claims["d"] == intent("d", other, "1g.5gb", 0, 1, uuid=mig.uuid, gi_id=adopted.id, ci_id=mig.id)
    assert p.prepared().held() == {b.uuid, mig.uuid}


async def test_no_step_runs_while_the_rollout_changes_the_gpus(ondemand: OnDemand, state: Path) -> None:
    where = await place(ondemand, "gpu-0-mig-1g-5gb-at-0")
    # The rollout (or `sharing apply`) runs its steps.
    with Journal(ondemand.journal.path).locked(), pytest.raises(ClaimError) as err:
        await ondemand.create("ns/a", where)
    assert "the GPUs are being changed: another process (pid " in str(err.value)
    # A rollout killed half-way left its journal: its change is finished first.
    Journal(ondemand.journal.path).begin({GpuUuid(where.gpu.uuid): Target(True, (("7g.40gb", 1),))})
    with pytest.raises(ClaimError) as err:
        await ondemand.create("ns/a", where)
    assert "waits for the GPU change a killed agent left half-done" in str(err.value)
    assert (instances(state), Journal(ondemand.journal.path).unfinished() is not None) == ([[], []], True)


async def test_a_pending_prepare_on_a_gpu_that_cannot_be_read_is_left_as_it_is(
    ondemand: OnDemand, state: Path, nvml: Nvml, tmp_path: Path
) -> None:
    node = await ondemand.observe()
    gpu = node.gpus[1].uuid
    make_gpu_instance(nvml, 1, PROFILE_ID["3g.20gb"], 4, 4)  # half-built by a killed prepare
    checkpoint = ClaimCheckpoint(tmp_path / "claims.json")
    checkpoint.save({"a": intent("a", gpu, "3g.20gb", 4, 4)})
    simstate.set_lost(state, 1, True)
    p = preparer(ondemand, tmp_path, node)
    await p.load()
    simstate.set_lost(state, 1, False)

    # GPU 0 was read, so only the claim on GPU 1 waits; while it does, every device counts as held.
    assert "claim ns/a is being prepared (MIG instances being made)" == p.prepared().unknown
    assert ({"a": intent("a", gpu, "3g.20gb", 4, 4)}, [[], [(9, 4, 4)]]) == (
        checkpoint.load(),
        instances(state),
    )


class Claims:
    """The claims as the API server holds them (what prepare reads)."""

    def __init__(self, *claims: ResourceClaimObject) -> None:
        self.objects = {(c.namespace, c.name): c for c in claims}

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject:
        return self.objects[(namespace, name)]


def allocated(name: str, device: str) -> ResourceClaimObject:
    result = AllocatedDevice("mig", "gpu.nvidia.com", "node-a", device)
    return ResourceClaimObject("ns", name, f"uid-{name}", allocated=True, results=(result,))


async def test_a_prepare_waits_for_the_unprepare_of_the_claim_its_placement_was_given_from(
    ondemand: OnDemand, state: Path, tmp_path: Path
) -> None:
    """The scheduler hands a deallocated claim's slots to a new claim before the kubelet unprepares
    the old one: the new prepare waits for that unprepare instead of failing into the kubelet's backoff."""
    node = await ondemand.observe()
    claims = Claims(allocated("old", "gpu-0-mig-1g-5gb-at-0"), allocated("new", "gpu-0-mig-1g-5gb-at-0"))
    p = preparer(ondemand, tmp_path, node, claims)
    await p.load()
    assert "" == (await p.prepare([ClaimKey("ns", "old", "uid-old")]))["uid-old"].error
    new = asyncio.create_task(p.prepare([ClaimKey("ns", "new", "uid-new")]))
    await asyncio.sleep(0)  # a yield: the new prepare takes the lock and finds the slot held
    assert {"uid-old": ""} == await p.unprepare([ClaimKey("ns", "old", "uid-old")])
    answer = (await new)["uid-new"]
    assert ("", ["gpu-0-mig-1g-5gb-at-0"]) == (answer.error, [d.device for d in answer.devices])
    assert [[(19, 0, 1)], []] == instances(state)
    assert ["uid-new"] == [c.uid for c in p.prepared().claims]


# ---- MPS: the daemon of an on-demand MIG device a claim shares -------------------------------


def mps_claim(name: str, device: str) -> ResourceClaimObject:
    """A claim allocated `device` with NVIDIA's MigDeviceConfig asking for MPS, without limits."""
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
                  "sharing": {"strategy": "MPS"}}  # fmt: skip
    result = AllocatedDevice("mig", "gpu.nvidia.com", "node-a", device)
    config = AllocatedConfig("FromClaim", ("mig",), "gpu.nvidia.com", parameters)
    return ResourceClaimObject("ns", name, f"uid-{name}", True, (result,), (config,))


@pytest.fixture
async def daemons(backend: NvmlBackend, node_root: Path) -> AsyncIterator[MpsDaemons]:
    root = Path(tempfile.mkdtemp(prefix="gs-mps-", dir="/tmp"))  # short: unix socket paths are limited
    d = MpsDaemons(root, node_root / CONTROL, backend.set_compute_mode)
    yield d
    for pipe in root.glob("*/pipe"):  # what a failed test left
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
        subprocess.run(
            [str(d.control)], input=b"quit\n", env=env, capture_output=True, timeout=30, check=False
        )
    shutil.rmtree(root, ignore_errors=True)


async def prepared_mps(
    backend: NvmlBackend, daemons: MpsDaemons, tmp_path: Path, device: str
) -> tuple[Preparer, Prepared]:
    """MPS claim `a`, allocated `device`, prepared by an agent with MPS daemons: its preparer and the
    prepare's answer for it."""
    ondemand = OnDemand(backend, Journal(tmp_path / "journal.jsonl"), lock_wait_s=0.5, mps=daemons)
    p = preparer(ondemand, tmp_path, await ondemand.observe(), Claims(mps_claim("a", device)))
    await p.load()
    return p, (await p.prepare([ClaimKey("ns", "a", "uid-a")]))["uid-a"]


async def test_an_mps_claim_on_an_agent_without_mps_daemons_fails_before_anything_is_made(
    ondemand: OnDemand, state: Path, tmp_path: Path
) -> None:
    p = preparer(
        ondemand, tmp_path, await ondemand.observe(), Claims(mps_claim("a", "gpu-0-mig-3g-20gb-at-0"))
    )
    await p.load()
    answer = (await p.prepare([ClaimKey("ns", "a", "uid-a")]))["uid-a"]
    assert "claim ns/a: it asks for MPS, and this agent runs no MPS control daemons" == answer.error
    assert ([[], []], {}) == (instances(state), ClaimCheckpoint(tmp_path / "claims.json").load())


async def test_the_daemon_of_an_mps_claim_whose_instance_went_is_stopped_at_unprepare(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path, tmp_path: Path
) -> None:
    p, answer = await prepared_mps(backend, daemons, tmp_path, "gpu-1-mig-1g-5gb-at-3")
    assert "" == answer.error
    (mig,) = (d.uuid for d in answer.devices)
    daemon = record_of(state, mig)
    assert daemon is not None
    memory = A100.require_profile("1g.5gb").memory_mib  # no limits: every thread, the whole device
    assert (100, [memory]) == (daemon["activeThreadPercentage"], daemon["pinnedMemLimitMiB"])
    with simstate.editing(state) as gpus:  # a GPU reset took the instance away
        gpus["gpus"][1]["gpuInstances"] = []
    assert {"uid-a": ""} == await p.unprepare([ClaimKey("ns", "a", "uid-a")])
    assert (None, False) == (record_of(state, mig), (daemons.root / mig).exists())


async def test_an_mps_claims_idle_server_goes_with_its_daemon_and_one_with_a_client_keeps_the_instance(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path, tmp_path: Path
) -> None:
    p, answer = await prepared_mps(backend, daemons, tmp_path, "gpu-0-mig-3g-20gb-at-4")
    assert "" == answer.error
    (mig,) = (d.uuid for d in answer.devices)
    client = attach(daemons, mig)
    try:
        refused = (await p.unprepare([ClaimKey("ns", "a", "uid-a")]))["uid-a"]
        assert f"still has processes running on it (MPS clients, PIDs {os.getpid()})" in refused
        daemon = record_of(state, mig)
        assert daemon is not None
        assert daemon["serverPid"]
        assert [[(9, 4, 4)], []] == instances(state)
    finally:
        client.close()
    # The client has gone; its server stays, a process of the MIG device for NVML, until `quit`.
    idle = poll(
        "the client gone", lambda: record_of(state, mig), lambda r: r is not None and not r["clients"]
    )
    assert daemon["serverPid"] == idle["serverPid"]
    lingering = await backend.observe()
    assert [True] == [ci.busy for gi in lingering.gpus[0].instances for ci in gi.compute_instances]
    assert {"uid-a": ""} == await p.unprepare([ClaimKey("ns", "a", "uid-a")])
    assert ([[], []], None, False) == (instances(state), record_of(state, mig), (daemons.root / mig).exists())


def compute_modes(state: Path, gpu: int) -> list[int]:
    """The compute mode of each compute instance of GPU `gpu`, from the fake driver's own state."""
    data = json.loads(state.read_text())["gpus"][gpu]
    return [ci.get("computeMode", 0) for gi in data["gpuInstances"] for ci in gi["computeInstances"]]


async def test_an_mps_claim_on_an_adopted_instance_leaves_it_in_its_own_mode_without_a_daemon(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path, tmp_path: Path
) -> None:
    gpu = (await backend.observe()).gpus[0].uuid
    foreign = await backend.create_instance(gpu, "3g.20gb", 4)  # made outside the agent: adopted
    mig = foreign.compute_instances[0].uuid
    p, answer = await prepared_mps(backend, daemons, tmp_path, "gpu-0-mig-3g-20gb-at-4")
    assert ("", [mig]) == (answer.error, [d.uuid for d in answer.devices])
    assert record_of(state, mig) is not None
    assert [3] == compute_modes(state, 0)  # EXCLUSIVE_PROCESS while its daemon serves (nvml.h)
    attach(daemons, mig).close()
    poll("the client gone", lambda: record_of(state, mig), lambda r: r is not None and not r["clients"])

    assert {"uid-a": ""} == await p.unprepare([ClaimKey("ns", "a", "uid-a")])

    # Its daemon (and the server it left) gone, its mode as it was, the instance kept: it is not ours.
    assert (None, [0], [[(9, 4, 4)], []]) == (
        record_of(state, mig),
        compute_modes(state, 0),
        instances(state),
    )


@pytest.fixture
async def watched(
    backend: NvmlBackend, daemons: MpsDaemons, tmp_path: Path
) -> AsyncIterator[tuple[Preparer, str, list[tuple[str, str, str]]]]:
    """An MPS claim prepared on a 3g.20gb, its MIG device, and the Events the watch of its daemon says."""
    p, answer = await prepared_mps(backend, daemons, tmp_path, "gpu-0-mig-3g-20gb-at-4")
    assert "" == answer.error
    (mig,) = (d.uuid for d in answer.devices)
    events: list[tuple[str, str, str]] = []

    async def event(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    watch = asyncio.create_task(
        watch_claim_mps(
            daemons, every_s=0.02, observe=backend.observe, claims=lambda: p.prepared().claims, event=event
        )
    )
    try:
        yield p, mig, events
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


DOWN = "the MPS control daemon of MIG device {} (claim ns/a) does not answer: "
DOWN += "the claim's pods reach no MPS server until it is started again"


async def test_a_killed_daemon_of_an_mps_claim_is_said_started_again_and_counted(
    watched: tuple[Preparer, str, list[tuple[str, str, str]]], daemons: MpsDaemons, state: Path
) -> None:
    p, mig, events = watched
    before = record_of(state, mig)
    assert before is not None
    os.kill(before["pid"], signal.SIGKILL)
    back = (
        "Normal",
        "MpsDaemonHealthy",
        f"the MPS control daemon of MIG device {mig} (claim ns/a) answers again",
    )
    await until("the daemon answering again", lambda: back in events)
    assert [("Warning", "MpsDaemonDown", DOWN.format(mig)), back] == events
    after = record_of(state, mig)
    assert after is not None
    assert after["pid"] != before["pid"]
    limits = ("activeThreadPercentage", "pinnedMemLimitMiB")
    assert [before[k] for k in limits] == [after[k] for k in limits]  # the claim's limits again
    assert [(mig, 1, True)] == [(s.gpu, s.restarts, s.healthy) for s in daemons.status()]
    assert {"uid-a": ""} == await p.unprepare([ClaimKey("ns", "a", "uid-a")])
    assert (None, ()) == (record_of(state, mig), daemons.status())  # its figures go with the claim


async def test_the_daemon_of_a_device_with_processes_waits_for_them_to_end(
    watched: tuple[Preparer, str, list[tuple[str, str, str]]], daemons: MpsDaemons, state: Path
) -> None:
    _, mig, events = watched
    before = record_of(state, mig)
    assert before is not None
    sim(state, "busy", "--uuid", mig)  # a process that is no client of its daemon runs on the device
    with structlog.testing.capture_logs() as logs:
        os.kill(before["pid"], signal.SIGKILL)

        def waited() -> bool:
            return any(e.get("outcome") == "blocked" and e.get("mig") == mig for e in logs)

        await until("a look that found processes on the device", waited)
    assert [("Warning", "MpsDaemonDown", DOWN.format(mig))] == events
    assert (None, [0]) == (record_of(state, mig), [s.restarts for s in daemons.status()])
    sim(state, "idle", "--uuid", mig)
    back = (
        "Normal",
        "MpsDaemonHealthy",
        f"the MPS control daemon of MIG device {mig} (claim ns/a) answers again",
    )
    await until("the daemon started again", lambda: back in events)
    assert record_of(state, mig) is not None
    assert [1] == [s.restarts for s in daemons.status()]


class DynamicNode:
    """What the report reads of the hardware side (`sharing.ops.report.Hardware`): the fake driver's
    GPUs as last observed, both dynamic, and the DRA plugin's own checkpoint."""

    def __init__(self, node: NodeState, preparer: Preparer) -> None:
        self.node, self.preparer = node, preparer
        self.frontend = Frontend.DRA
        self.mps = None
        self.dra = self

    def room(self) -> tuple[Any, ...]:
        return ()

    def foreign(self) -> tuple[Any, ...]:
        return ()

    def recorded(self) -> tuple[PreparedClaim, ...]:
        return self.preparer.prepared().claims

    def offered(self) -> Inventory:
        return Inventory(dynamic=frozenset(g.uuid for g in self.node.gpus))

    async def holders(self, *, deciding: bool = True) -> Holders:
        return Holders()


async def test_sharing_status_shows_the_claims_instance_with_its_pods_and_its_daemon_and_the_metrics_count_it(
    backend: NvmlBackend, daemons: MpsDaemons, state: Path, tmp_path: Path, fleet: Fleet
) -> None:
    ondemand = OnDemand(backend, Journal(tmp_path / "journal.jsonl"), lock_wait_s=0.5, mps=daemons)
    pods = (PodReference("p1", "u1"), PodReference("p2", "u2"))
    claim = dataclasses.replace(mps_claim("a", "gpu-0-mig-3g-20gb-at-4"), reserved_for=pods)
    p = preparer(ondemand, tmp_path, await ondemand.observe(), Claims(claim))
    await p.load()
    (mig,) = (d.uuid for d in (await p.prepare([ClaimKey("ns", "a", "uid-a")]))["uid-a"].devices)
    first = record_of(state, mig)
    assert first is not None
    os.kill(first["pid"], signal.SIGKILL)
    assert Outcome.APPLIED is (await daemons.restart(mig, await backend.observe())).outcome
    metrics = Metrics("test")
    report = Reporter("node-a", DynamicNode(await backend.observe(), p), fleet, metrics, claim_mps=daemons)
    (made,) = (await report.status())["gpus"][0]["slices"]
    claims = [{"namespace": "ns", "name": "a", "pods": ["ns/p1", "ns/p2"]}]
    assert (
        "nvidia.com/mig-3g.20gb", mig, "3g.20gb", claims,
        {"device": "gpu-0-mig-3g-20gb-at-4", "start": 4, "made": True},
    ) == (made["resource"], made["id"], made["profile"], made["claims"], made["onDemand"])  # fmt: skip
    memory = A100.require_profile("3g.20gb").memory_mib  # no limits: every thread, the whole device
    assert (True, 1, 100, memory) == (
        made["mps"]["healthy"], made["mps"]["restarts"], made["mps"]["activeThreadPercentage"],
        made["mps"]["pinnedMemoryMiB"],
    )  # fmt: skip
    lines = metrics.render().decode().splitlines()
    assert f'gpu_sharing_mps_daemon_restarts_total{{gpu="0",uuid="{mig}"}} 1.0' in lines
    assert f'gpu_sharing_mps_daemon_healthy{{gpu="0",uuid="{mig}"}} 1.0' in lines
    assert {"uid-a": ""} == await p.unprepare([ClaimKey("ns", "a", "uid-a")])
