"""The DRA front-end with `mig: dynamic` GPUs: their partitionable devices go into the pool beside the
static ones, ordered for the claims prepared here and the instances on the GPUs, and re-built when
either changes; no ResourceClaim is read for it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from sharing.cli.status import describe
from sharing.config.spec import MigMode, Rule, Selector, SharingConfig
from sharing.devices import Inventory, build_inventory
from sharing.dra import OnDemand
from sharing.dra.frontend import DraFrontEnd
from sharing.dra.names import DRIVER, parse_ondemand_name
from sharing.dra.partitions import partitionable_slices
from sharing.dra.slices import build_slices
from sharing.gpu import GpuBackend
from sharing.gpu.devfiles import DeviceFiles
from sharing.kube.api import SliceSpec, Version
from sharing.mig import default_catalog
from sharing.model import (
    ComputeInstance,
    DriverInfo,
    Gpu,
    GpuInstance,
    GpuUuid,
    MigUuid,
    NodeState,
)
from sharing.ops import ConfigStatus, status_document
from sharing.store import Journal, PreparedClaim, PreparedDevice
from tests.unit.fakekube import FakeKube

CATALOG = default_catalog()
NODE_NAME = "node-a"


def _a100(index: int) -> Gpu:
    product = next(p for p in CATALOG.products if p.name == "A100-SXM4-40GB")
    return Gpu(index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", product.memory_mib, True, True, True,
               (), compute_capability=(8, 0), profiles=product)  # fmt: skip


NODE = NodeState((_a100(0), _a100(1)), driver=DriverInfo("550.107.02", 12040))
DYNAMIC = Inventory(dynamic=frozenset({GpuUuid("GPU-0"), GpuUuid("GPU-1")}))


def _front_end(kube: FakeKube, tmp_path: Path) -> DraFrontEnd:
    return DraFrontEnd(
        kube=cast(Any, kube),
        node_name=NODE_NAME,
        files=cast(DeviceFiles, None),  # only prepare reads the driver's files
        cdi_dir=tmp_path,
        catalog=CATALOG,
    )


def _held(kube: FakeKube) -> list[tuple[str, ...]]:
    """The device names of each slice the API server holds, in slice-name order."""
    return [tuple(d.name for d in s.spec.devices) for _, s in sorted(kube.slices.items())]


def _wanted(specs: tuple[SliceSpec, ...]) -> list[tuple[str, ...]]:
    return [tuple(d.name for d in s.devices) for s in specs]


def _prepare(front: DraFrontEnd, *devices: str) -> None:
    """The checkpoint holds one claim prepared with these devices of the pool (none: no claim)."""
    records = front.plugin.preparer.records
    claim = PreparedClaim(
        "default",
        "c",
        "uid-c",
        tuple(PreparedDevice(("r",), NODE_NAME, d, f"MIG-{i}", "GPU-0", ()) for i, d in enumerate(devices)),
    )
    records.claims = {claim.uid: claim} if devices else {}


async def test_dynamic_gpus_are_published_as_partitionable_devices_ordered_for_the_claims_prepared_here(
    tmp_path: Path,
) -> None:
    kube = FakeKube(NODE_NAME, {})
    first = partitionable_slices(NODE_NAME, NODE, DYNAMIC.dynamic, CATALOG)
    taken = first[1].devices[0].name  # the scheduler's first fit on GPU 0
    front = _front_end(kube, tmp_path)
    _prepare(front, taken)

    assert "" == await front.publish(DYNAMIC, NODE)

    expected = partitionable_slices(NODE_NAME, NODE, DYNAMIC.dynamic, CATALOG, prepared=(taken,))
    assert _wanted(expected) == _held(kube)
    assert _wanted(expected) != _wanted(first)  # the order follows what is prepared
    assert 0 == kube.claim_reads


async def test_a_prepare_or_an_unprepare_re_publishes_the_order(tmp_path: Path) -> None:
    kube = FakeKube(NODE_NAME, {})
    front = _front_end(kube, tmp_path)
    assert "" == await front.publish(DYNAMIC, NODE)
    before = _held(kube)
    taken = next(n for names in before for n in names if n.startswith("gpu-0-"))
    _prepare(front, taken)

    expected = _wanted(partitionable_slices(NODE_NAME, NODE, DYNAMIC.dynamic, CATALOG, prepared=(taken,)))
    assert True is await front.follow_node()
    assert expected == _held(kube)
    assert False is await front.follow_node()  # nothing changed: nothing written
    assert before != expected
    _prepare(front)  # unprepared
    assert True is await front.follow_node()
    assert before == _held(kube)
    assert 0 == kube.claim_reads


async def test_a_node_without_dynamic_gpus_follows_nothing(tmp_path: Path) -> None:
    kube = FakeKube(NODE_NAME, {})
    front = _front_end(kube, tmp_path)
    assert "" == await front.publish(Inventory(), NodeState(()))
    assert False is await front.follow_node()
    assert [] == [s for s in kube.slices.values() if s.spec.driver == DRIVER and s.spec.devices]


class _Gpus:
    """The backend's observe() only: what the GPUs hold now."""

    def __init__(self, node: NodeState) -> None:
        self.node = node

    async def observe(self) -> NodeState:
        return self.node


def _with_gpus(kube: FakeKube, gpus: _Gpus, tmp_path: Path) -> DraFrontEnd:
    """A front-end that reads the dynamic GPUs from `gpus` (as after a prepare or an unprepare)."""
    return DraFrontEnd(
        kube=cast(Any, kube),
        node_name=NODE_NAME,
        files=cast(DeviceFiles, None),
        cdi_dir=tmp_path,
        catalog=CATALOG,
        ondemand=OnDemand(cast(GpuBackend, gpus), Journal(tmp_path / "journal")),
    )


async def test_an_instance_made_or_destroyed_by_someone_else_re_publishes(
    tmp_path: Path,
) -> None:
    kube = FakeKube(NODE_NAME, {})
    gpus = _Gpus(NODE)
    front = _with_gpus(kube, gpus, tmp_path)
    assert "" == await front.publish(DYNAMIC, NODE)
    assert False is await front.follow_node()

    # An instance no claim prepared here accounts for (made by someone else).
    ci = ComputeInstance(0, MigUuid("MIG-x"), mig_index=0)
    gpus.node = replace(
        NODE, gpus=(replace(NODE.gpus[0], instances=(GpuInstance(1, "1g.5gb", 0, 1, (ci,)),)), NODE.gpus[1])
    )
    assert True is await front.follow_node()
    assert _wanted(partitionable_slices(NODE_NAME, gpus.node, DYNAMIC.dynamic, CATALOG)) == _held(kube)
    assert "gpu-0-mig-1g-5gb-at-0" not in {n for names in _held(kube) for n in names}

    gpus.node = NODE  # destroyed
    assert True is await front.follow_node()
    assert "gpu-0-mig-1g-5gb-at-0" in {n for names in _held(kube) for n in names}


async def test_the_order_after_a_prepare_is_one_write_though_it_withdraws_what_the_instance_overlaps(
    tmp_path: Path,
) -> None:
    """A prepare made an instance: the placements it overlaps go from the pool, and the new order is
    written from the pool as last written, one request (no list, no Node read): the scheduler's
    counters keep an allocated device's overlaps out already, so no safety rests on a fresh read
    (a change's withdrawal, which does, reads first: tests/unit/test_slice_plan.py)."""
    kube = FakeKube(NODE_NAME, {})
    gpus = _Gpus(NODE)
    front = _with_gpus(kube, gpus, tmp_path)
    assert "" == await front.publish(DYNAMIC, NODE)
    taken = "gpu-0-mig-1g-5gb-at-0"
    _prepare(front, taken)
    ci = ComputeInstance(0, MigUuid("MIG-0"), mig_index=0)
    gpus.node = replace(
        NODE, gpus=(replace(NODE.gpus[0], instances=(GpuInstance(1, "1g.5gb", 0, 1, (ci,)),)), NODE.gpus[1])
    )
    before = kube.requests

    assert True is await front.follow_node()

    offered = {n for names in _held(kube) for n in names}
    assert taken in offered  # the claim's own device stays (the scheduler counts it)
    assert "gpu-0-mig-2g-10gb-at-0" not in offered  # what its instance overlaps goes
    assert 1 == kube.requests - before


# --- a mixed node: GPUs without MIG beside dynamic ones -----------------------------------------------

MIXED = NodeState(
    (
        _a100(0),
        Gpu(
            1,
            GpuUuid("GPU-1"),
            "NVIDIA L4",
            23034,
            False,
            False,
            False,
            compute_capability=(8, 9),
            minor=1,
            pci_bus_id="0000:11:00.0",
        ),
        _a100(2),
    ),
    driver=DriverInfo("550.107.02", 12040),
)
ALL_DYNAMIC = SharingConfig("c", rules=(Rule(Selector(all=True), MigMode.DYNAMIC),))


async def test_a_gpu_without_mig_under_a_dynamic_rule_is_published_whole_as_a_static_gpu_is(
    tmp_path: Path,
) -> None:
    kube = FakeKube(NODE_NAME, {})
    front = _front_end(kube, tmp_path)
    inventory = build_inventory(MIXED, ALL_DYNAMIC, catalog=CATALOG)

    assert "" == await front.publish(inventory, MIXED)

    held = {d.name: d for names in kube.slices.values() for d in names.spec.devices}
    ondemand = {p[0] for name in held if (p := parse_ondemand_name(name)) is not None}
    assert {0, 2} == ondemand
    # The same device, attributes and capacity as the L4 under no rule at all (a static whole GPU).
    (static,) = [
        d
        for s in build_slices(NODE_NAME, MIXED, build_inventory(MIXED, None, catalog=CATALOG))
        for d in s.devices
    ]
    assert static == held["gpu-1"]
    attributes = dict(static.attributes)
    assert {
        "type": "gpu",
        "uuid": "GPU-1",
        "productName": "NVIDIA L4",
        "architecture": "Ada Lovelace",
        "cudaComputeCapability": Version("8.9.0"),
    }.items() <= attributes.items()
    assert {"gpu-1"} == {n for n in held if parse_ondemand_name(n) is None}


def test_sharing_status_says_which_gpus_make_mig_devices_per_claim_and_which_are_whole() -> None:
    inventory = build_inventory(MIXED, ALL_DYNAMIC, catalog=CATALOG)
    document = status_document(NODE_NAME, MIXED, inventory, [], ConfigStatus(), frontend="dra")
    assert ["onDemand", "whole", "onDemand"] == [g["dynamic"] for g in document["gpus"]]
    assert [["GPU-1"]] == [[s["device"] for s in g["slices"]] for g in document["gpus"] if g["slices"]]
    lines = describe(document).splitlines()
    at = lines.index(next(line for line in lines if line.startswith("GPU 1  NVIDIA L4")))
    assert "  mig: dynamic, but this GPU has no MIG: offered as a whole GPU" == lines[at + 1]
    assert 2 == lines.count("  mig: dynamic: MIG devices made per claim (DRA front-end)")
