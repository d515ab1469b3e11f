"""Which MIG instances of a dynamic GPU the agent did not make, which of them it may reclaim, and how
`sharing status` shows them."""

from __future__ import annotations

from sharing.cli.status import describe
from sharing.devices import Inventory
from sharing.dra.foreign import foreign_instances, reclaimable
from sharing.mig import default_catalog
from sharing.model import ComputeInstance, DriverInfo, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.ops import ConfigStatus, status_document
from sharing.store import OwnedInstance, PreparedClaim, PreparedDevice

CATALOG = default_catalog()
A100 = CATALOG.product("A100-SXM4-40GB")


def instance(gi: int, profile: str, start: int, *, busy: bool = False) -> GpuInstance:
    p = A100.require_profile(profile)
    ci = ComputeInstance(0, MigUuid(f"MIG-{gi}"), busy=busy, slices=p.compute_slices)
    return GpuInstance(gi, profile, start, p.size, (ci,))


def claim(name: str, gi: GpuInstance, *, foreign: bool) -> PreparedClaim:
    owned = OwnedInstance("GPU-0", gi.profile, gi.start, gi.size, gi.id, 0, foreign=foreign)
    device = PreparedDevice(("mig",), "n", f"gpu-0-mig-x-at-{gi.start}", f"MIG-{gi.id}", "GPU-0", (),
                            instance=owned)  # fmt: skip
    return PreparedClaim("ns", name, f"uid-{name}", (device,))


MADE, ADOPTED, FREE, BUSY = (
    instance(1, "1g.5gb", 6),
    instance(2, "2g.10gb", 0),
    instance(3, "3g.20gb", 4, busy=False),
    instance(4, "1g.5gb", 2, busy=True),
)
GPU = Gpu(0, GpuUuid("GPU-0"), "NVIDIA A100-SXM4-40GB", A100.memory_mib, True, True, True,
          (MADE, ADOPTED, FREE, BUSY), profiles=A100)  # fmt: skip
NODE = NodeState((GPU,), driver=DriverInfo("550.107.02", 12040))
CLAIMS = (claim("made", MADE, foreign=False), claim("adopted", ADOPTED, foreign=True))


def test_every_instance_the_checkpoint_does_not_record_as_made_is_foreign() -> None:
    found = foreign_instances(NODE, {"GPU-0"}, CLAIMS, CATALOG)
    assert [(f.instance.id, f.device, f.claim) for f in found] == [
        (2, "gpu-0-mig-2g-10gb-at-0", "ns/adopted"),
        (3, "gpu-0-mig-3g-20gb-at-4", ""),
        (4, "gpu-0-mig-1g-5gb-at-2", ""),
    ]
    assert foreign_instances(NODE, set(), CLAIMS, CATALOG) == ()  # not a dynamic GPU


def test_only_an_idle_foreign_instance_no_claim_holds_or_is_allocated_is_reclaimable() -> None:
    assert [f.instance.id for f in reclaimable(NODE, {"GPU-0"}, CLAIMS, (), CATALOG)] == [3]
    assert reclaimable(NODE, {"GPU-0"}, CLAIMS, ("gpu-0-mig-3g-20gb-at-4",), CATALOG) == ()
    assert reclaimable(NODE, set(), CLAIMS, (), CATALOG) == ()


def test_sharing_status_lists_the_foreign_instances_under_their_gpu() -> None:
    found = foreign_instances(NODE, {"GPU-0"}, CLAIMS, CATALOG)
    document = status_document("n", NODE, Inventory(reclaim=frozenset({"GPU-0"})), [], ConfigStatus(),
                               foreign=found)  # fmt: skip
    assert document["gpus"][0]["foreign"][0] == {
        "profile": "2g.10gb", "start": 0, "gpuInstance": 2, "uuids": ["MIG-2"], "busy": False,
        "device": "gpu-0-mig-2g-10gb-at-0", "claim": "ns/adopted", "reclaimedWhenIdle": True,
    }  # fmt: skip
    lines = describe(document).splitlines()
    assert (
        "  foreign MIG instance 1g.5gb at slot 2 (MIG-4, busy): offered as gpu-0-mig-1g-5gb-at-2; destroyed "
        "once idle and unclaimed"
    ) in lines
    assert (
        "  foreign MIG instance 2g.10gb at slot 0 (MIG-2): offered as gpu-0-mig-2g-10gb-at-0, held by claim "
        "ns/adopted; destroyed once idle and unclaimed"
    ) in lines
