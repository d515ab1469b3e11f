"""Fragmentation made visible: a pending claim whose MIG profile fits a dynamic GPU's free memory and
compute but no placement is found, said once as an Event, counted in the metrics and shown by
`sharing status`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from sharing.cli.status import describe
from sharing.devices import Inventory
from sharing.dra.fragmentation import Fragmented, class_profile, fragmented_claims
from sharing.dra.frontend import DraFrontEnd
from sharing.dra.names import ondemand_device_name
from sharing.gpu.devfiles import DeviceFiles
from sharing.kube.api import PendingClaim
from sharing.mig import default_catalog
from sharing.model import ClaimAllocation, DriverInfo, Gpu, GpuUuid, NodeState
from sharing.ops import ConfigStatus, status_document
from sharing.ops.metrics import Metrics
from tests.unit.fakekube import FakeKube

CATALOG = default_catalog()
PRODUCT = next(p for p in CATALOG.products if p.name == "A100-SXM4-40GB")
# Four 1g.5gb on memory slices 0, 2, 4, 6: four slices and three compute slices free, none contiguous.
CHECKERED = tuple(ondemand_device_name(0, "1g.5gb", s) for s in (0, 2, 4, 6))
WAITING = PendingClaim("default", "big", ("mig-3g.20gb.nvidia.com",))


def _a100(index: int) -> Gpu:
    return Gpu(index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", PRODUCT.memory_mib, True, True, True,
               (), compute_capability=(8, 0), profiles=PRODUCT)  # fmt: skip


def _node(count: int) -> NodeState:
    return NodeState(tuple(_a100(i) for i in range(count)), driver=DriverInfo("550.107.02", 12040))


def test_a_claim_for_a_profile_with_room_but_no_placement_is_fragmented() -> None:
    found = fragmented_claims(_node(1), {"GPU-0"}, CATALOG, allocated=CHECKERED, pending=[WAITING])
    assert (Fragmented("default", "big", "3g.20gb", (0,)),) == found


def test_a_claim_that_fits_another_gpu_or_names_no_profile_is_not() -> None:
    pending = [WAITING, PendingClaim("default", "any", ("mig.nvidia.com",))]
    assert () == fragmented_claims(
        _node(2), {"GPU-0", "GPU-1"}, CATALOG, allocated=CHECKERED, pending=pending
    )
    full = tuple(ondemand_device_name(0, "1g.5gb", s) for s in range(7))  # no compute left: full
    assert () == fragmented_claims(_node(1), {"GPU-0"}, CATALOG, allocated=full, pending=[WAITING])


def test_a_per_profile_class_names_its_profile() -> None:
    assert "1g.5gb" == class_profile("mig-1g.5gb.nvidia.com", PRODUCT)
    assert "1g.5gb+me" == class_profile("mig-1g.5gb.me.nvidia.com", PRODUCT)
    assert None is class_profile("gpu.nvidia.com", PRODUCT)


async def test_the_front_end_says_it_once_as_an_event_and_status_and_metrics_show_it(tmp_path: Path) -> None:
    kube = FakeKube("node-a", {})
    kube.pool_claims = (ClaimAllocation("default", "small", "uid-s", CHECKERED),)
    kube.pending_claims = (WAITING,)
    front = DraFrontEnd(kube=cast(Any, kube), node_name="node-a", files=cast(DeviceFiles, None),
                        cdi_dir=tmp_path, catalog=CATALOG)  # fmt: skip
    said: list[tuple[str, str, str]] = []

    async def event(kind: str, reason: str, message: str) -> None:
        said.append((kind, reason, message))

    front.event = event
    node = _node(1)
    assert "" == await front.publish(Inventory(dynamic=frozenset({GpuUuid("GPU-0")})), node)
    await front.follow_allocations()  # read again: nothing new to say
    message = (
        "claim default/big waits for a 3g.20gb MIG device: GPU 0 has the free memory and compute for it "
        "but no free placement (the free memory slices are not contiguous around the instances in use); "
        "it fits once instances there are released"
    )
    assert [("Warning", "MigFragmented", message)] == said

    document = status_document("node-a", node, Inventory(), [], ConfigStatus(), fragmented=front.fragmented)
    assert [{"claim": "default/big", "profile": "3g.20gb", "gpus": [0]}] == document["fragmented"]
    assert (
        "claim default/big waits for 3g.20gb: fragmented on GPU 0 (the free memory and compute would hold "
        "it, no placement does)"
    ) in describe(document).splitlines()
    metrics = Metrics("test")
    metrics.snapshot(document, ())
    assert (
        'gpu_sharing_dra_fragmented_claims{profile="3g.20gb"} 1.0' in metrics.render().decode().splitlines()
    )
