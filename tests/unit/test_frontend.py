"""The front-end a node asks for, and the devices a claim's allocation holds."""

from __future__ import annotations

import pytest

from sharing.cli.status import describe
from sharing.config import FRONTEND_LABEL, Frontend, FrontendChoice, choose_frontend
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.dra.holds import claim_holds
from sharing.kubelet.holders import Holders
from sharing.model import (
    ClaimAllocation,
    ClaimHold,
    ComputeInstance,
    Gpu,
    GpuInstance,
    GpuUuid,
    MigUuid,
    NodeState,
)
from sharing.ops.status import ConfigStatus, status_document

DP, DRA = Frontend.DEVICE_PLUGIN, Frontend.DRA
LABEL = f"label {FRONTEND_LABEL}"
NOT_ONE = "'DRA' is not a front-end: deviceplugin or dra"


@pytest.mark.parametrize(
    ("labels", "default", "expected"),
    [
        ({}, DP, FrontendChoice(DP, "setting")),
        ({}, DRA, FrontendChoice(DRA, "setting")),
        ({FRONTEND_LABEL: ""}, DRA, FrontendChoice(DRA, "setting")),
        ({FRONTEND_LABEL: "dra"}, DP, FrontendChoice(DRA, LABEL)),
        ({FRONTEND_LABEL: "deviceplugin"}, DRA, FrontendChoice(DP, LABEL)),
        (
            {FRONTEND_LABEL: "DRA"},
            DP,
            FrontendChoice(
                None, LABEL, f"node label {FRONTEND_LABEL}=DRA: 'DRA' is not a front-end: deviceplugin or dra"
            ),
        ),
    ],
    ids=["no-label", "setting-dra", "empty-label", "label-dra", "label-deviceplugin", "label-invalid"],
)
def test_the_label_overrides_the_setting_and_a_bad_value_is_named(
    labels: dict[str, str], default: Frontend, expected: FrontendChoice
) -> None:
    assert expected == choose_frontend(labels, default)


A100 = Gpu(
    0, GpuUuid("GPU-0"), "NVIDIA A100-SXM4-40GB", 40960, True, True, False,
    instances=(
        GpuInstance(1, "3g.20gb", 0, 4, (ComputeInstance(0, MigUuid("MIG-a"), mig_index=0),)),
        GpuInstance(2, "1g.5gb", 4, 1, (ComputeInstance(0, MigUuid("MIG-b"), mig_index=1),)),
    ),
)  # fmt: skip
H100 = Gpu(1, GpuUuid("GPU-1"), "NVIDIA H100 80GB HBM3", 81559, True, False, False)
NODE = NodeState((A100, H100))


@pytest.mark.parametrize(
    ("devices", "held"),
    [
        (("gpu-0-mig-1",), {"MIG-b"}),
        (("gpu-1",), {"GPU-1"}),
        (("gpu-1-replica-3",), {"GPU-1"}),
        (("gpu-0-mig-1-replica-0", "gpu-0-mig-0"), {"MIG-a", "MIG-b"}),
        (("gpu-0-mig-5",), {"GPU-0", "MIG-a", "MIG-b"}),
        (("gpu-7", "nic-0"), set()),
        (("gpu-0-mig-1g-5gb-at-4",), {"GPU-0", "MIG-b"}),
        (("gpu-0-mig-1g-5gb-at-5",), {"GPU-0", "MIG-a", "MIG-b"}),
    ],
    ids=[
        "mig",
        "gpu",
        "replica",
        "two",
        "gone-mig-holds-its-gpu",
        "not-ours",
        "made-on-demand",
        "not-made-yet",
    ],
)
def test_a_claim_holds_the_devices_its_allocation_names(devices: tuple[str, ...], held: set[str]) -> None:
    claim = ClaimAllocation("ml", "c", "u", devices, ("ml/p",))
    assert (ClaimHold("ml", "c", ("ml/p",), frozenset(held)),) == claim_holds([claim], NODE)


def test_claims_count_as_holders_and_are_named_beside_pods() -> None:
    claims = claim_holds(
        [
            ClaimAllocation("ml", "c", "u", ("gpu-0-mig-1",), ("ml/p",)),
            ClaimAllocation("a", "b", "v", ("gpu-1",)),
        ],
        NODE,
    )
    holders = Holders(claims=claims)
    assert frozenset({"MIG-b", "GPU-1"}) == holders.busy_uuids(NODE)
    assert ("claim ml/c (pod ml/p)",) == holders.pods_holding({"MIG-b"})
    assert ("claim a/b (no pod yet)", "claim ml/c (pod ml/p)") == holders.pods_holding({"MIG-b", "GPU-1"})


def test_sharing_status_shows_each_claim_beside_the_devices_it_holds() -> None:
    mig = Device(DeviceId("MIG-b"), Health.HEALTHY, None, GpuUuid("GPU-0"), MigUuid("MIG-b"), index="0:1")
    whole = Device(DeviceId("GPU-1"), Health.HEALTHY, None, GpuUuid("GPU-1"), index="1")
    inventory = Inventory(
        ((ResourceName("nvidia.com/gpu"), (whole,)), (ResourceName("nvidia.com/mig-1g.5gb"), (mig,)))
    )
    claims = claim_holds([ClaimAllocation("ml", "c", "u", ("gpu-0-mig-1",), ("ml/p",))], NODE)
    document = status_document("n1", NODE, inventory, (), ConfigStatus(), claims=claims, frontend="dra")
    slices = {s["id"]: s["claims"] for g in document["gpus"] for s in g["slices"]}
    assert {"MIG-b": [{"namespace": "ml", "name": "c", "pods": ["ml/p"]}], "GPU-1": []} == slices
    table = describe(document)
    assert "front-end dra" in table.splitlines()[0]
    (row,) = [line for line in table.splitlines() if "MIG-b" in line]
    assert row.rstrip().endswith("claim ml/c (pod ml/p)")
