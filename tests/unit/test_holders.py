"""Held devices and the forms they are offered in: what the kubelet would hand out twice."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from sharing.devices.inventory import Device, DeviceId, Health, Inventory, inventory_from, reformed
from sharing.kubelet.holders import Holders, read_holders
from sharing.labels import ConfigState
from sharing.model import BoundPod, GpuUuid, Holding, Listing, MigUuid, NodeState
from sharing.rollout.verdict import Retry, Verdict, held_back

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
MIG = "nvidia.com/mig-3g.40gb"


def offered(**resources: list[str]) -> Inventory:
    """Devices by ID per resource; keyword `gpu`, `gpu_shared` or `mig` names the resource."""
    names = {"gpu": GPU, "gpu_shared": SHARED, "mig": MIG}

    def device(i: str) -> Device:
        uuid, _, n = i.partition("::")
        mig = MigUuid(uuid) if uuid.startswith("MIG") else None
        return Device(DeviceId(i), Health.HEALTHY, None, GpuUuid("GPU-0"), mig, int(n) if n else None)

    return inventory_from({names[k]: [device(i) for i in ids] for k, ids in resources.items()})


def held(resource: str, *ids: str) -> Holding:
    return Holding("default", "holder", "main", resource, frozenset(ids))


@pytest.mark.parametrize(
    ("holding", "inventory", "expected"),
    [
        (held(MIG, "MIG-a"), offered(mig=["MIG-a", "MIG-b"]), set()),
        (held(MIG, "MIG-a"), offered(mig=["MIG-a::0", "MIG-a::1", "MIG-b"]), {"MIG-a"}),
        (held(GPU, "GPU-0::0"), offered(gpu=["GPU-0"]), {"GPU-0"}),
        (held(GPU, "GPU-0::0"), offered(gpu=[f"GPU-0::{n}" for n in range(4)]), set()),
        (held(GPU, "GPU-0::3"), offered(gpu=["GPU-0::0", "GPU-0::1"]), {"GPU-0"}),
        (held(GPU, "GPU-0::0"), offered(gpu_shared=["GPU-0::0", "GPU-0::1"]), {"GPU-0"}),
        (held(GPU, "GPU-0"), offered(gpu_shared=["GPU-0"]), {"GPU-0"}),
        (held(GPU, "GPU-0"), offered(), set()),
    ],
    ids=[
        "same-form",
        "held-whole-now-replicas",
        "held-replica-now-whole",
        "more-replicas",
        "held-replica-dropped",
        "renamed-replicas",
        "renamed-whole",
        "not-offered-at-all",
    ],
)
def test_a_held_device_is_reoffered_only_in_a_form_the_kubelet_knows_is_taken(
    holding: Holding, inventory: Inventory, expected: set[str]
) -> None:
    assert expected == Holders((holding,)).reoffered(inventory)


def test_a_recent_allocate_counts_whatever_its_resource() -> None:
    assert {"GPU-0"} == Holders(recent=frozenset({"GPU-0"})).reoffered(offered(gpu=["GPU-0::0", "GPU-0::1"]))


def test_reformed_devices_are_those_offered_before_and_after_under_other_ids_or_names() -> None:
    before = offered(gpu=["GPU-0::0", "GPU-0::1"], mig=["MIG-a", "MIG-b"])
    after = offered(gpu_shared=["GPU-0::0", "GPU-0::1"], mig=["MIG-a", "MIG-c"])
    assert {"GPU-0"} == reformed(before, after)


def test_a_config_waits_for_the_pods_holding_what_it_cannot_offer() -> None:
    verdict = held_back(Verdict(ConfigState.SUCCESS, "ConfigApplied", "applied"), {"MIG-a": ("ns/p",)}, "c")
    assert (ConfigState.FAILED, "ConfigApplyBlocked", Retry.BLOCKED, frozenset({"MIG-a"})) == (
        verdict.state,
        verdict.reason,
        verdict.retry,
        verdict.blockers,
    )
    assert "config 'c' waits: MIG-a (held by pods ns/p)" in verdict.message
    assert Verdict(ConfigState.SUCCESS) == held_back(Verdict(ConfigState.SUCCESS), {}, "c")


class Kubelet:
    def __init__(self, listing: Listing) -> None:
        self.answer = listing

    async def listing(self) -> Listing:
        return self.answer


def bound(*pods: BoundPod) -> Callable[[], Awaitable[tuple[BoundPod, ...]]]:
    async def read() -> tuple[BoundPod, ...]:
        return pods

    return read


HOLDER = BoundPod("default", "holder", frozenset({MIG, "cpu"}))


async def test_podresources_is_believed_once_it_lists_every_pod_bound_here_that_can_hold_a_device() -> None:
    web = BoundPod("default", "web", frozenset({"cpu", "memory", "hugepages-2Mi"}))  # holds no device
    listing = Listing(frozenset({"default/holder"}), (held(MIG, "MIG-a"),))
    holders = await read_holders(Kubelet(listing), bound=bound(HOLDER, web))
    assert "" == holders.unknown
    assert frozenset({"MIG-a"}) == holders.busy_uuids(NodeState(()))


async def test_a_short_list_makes_every_device_held() -> None:
    holders = await read_holders(Kubelet(Listing()), bound=bound(HOLDER))
    assert "default/holder" in holders.unknown
