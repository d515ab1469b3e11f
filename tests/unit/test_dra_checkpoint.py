"""The DRA claim checkpoint: round trip, strict reading, and a preparer that fails closed without it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sharing.devices import MpsSettings
from sharing.devices.inventory import build_inventory
from sharing.dra import ClaimKey, Preparer
from sharing.dra.names import DRIVER
from sharing.gpu.devfiles import DriverFiles
from sharing.kube.api import AllocatedDevice, PodReference, ResourceClaimObject
from sharing.model import Gpu, GpuUuid, NodeState
from sharing.store import (
    CheckpointCorruptError,
    CheckpointError,
    ClaimCheckpoint,
    OwnedInstance,
    PreparedClaim,
    PreparedDevice,
    PreparedPod,
)
from tests.unit.fakekube import FakeKube

CLAIM = PreparedClaim(
    "ns",
    "c",
    "0b7d6f4e-1111-2222-3333-444455556666",
    (
        PreparedDevice(
            ("gpu",), "node-a", "gpu-0", "GPU-0", "GPU-0", ("k8s.gpu.nvidia.com/claim=0b7d-gpu-0",), "share-1"
        ),
    ),
    (PreparedPod("p", "pod-uid"),),
)
MADE = PreparedClaim(
    "ns",
    "m",
    "1c8e7a5f-1111-2222-3333-444455556666",
    (
        PreparedDevice(
            ("mig",), "node-a", "gpu-0-mig-3g-20gb-at-4", "MIG-1", "GPU-0", ("k8s.gpu.nvidia.com/claim=x",),
            instance=OwnedInstance("GPU-0", "3g.20gb", 4, 4, 2, 0), mps=MpsSettings(1, 50, 4096),
        ),
        PreparedDevice(
            ("mig",), "node-a", "gpu-0-mig-1g-5gb-at-0", "", "GPU-0", ("k8s.gpu.nvidia.com/claim=1c8e-y",),
            instance=OwnedInstance("GPU-0", "1g.5gb", 0, 1),
        ),
    ),
    pending=True,
)  # fmt: skip
"""A claim whose prepare was making its on-demand instances: one made (shared with MPS), one not yet."""
NODE = NodeState((Gpu(0, GpuUuid("GPU-0"), "NVIDIA A100-SXM4-40GB", 40960, True, False, False, minor=0),))


def test_round_trip(tmp_path: Path) -> None:
    checkpoint = ClaimCheckpoint(tmp_path / "claims.json")
    assert {} == checkpoint.load()
    checkpoint.save({CLAIM.uid: CLAIM, MADE.uid: MADE})
    assert {CLAIM.uid: CLAIM, MADE.uid: MADE} == ClaimCheckpoint(tmp_path / "claims.json").load()
    checkpoint.save({})
    assert {} == checkpoint.load()
    assert ["claims.json"] == sorted(p.name for p in tmp_path.iterdir())  # no temp file left


DEVICE = {
    "requests": ["gpu"], "pool": "node-a", "device": "gpu-0", "uuid": "GPU-0", "gpuUUID": "GPU-0",
    "cdiDeviceIDs": [], "shareID": None, "adminAccess": False,
}  # fmt: skip
INSTANCE = {
    "gpuUUID": "GPU-0", "profile": "3g.20gb", "start": 4, "size": 4, "gpuInstance": 1, "computeInstance": 0
}  # fmt: skip


def entry(**changes: object) -> bytes:
    good = {"namespace": "ns", "name": "c", "pods": [], "devices": [DEVICE]}
    good.update(changes)
    return json.dumps({"version": 1, "claims": {"uid-1": good}}).encode()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        pytest.param(b"\xff\xfe", "not UTF-8 text at byte 0", id="binary"),
        pytest.param(b"[]", "the file is not an object", id="not-an-object"),
        pytest.param(b'{"version": 2, "claims": {}}', "version 2, expected 1", id="version"),
        pytest.param(entry(name=3), "claims.uid-1.name is not a string", id="wrong-type"),
        pytest.param(entry(devices=[{}]), "claims.uid-1.devices[0]: shareID is missing", id="missing-key"),
        pytest.param(entry(pods={}), "claims.uid-1.pods is not a list", id="pods-not-a-list"),
        pytest.param(entry(pending="yes"), "claims.uid-1.pending is not a boolean", id="pending-not-a-bool"),
        pytest.param(
            entry(devices=[{**DEVICE, "instance": {**INSTANCE, "start": "4"}}]),
            "claims.uid-1.devices[0].instance.start is not an integer",
            id="instance-start",
        ),
        pytest.param(
            entry(devices=[{**DEVICE, "instance": {**INSTANCE, "gpuInstance": True}}]),
            "claims.uid-1.devices[0].instance: gpuInstance/computeInstance is not an integer",
            id="instance-id",
        ),
        pytest.param(
            entry(devices=[{**DEVICE, "mps": {"activeThreadPercentage": "50", "pinnedMemoryMiB": 1}}]),
            "claims.uid-1.devices[0].mps.activeThreadPercentage is not an integer",
            id="mps-threads",
        ),
    ],
)
def test_a_corrupt_checkpoint_is_an_error_that_names_it_and_keeps_it(
    tmp_path: Path, content: bytes, why: str
) -> None:
    path = tmp_path / "claims.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointCorruptError) as err:
        ClaimCheckpoint(path).load()
    assert str(err.value).startswith(f"the DRA claim checkpoint {path} is not one this agent writes ({why});")
    assert content == path.read_bytes()  # left for a person to look at, never overwritten


def test_a_directory_in_its_place_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / "claims.json").mkdir()
    with pytest.raises(CheckpointCorruptError, match="a directory, not a regular file"):
        ClaimCheckpoint(tmp_path / "claims.json").load()


def preparer(tmp_path: Path, kube: FakeKube, checkpoint: Path) -> Preparer:
    return Preparer(
        pool="node-a",
        claims=kube,
        inventory=lambda: build_inventory(NODE, None),
        node=lambda: NODE,
        files=DriverFiles(tmp_path / "root"),
        cdi_dir=tmp_path / "cdi",
        checkpoint=ClaimCheckpoint(checkpoint),
    )


def kube_with_claim(uid: str) -> FakeKube:
    kube = FakeKube("node-a", {})
    kube.claims[("ns", "c")] = ResourceClaimObject(
        "ns",
        "c",
        uid,
        True,
        (AllocatedDevice("gpu", DRIVER, "node-a", "gpu-0"),),
        (),
        (PodReference("p", "u"),),
    )
    return kube


UID = "0b7d6f4e-1111-2222-3333-444455556666"


async def test_an_unreadable_checkpoint_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "claims.json"
    path.write_text("junk")
    prep = preparer(tmp_path, kube_with_claim(UID), path)
    await prep.load()

    assert prep.prepared().unknown.startswith(f"the DRA claim checkpoint {path} is not one this agent writes")
    answer = await prep.prepare([ClaimKey("ns", "c", UID)])
    assert answer[UID].error.startswith(f"claim ns/c is not prepared: the DRA claim checkpoint {path}")
    assert () == answer[UID].devices
    assert not (tmp_path / "cdi").exists()
    # Unprepare still works (it needs only the claim's CDI spec, named by its UID): pods can end.
    assert {UID: ""} == await prep.unprepare([ClaimKey("ns", "c", UID)])
    assert "junk" == path.read_text()


async def test_a_checkpoint_that_cannot_be_written_hands_nothing_out(tmp_path: Path) -> None:
    (tmp_path / ".claims.json.tmp").mkdir()  # where the new checkpoint is written before its rename
    prep = preparer(tmp_path, kube_with_claim(UID), tmp_path / "claims.json")
    await prep.load()

    answer = await prep.prepare([ClaimKey("ns", "c", UID)])

    assert (
        f"claim ns/c is not prepared: cannot write the DRA claim checkpoint {tmp_path / 'claims.json'}: "
        "Is a directory"
    ) == answer[UID].error
    assert [] == os.listdir(tmp_path / "cdi")  # the CDI spec written first is taken back
    assert () == prep.prepared().claims


async def test_a_uid_that_is_no_uid_is_refused_before_any_file_is_named(tmp_path: Path) -> None:
    prep = preparer(tmp_path, kube_with_claim(UID), tmp_path / "claims.json")
    await prep.load()
    key = ClaimKey("ns", "c", "../../etc/passwd")
    assert "claim ns/c: '../../etc/passwd' is not a claim UID" == (await prep.prepare([key]))[key.uid].error
    assert "claim ns/c: '../../etc/passwd' is not a claim UID" == (await prep.unprepare([key]))[key.uid]


def test_checkpoint_write_failure_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointError, match="cannot write the DRA claim checkpoint"):
        ClaimCheckpoint(tmp_path / "f" / "claims.json").save({})


async def test_cdi_specs_of_claims_the_checkpoint_lacks_are_removed_at_start(tmp_path: Path) -> None:
    checkpoint = ClaimCheckpoint(tmp_path / "claims.json")
    checkpoint.save({CLAIM.uid: CLAIM})
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    kept, stale = (f"k8s.gpu.nvidia.com-claim_{u}.json" for u in (CLAIM.uid, "9f0e-stale"))
    for name in (kept, stale, "k8s.gpu-sharing.io-gpu.json"):
        (cdi / name).write_text("{}")
    prep = preparer(tmp_path, FakeKube("node-a", {}), checkpoint.path)
    await prep.load()
    assert sorted([kept, "k8s.gpu-sharing.io-gpu.json"]) == sorted(os.listdir(cdi))
    assert [CLAIM] == list(prep.prepared().claims)
