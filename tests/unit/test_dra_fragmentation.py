"""The room of a dynamic GPU, from the instances on it: the largest profile it can still take and the
free compute its instances strand, in `sharing status` and the metrics; no claim of the cluster read."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from sharing.cli.status import describe
from sharing.devices import Inventory
from sharing.dra.fragmentation import GpuRoom, room
from sharing.dra.frontend import DraFrontEnd
from sharing.gpu.devfiles import DeviceFiles
from sharing.mig import default_catalog
from sharing.model import ComputeInstance, DriverInfo, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.ops import ConfigStatus, status_document
from sharing.ops.metrics import Metrics
from tests.unit.fakekube import FakeKube

CATALOG = default_catalog()
PRODUCT = next(p for p in CATALOG.products if p.name == "A100-SXM4-40GB")


def _a100(index: int, *placed: tuple[str, int]) -> Gpu:
    instances = tuple(
        GpuInstance(n, profile, start, PRODUCT.require_profile(profile).size,
                    (ComputeInstance(0, MigUuid(f"MIG-{index}-{n}")),))
        for n, (profile, start) in enumerate(placed)
    )  # fmt: skip
    return Gpu(index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", PRODUCT.memory_mib, True, True, True,
               instances, compute_capability=(8, 0), profiles=PRODUCT)  # fmt: skip


def _node(*gpus: Gpu) -> NodeState:
    return NodeState(gpus, driver=DriverInfo("550.107.02", 12040))


@pytest.mark.parametrize(
    ("placed", "largest", "free", "stranded"),
    [
        pytest.param((), "7g.40gb", 7, 0, id="empty"),
        # Four 1g.5gb on memory slices 0, 2, 4, 6: three compute slices free, but 1g.5gb fits only at
        # slices 1, 3 and 5 ... which is three: nothing stranded, the largest is a 1g.
        pytest.param(
            (("1g.5gb", 0), ("1g.5gb", 2), ("1g.5gb", 4), ("1g.5gb", 6)), "1g.5gb", 3, 0, id="checkered"
        ),
        # Two 3g.20gb take every memory slice: one compute slice is free and nothing can use it.
        pytest.param((("3g.20gb", 0), ("3g.20gb", 4)), "", 1, 1, id="3g-3g-strands-one"),
        pytest.param((("4g.20gb", 0),), "3g.20gb", 3, 0, id="4g-leaves-3g"),
    ],
)
def test_the_room_of_a_gpu_is_its_largest_placeable_profile_and_its_stranded_compute(
    placed: tuple[tuple[str, int], ...], largest: str, free: int, stranded: int
) -> None:
    (got,) = room(_node(_a100(0, *placed)), {"GPU-0"}, CATALOG)
    size = PRODUCT.require_profile(largest).compute_slices if largest else 0
    assert GpuRoom(0, "GPU-0", largest, size, free, stranded) == got


def test_only_dynamic_gpus_in_mig_mode_have_a_room() -> None:
    node = _node(_a100(0), _a100(1))
    assert [0] == [r.gpu for r in room(node, {"GPU-0"}, CATALOG)]


async def test_the_front_end_shows_the_room_in_status_and_metrics_and_reads_no_claim(tmp_path: Path) -> None:
    kube = FakeKube("node-a", {})
    front = DraFrontEnd(kube=cast(Any, kube), node_name="node-a", files=cast(DeviceFiles, None),
                        cdi_dir=tmp_path, catalog=CATALOG)  # fmt: skip
    node = _node(_a100(0, ("3g.20gb", 0), ("3g.20gb", 4)))
    inventory = Inventory(dynamic=frozenset({GpuUuid("GPU-0")}))
    assert "" == await front.publish(inventory, node)
    document = status_document("node-a", node, inventory, [], ConfigStatus(), room=front.room())
    assert {
        "largestProfile": None,
        "largestComputeSlices": 0,
        "freeComputeSlices": 1,
        "strandedComputeSlices": 1,
    } == document["gpus"][0]["room"]
    assert (
        "  room: largest profile still placeable none; 1 compute slices free, 1 of them stranded (no"
        " placement can use them)"
    ) in describe(document).splitlines()
    metrics = Metrics("test")
    metrics.snapshot(document, ())
    rendered = metrics.render().decode().splitlines()
    assert 'gpu_sharing_dynamic_gpu_stranded_compute_slices{gpu="0",uuid="GPU-0"} 1.0' in rendered
    assert 'gpu_sharing_dynamic_gpu_largest_placeable_compute_slices{gpu="0",uuid="GPU-0"} 0.0' in rendered
    assert 0 == kube.claim_reads
