"""MIG instances the agent did not make, on dynamic GPUs of the fake driver under the real pynvml: offered
as the device of their placement, adopted by the claim allocated it (nothing made, its MIG device in
the CDI spec), left by its unprepare and by a restart's recovery, and destroyed only with
`reclaimForeign: idle` when idle and unclaimed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from sharing.devices import Inventory
from sharing.dra import ClaimKey, OnDemand, Preparer, frontend
from sharing.dra.foreign import foreign_instances
from sharing.dra.frontend import DraFrontEnd
from sharing.dra.partitions import partitionable_slices
from sharing.dra.plugin import DraPaths
from sharing.gpu import simstate
from sharing.gpu.devfiles import DriverFiles
from sharing.gpu.nvml import NvmlBackend
from sharing.gpu.nvmlapi import Nvml
from sharing.kube.api import ResourceClaimObject
from sharing.mig.catalog import default_catalog
from sharing.model import ClaimAllocation, GpuInstance, NodeState
from sharing.store import ClaimCheckpoint, Journal, OwnedInstance, PreparedClaim, PreparedDevice
from tests.fakedriver.test_ondemand import Claims, allocated, instances
from tests.unit.conftest import plugin_dir  # noqa: F401  (the fixture)
from tests.unit.fakekube import FakeKube
from tests.unit.test_dra_registration import held, notify

CATALOG = default_catalog()


@pytest.fixture
async def backend(state: Path, nvml: Nvml) -> AsyncIterator[NvmlBackend]:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "A100-SXM4-40GB")] * 2)
    b = NvmlBackend(nvml, CATALOG, event_poll_s=0.01)
    for gpu in (await b.observe()).gpus:
        assert await b.set_mig_mode(gpu.uuid, True) is False
    yield b
    await b.close()


def preparer(backend: NvmlBackend, tmp_path: Path, *claims: ResourceClaimObject) -> Preparer:
    return Preparer(
        pool="node-a",
        claims=Claims(*claims),
        inventory=Inventory,
        node=lambda: NodeState(()),
        files=DriverFiles(tmp_path / "driver"),
        cdi_dir=tmp_path / "cdi",
        checkpoint=ClaimCheckpoint(tmp_path / "claims.json"),
        ondemand=OnDemand(backend, Journal(tmp_path / "journal.jsonl"), lock_wait_s=0.5),
    )


async def someone_makes(backend: NvmlBackend, gpu: int, profile: str, start: int) -> GpuInstance:
    """An instance made outside the agent (a static config, mig-parted, nvidia-smi): one whole MIG device."""
    return await backend.create_instance((await backend.observe()).gpus[gpu].uuid, profile, start)


async def test_a_claim_on_a_foreign_instance_gets_it_nothing_is_made_and_its_unprepare_leaves_it(
    backend: NvmlBackend, state: Path, tmp_path: Path
) -> None:
    foreign = await someone_makes(backend, 0, "3g.20gb", 4)
    mig = foreign.compute_instances[0].uuid
    node = await backend.observe()
    names = [
        d.name
        for s in partitionable_slices("n", node, {g.uuid for g in node.gpus}, CATALOG)
        for d in s.devices
    ]
    assert "gpu-0-mig-3g-20gb-at-4" == names[0]
    assert {"gpu-0-mig-7g-40gb-at-0", "gpu-0-mig-1g-5gb-at-4", "gpu-0-mig-2g-10gb-at-6"}.isdisjoint(names)
    a, b = allocated("a", "gpu-0-mig-3g-20gb-at-4"), allocated("b", "gpu-0-mig-3g-20gb-at-4")
    p = preparer(backend, tmp_path, a, b)
    await p.load()
    before = simstate.counters(state).mutations

    answer = (await p.prepare([ClaimKey("ns", "a", "uid-a")]))["uid-a"]

    assert ("", [mig]) == (answer.error, [d.uuid for d in answer.devices])
    assert (before, [[(9, 4, 4)], []]) == (simstate.counters(state).mutations, instances(state))
    spec = json.loads(next((tmp_path / "cdi").glob("*uid-a.json")).read_text())
    assert any(mig in env for d in spec["devices"] for env in d["containerEdits"]["env"])
    gpu = node.gpus[0].uuid
    assert ClaimCheckpoint(tmp_path / "claims.json").load()["uid-a"].devices[0].instance == OwnedInstance(
        gpu, "3g.20gb", 4, 4, foreign.id, foreign.compute_instances[0].id, foreign=True
    )
    [f] = foreign_instances(await backend.observe(), {gpu}, p.prepared().claims, CATALOG)
    assert (f.device, f.claim) == ("gpu-0-mig-3g-20gb-at-4", "ns/a")

    assert {"uid-a": ""} == await p.unprepare([ClaimKey("ns", "a", "uid-a")])
    assert (before, [[(9, 4, 4)], []], {}) == (
        simstate.counters(state).mutations,
        instances(state),
        ClaimCheckpoint(tmp_path / "claims.json").load(),
    )
    # Offered again, and the next claim gets the same MIG device.
    answer = (await p.prepare([ClaimKey("ns", "b", "uid-b")]))["uid-b"]
    assert ("", [mig]) == (answer.error, [d.uuid for d in answer.devices])


def intent(uid: str, gpu: str, gi: GpuInstance) -> PreparedClaim:
    """A claim whose prepare was killed after its intent (adopting `gi`) reached the checkpoint."""
    device = PreparedDevice(
        requests=("mig",), pool="node-a", device=f"gpu-0-mig-3g-20gb-at-{gi.start}", uuid="", gpu_uuid=gpu,
        cdi_ids=(f"k8s.gpu.nvidia.com/claim={uid}-x",),
        instance=OwnedInstance(gpu, gi.profile, gi.start, gi.size, gi.id, None, foreign=True),
    )  # fmt: skip
    return PreparedClaim("ns", uid, uid, (device,), pending=True)


async def test_a_restart_after_a_killed_adoption_keeps_the_foreign_instance_and_destroys_nothing(
    backend: NvmlBackend, state: Path, tmp_path: Path
) -> None:
    whole = await someone_makes(backend, 0, "3g.20gb", 4)
    emptied = await someone_makes(backend, 0, "3g.20gb", 0)
    gpu = (await backend.observe()).gpus[0].uuid
    # Someone takes the compute instance of the second one while the agent is down.
    with simstate.editing(state) as data:
        next(g for g in data["gpus"][0]["gpuInstances"] if g["id"] == emptied.id)["computeInstances"] = []
    checkpoint = ClaimCheckpoint(tmp_path / "claims.json")
    checkpoint.save({"a": intent("a", gpu, whole), "b": intent("b", gpu, emptied)})
    p = preparer(backend, tmp_path)
    await p.load()

    assert [[(9, 0, 4), (9, 4, 4)], []] == instances(state)  # nothing destroyed
    claims = checkpoint.load()
    assert ["a"] == sorted(claims)  # rolled forward: the adopted one; the other is not the claim's
    assert (False, whole.compute_instances[0].uuid, True) == (
        claims["a"].pending,
        claims["a"].devices[0].uuid,
        claims["a"].devices[0].instance is not None and claims["a"].devices[0].instance.foreign,
    )


async def test_reclaim_foreign_idle_destroys_idle_unclaimed_instances_only_and_their_room_is_offered(
    backend: NvmlBackend, state: Path, tmp_path: Path
) -> None:
    await someone_makes(backend, 0, "3g.20gb", 4)
    await someone_makes(backend, 0, "2g.10gb", 0)  # adopted by claim a
    busy = await someone_makes(backend, 1, "1g.5gb", 0)
    await someone_makes(backend, 1, "1g.5gb", 6)  # a claim is allocated it, not prepared yet
    await someone_makes(backend, 1, "2g.10gb", 2)  # on a GPU whose rule does not reclaim
    simstate.set_busy(state, busy.compute_instances[0].uuid, True)
    node = await backend.observe()
    gpu0, gpu1 = node.gpus[0].uuid, node.gpus[1].uuid
    p = preparer(backend, tmp_path, allocated("a", "gpu-0-mig-2g-10gb-at-0"))
    await p.load()
    assert "" == (await p.prepare([ClaimKey("ns", "a", "uid-a")]))["uid-a"].error
    waiting = ["gpu-1-mig-1g-5gb-at-6"]

    assert 1 == await p.reclaim_foreign({gpu0}, waiting, CATALOG)
    assert [[(14, 0, 2)], [(14, 2, 2), (19, 0, 1), (19, 6, 1)]] == instances(state)
    # GPU 1's rule reclaims too: its idle 2g.10gb goes; the busy 1g.5gb and the allocated one stay.
    assert 1 == await p.reclaim_foreign({gpu0, gpu1}, waiting, CATALOG)
    assert [[(14, 0, 2)], [(19, 0, 1), (19, 6, 1)]] == instances(state)

    simstate.set_busy(state, busy.compute_instances[0].uuid, False)
    assert 1 == await p.reclaim_foreign({gpu0, gpu1}, waiting, CATALOG)
    assert [[(14, 0, 2)], [(19, 6, 1)]] == instances(state)
    node = await backend.observe()
    names = {d.name for s in partitionable_slices("n", node, {gpu0}, CATALOG) for d in s.devices}
    assert {"gpu-0-mig-3g-20gb-at-4", "gpu-0-mig-1g-5gb-at-4"} <= names  # the reclaimed room: on demand
    assert not Journal(tmp_path / "journal.jsonl").path.exists()


async def test_nothing_is_reclaimed_while_the_checkpoint_cannot_say_which_instances_are_the_claims(
    backend: NvmlBackend, state: Path, tmp_path: Path
) -> None:
    await someone_makes(backend, 0, "3g.20gb", 4)
    (tmp_path / "claims.json").write_text("not a checkpoint")
    p = preparer(backend, tmp_path)
    await p.load()
    assert 0 == await p.reclaim_foreign({(await backend.observe()).gpus[0].uuid}, (), CATALOG)
    assert [[(9, 4, 4)], []] == instances(state)


async def test_reclaim_withdraws_the_devices_reads_the_nodes_claims_and_destroys_only_what_none_is_allocated(
    backend: NvmlBackend,
    state: Path,
    tmp_path: Path,
    plugin_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`reclaimForeign: idle` as any change: the devices of the idle foreign instances withdrawn from the
    pool first, the claims of the node's pods read once the API server holds that (and the scheduler's
    window is over), and an instance a claim is allocated (its pod bound, not prepared yet) kept."""
    monkeypatch.setattr(frontend, "SCHEDULER_WINDOW_S", 0.01)
    await someone_makes(backend, 0, "3g.20gb", 4)
    await someone_makes(backend, 0, "1g.5gb", 0)
    kube = FakeKube("node-a", {})
    seen: list[set[str]] = []
    claimed = ["gpu-0-mig-3g-20gb-at-4"]

    async def node_claims() -> tuple[ClaimAllocation, ...]:
        seen.append({d.name for s in kube.slices.values() for d in s.spec.devices})
        return (ClaimAllocation("ns", "c", "uid-c", tuple(claimed), ("ns/p",)),) if claimed else ()

    front = DraFrontEnd(
        kube=cast(Any, kube), node_name="node-a", files=DriverFiles(tmp_path / "driver"),
        cdi_dir=tmp_path / "cdi", catalog=CATALOG,
        paths=DraPaths(plugin_dir / "plugins", plugin_dir / "plugins_registry"),
        ondemand=OnDemand(backend, Journal(tmp_path / "journal.jsonl"), lock_wait_s=0.5),
        node_claims=node_claims,
    )  # fmt: skip
    await front.start()
    try:
        await notify(front.plugin)
        gpu0 = (await backend.observe()).gpus[0].uuid
        inventory = Inventory(dynamic=frozenset({gpu0}), reclaim=frozenset({gpu0}))
        assert "" == await front.publish(inventory, await backend.observe())
        assert {"gpu-0-mig-3g-20gb-at-4", "gpu-0-mig-1g-5gb-at-0"} <= held(kube)  # offered as they are

        assert True is await front.follow_node()

        (before_read,) = seen
        assert not {"gpu-0-mig-3g-20gb-at-4", "gpu-0-mig-1g-5gb-at-0"} & before_read  # withdrawn first
        assert [[(9, 4, 4)], []] == instances(state)  # the allocated one kept, the other destroyed
        assert "gpu-0-mig-3g-20gb-at-4" in held(kube)  # offered again, for the claim to adopt
        claimed.clear()  # its claim was deleted
        assert True is await front.follow_node()
        assert [[], []] == instances(state)
        assert "gpu-0-mig-7g-40gb-at-0" in held(kube)
        assert not Journal(tmp_path / "journal.jsonl").path.exists()
    finally:
        await front.stop()
