"""The device-plugin fleet against the kubelet's real device manager (the Go kubelet harness).

Every harness call goes through asyncio.to_thread: the harness calls back into our plugins
(GetPreferredAllocation, Allocate) on this test's event loop, so blocking it would deadlock.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import lab
import pytest
from lab.deadlines import scaled

from sharing.config.spec import MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.deviceplugin import Fleet, FleetSettings, PluginStatus
from sharing.deviceplugin.service import DevicePluginService
from sharing.devices.inventory import HealthState, Inventory, build_inventory, withdraw
from sharing.kubelet import PodResourcesClient
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.kubelet.api import deviceplugin_v1beta1_pb2_grpc as api_grpc
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, HealthEvent, MigUuid, NodeState

pytestmark = pytest.mark.integration

GPU, SHARED = "nvidia.com/gpu", "nvidia.com/gpu.shared"
MIG_1G, MIG_3G = "nvidia.com/mig-1g.5gb", "nvidia.com/mig-3g.20gb"
A100 = "NVIDIA A100-SXM4-40GB"


def a100(index: int, *migs: tuple[str, str]) -> Gpu:
    instances = tuple(
        GpuInstance(n, profile, n, 1, (ComputeInstance(0, MigUuid(uuid)),))
        for n, (profile, uuid) in enumerate(migs)
    )
    return Gpu(
        index, GpuUuid(f"GPU-{index}"), A100, 40960, True, bool(migs), bool(migs), instances, numa_node=0
    )


# GPU 0: MIG (two 1g.5gb, each time-sliced twice, and one 3g.20gb); GPUs 1 and 2: whole, 2 replicas each.
NODE = NodeState((a100(0, ("1g.5gb", "MIG-a"), ("1g.5gb", "MIG-b"), ("3g.20gb", "MIG-c")), a100(1), a100(2)))


def config(*, rename: bool = False, fail_gt_one: bool = False, gpu_replicas: int = 2) -> SharingConfig:
    rule = Rule(
        devices=Selector(all=True),
        replicas=Replicas(default=1, per_device_kind=(("1g.5gb", 2), ("gpu", gpu_replicas))),
    )
    return SharingConfig(
        name="it",
        mig_strategy=MigStrategy.MIXED,
        rename_by_default=rename,
        fail_requests_greater_than_one=fail_gt_one,
        rules=(rule,),
    )


def inventory(**options: Any) -> Inventory:
    return build_inventory(NODE, config(**options))


@pytest.fixture(scope="module")
def harness_binary() -> Path:
    if os.environ.get("SHARING_KUBELET_HARNESS"):
        return Path(os.environ["SHARING_KUBELET_HARNESS"])
    try:
        return lab.binaries().kubelet_harness
    except lab.BinariesUnavailable as err:
        pytest.skip(f"no kubelet harness binary: {err}")


@pytest.fixture
def harness(harness_binary: Path) -> Iterator[lab.KubeletHarness]:
    """The kubelet's device manager without a Node (capacity read from GetCapacity)."""
    if os.geteuid() != 0:
        pytest.skip("the kubelet harness needs root (private mount namespace)")
    with lab.KubeletHarness(binary=harness_binary) as k:
        yield k


async def start_fleet(harness: lab.KubeletHarness) -> Fleet:
    fleet = Fleet(FleetSettings(plugin_dir=harness.device_plugin_dir, poll_interval_s=0.05))
    await fleet.start()
    return fleet


@pytest.fixture
async def fleet(harness: lab.KubeletHarness) -> AsyncIterator[Fleet]:
    fleet = await start_fleet(harness)
    yield fleet
    await fleet.stop()


def counts(field: str) -> Callable[[dict[str, Any]], dict[str, int]]:
    return lambda resources: {name: r[field] for name, r in resources.items() if not r.get("removed")}


async def wait_counts(
    harness: lab.KubeletHarness, expected: dict[str, int], field: str = "capacity", timeout: float = 20
) -> dict[str, Any]:
    def match(resources: dict[str, Any]) -> bool:
        got = counts(field)(resources)
        return all(got.get(k) == v for k, v in expected.items())

    return await asyncio.to_thread(harness.wait_resources, match, timeout)


async def admit(harness: lab.KubeletHarness, name: str, limits: dict[str, int]) -> dict[str, Any]:
    return await asyncio.to_thread(harness.admit, name, {"main": limits})


EXPECTED = {GPU: 4, MIG_1G: 4, MIG_3G: 1}


async def test_registers_and_advertises_capacity(harness: lab.KubeletHarness, fleet: Fleet) -> None:
    fleet.update(inventory())
    reply = await wait_counts(harness, EXPECTED)
    assert EXPECTED == {k: v for k, v in counts("allocatable")(reply["resources"]).items() if k in EXPECTED}
    assert {"MIG-a::0", "MIG-a::1", "MIG-b::0", "MIG-b::1"} == set(reply["resources"][MIG_1G]["healthy"])
    assert {"GPU-1::0", "GPU-1::1", "GPU-2::0", "GPU-2::1"} == set(reply["resources"][GPU]["healthy"])


async def test_renamed_shared_resources(harness: lab.KubeletHarness, fleet: Fleet) -> None:
    fleet.update(inventory(rename=True))
    await wait_counts(harness, {SHARED: 4, "nvidia.com/mig-1g.5gb.shared": 4, MIG_3G: 1})


async def test_capacity_follows_inventory_without_reregistering(
    harness: lab.KubeletHarness, fleet: Fleet
) -> None:
    fleet.update(inventory())
    await wait_counts(harness, EXPECTED)
    await fleet.sync()
    sockets = {s.resource: s.socket for s in fleet.status()}
    fleet.update(inventory(gpu_replicas=3))
    await wait_counts(harness, {GPU: 6, MIG_1G: 4, MIG_3G: 1})
    await fleet.sync()
    assert sockets == {s.resource: s.socket for s in fleet.status()}  # a new registration = a new socket
    fleet.update(build_inventory(NodeState((a100(1),)), config()))
    reply = await wait_counts(harness, {GPU: 2, MIG_1G: 0, MIG_3G: 0}, field="allocatable")
    assert 2 == reply["resources"][GPU]["capacity"]


async def test_a_kubelet_restart_is_followed_by_new_registrations_and_admissions(
    harness: lab.KubeletHarness, fleet: Fleet
) -> None:
    fleet.update(inventory())
    await wait_counts(harness, EXPECTED, field="allocatable")
    # The kubelet can show the devices before the fleet has counted the registration that sent them
    # (it counts once the stream is open): the snapshot is of a fleet that has.
    await fleet.wait_until(settled, timeout=scaled(30))
    before = {s.resource: (s.registrations, s.socket) for s in fleet.status()}
    await asyncio.to_thread(harness.restart)

    def reregistered(status: tuple[PluginStatus, ...]) -> bool:
        return settled(status) and all(s.registrations > before[s.resource][0] for s in status)

    await fleet.wait_until(reregistered, timeout=scaled(30))  # how soon: hack/bench agentrestart
    assert not {sock for _, sock in before.values()} & {s.socket for s in fleet.status()}
    # An admission needs the restarted device manager to hold the devices: it takes a plugin's list
    # from its ListAndWatch stream after the registration, and until then refuses every pod asking
    # for the resource ("no healthy devices present", pkg/kubelet/cm/devicemanager/manager.go).
    await wait_counts(harness, EXPECTED, field="allocatable")
    pod = await admit(harness, "after-restart", {MIG_1G: 4, MIG_3G: 1, GPU: 4})
    assert {MIG_1G: 4, MIG_3G: 1, GPU: 4} == {k: len(v) for k, v in pod["containers"][0]["devices"].items()}
    await wait_counts(harness, EXPECTED, field="capacity")


async def test_a_device_withdrawn_while_the_kubelet_allocates_it_stays_in_the_kubelets_list(
    harness: lab.KubeletHarness, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet picks a device, calls Allocate, and reads that device from the plugin's last list
    once Allocate has answered (allocateContainerResources, pkg/kubelet/cm/devicemanager/manager.go,
    Kubernetes v1.37.2). A withdrawal whose list reached it in between left a nil there: the kubelet
    panicked in pod admission (the soak, seed 962061: the harness closed the connection unanswered).
    Here Allocate has handed the device out and its answer is held until the list without it has
    reached the kubelet."""
    answered, release = asyncio.Event(), asyncio.Event()
    handed: list[str] = []
    allocate = DevicePluginService.Allocate

    async def held(
        self: DevicePluginService, request: api.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> api.AllocateResponse:
        response = await allocate(self, request, context)
        if self.resource == GPU and not answered.is_set():
            handed.extend(request.container_requests[0].devices_ids)
            answered.set()
            await release.wait()
        return response

    monkeypatch.setattr(DevicePluginService, "Allocate", held)
    full = inventory()
    fleet.update(full)
    await wait_counts(harness, EXPECTED, field="allocatable")
    admission = asyncio.create_task(admit(harness, "racing", {GPU: 1}))
    async with asyncio.timeout(scaled(60)):
        await answered.wait()
    (device,) = handed
    gpu = device.partition("::")[0]
    left = withdraw(full, {gpu})
    others = {d.id for name, devices in left.resources if name == GPU for d in devices}
    fleet.update(left)
    await asyncio.to_thread(harness.wait_resources, lambda r: set(r[GPU]["healthy"]) == others, scaled(20))
    release.set()
    pod = await admission
    assert [device] == pod["containers"][0]["devices"][GPU]
    client = PodResourcesClient(harness.pod_resources_socket)
    assert {GPU: {device}} == {k: set(v) for k, v in (await client.in_use()).items()}
    assert device not in (await client.allocatable())[GPU]  # withdrawn: offered to no other pod
    # The kubelet lists the pod that holds it (what a change reads): the list no longer needs it.
    fleet.forget_allocated(frozenset({device}))
    reply = await wait_counts(harness, {GPU: len(others)})
    assert others == set(reply["resources"][GPU]["healthy"])


def settled(status: tuple[PluginStatus, ...]) -> bool:
    """Every plugin registered on its socket, its stream open with the first list sent."""
    return bool(status) and all(s.registered and s.streams > 0 for s in status)


async def test_a_kubelet_restarted_with_its_pods_learned_later_lists_them_only_then(
    harness: lab.KubeletHarness, fleet: Fleet
) -> None:
    """The harness restarts as a real kubelet does: PodResources answers, with no pod, until the
    kubelet has learned its pods; the devices the checkpoint gave them are still theirs."""
    fleet.update(inventory())
    await wait_counts(harness, EXPECTED, field="allocatable")
    pod = await admit(harness, "holder", {MIG_3G: 1})
    client = PodResourcesClient(harness.pod_resources_socket)
    assert frozenset({"default/holder"}) == (await client.listing()).pods
    await asyncio.to_thread(harness.restart, learn_later=True)
    assert frozenset() == (await client.listing()).pods
    await asyncio.to_thread(harness.learn)
    listing = await client.listing()
    assert frozenset({"default/holder"}) == listing.pods
    assert [("holder", MIG_3G, frozenset(pod["containers"][0]["devices"][MIG_3G]))] == [
        (h.pod, h.resource, h.device_ids) for h in listing.holdings
    ]


async def test_unhealthy_device_lowers_allocatable_keeps_capacity(
    harness: lab.KubeletHarness, fleet: Fleet
) -> None:
    fleet.update(inventory())
    await wait_counts(harness, EXPECTED, field="allocatable")
    fleet.apply_health(HealthEvent(GpuUuid("GPU-1"), healthy=False, xid=79))
    fleet.apply_health(HealthEvent(GpuUuid("GPU-0"), healthy=False, xid=94, mig_uuid=MigUuid("MIG-b")))
    reply = await wait_counts(harness, {GPU: 2, MIG_1G: 2, MIG_3G: 1}, field="allocatable")
    assert EXPECTED == {k: reply["resources"][k]["capacity"] for k in EXPECTED}
    assert {"GPU-2::0", "GPU-2::1"} == set(reply["resources"][GPU]["healthy"])
    fleet.apply_health(HealthEvent(GpuUuid("GPU-1"), healthy=True))
    fleet.apply_health(HealthEvent(GpuUuid("GPU-0"), healthy=True, mig_uuid=MigUuid("MIG-b")))
    await wait_counts(harness, EXPECTED, field="allocatable")


async def test_admitted_pods_get_the_right_devices(harness: lab.KubeletHarness, fleet: Fleet) -> None:
    fleet.update(inventory(gpu_replicas=1))  # GPUs 1 and 2 whole, GPU 0's MIG devices as before
    await wait_counts(harness, {GPU: 2, MIG_1G: 4, MIG_3G: 1}, field="allocatable")

    whole = await admit(harness, "whole", {GPU: 2})
    # The kubelet passes the IDs in no particular order; Allocate keeps the order it was given.
    assert ["GPU-1", "GPU-2"] == sorted(whole["containers"][0]["envs"]["NVIDIA_VISIBLE_DEVICES"].split(","))
    mig = await admit(harness, "mig", {MIG_3G: 1})
    assert "MIG-c" == mig["containers"][0]["envs"]["NVIDIA_VISIBLE_DEVICES"]

    # Two replicas: GetPreferredAllocation spreads them over the two 1g.5gb devices.
    shared = await admit(harness, "shared", {MIG_1G: 2})
    (container,) = shared["containers"]
    assert ["MIG-a", "MIG-b"] == sorted(container["envs"]["NVIDIA_VISIBLE_DEVICES"].split(","))
    assert 2 == len(container["devices"][MIG_1G])

    in_use = await PodResourcesClient(harness.pod_resources_socket).in_use()
    assert {GPU: {"GPU-1", "GPU-2"}, MIG_3G: {"MIG-c"}, MIG_1G: set(container["devices"][MIG_1G])} == {
        k: set(v) for k, v in in_use.items()
    }
    await asyncio.to_thread(harness.delete_pod, "whole")
    in_use = await PodResourcesClient(harness.pod_resources_socket).in_use()
    assert GPU not in in_use


async def test_replicas_of_one_gpu_are_one_visible_device(harness: lab.KubeletHarness, fleet: Fleet) -> None:
    fleet.update(build_inventory(NodeState((a100(1),)), config(gpu_replicas=4)))
    await wait_counts(harness, {GPU: 4}, field="allocatable")
    pod = await admit(harness, "two-replicas", {GPU: 2})
    assert "GPU-1" == pod["containers"][0]["envs"]["NVIDIA_VISIBLE_DEVICES"]


async def test_fail_requests_greater_than_one(harness: lab.KubeletHarness, fleet: Fleet) -> None:
    fleet.update(inventory(fail_gt_one=True))
    await wait_counts(harness, EXPECTED, field="allocatable")
    with pytest.raises(lab.AdmissionError) as err:
        await admit(harness, "greedy", {GPU: 2})
    assert "failRequestsGreaterThanOne" in str(err.value.args) + err.value.error
    ok = await admit(harness, "modest", {GPU: 1})
    assert ok["containers"][0]["envs"]["NVIDIA_VISIBLE_DEVICES"] in {"GPU-1", "GPU-2"}


async def test_malformed_and_unknown_requests_get_grpc_errors(
    harness: lab.KubeletHarness, fleet: Fleet
) -> None:
    fleet.update(inventory())
    await wait_counts(harness, EXPECTED, field="allocatable")
    await fleet.sync()
    socket = next(s.socket for s in fleet.status() if s.resource == GPU)
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = api_grpc.DevicePluginStub(channel)
        cases = {
            "unknown device IDs GPU-9::0": api.AllocateRequest(
                container_requests=[api.ContainerAllocateRequest(devices_ids=["GPU-9::0"])]
            ),
            "without container requests": api.AllocateRequest(),
        }
        for message, request in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Allocate(request)
            assert (grpc.StatusCode.INVALID_ARGUMENT, True) == (
                err.value.code(),
                message in err.value.details(),
            )
        bad = api.PreferredAllocationRequest(
            container_requests=[api.ContainerPreferredAllocationRequest(available_deviceIDs=["GPU-1::0"])]
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetPreferredAllocation(bad)
        assert grpc.StatusCode.INVALID_ARGUMENT == err.value.code()
    # The plugin keeps serving after refusing.
    await wait_counts(harness, EXPECTED, field="allocatable")


async def test_node_status_shows_the_slices(
    kubelet: lab.KubeletHarness, control_plane: lab.ControlPlane
) -> None:
    fleet = await start_fleet(kubelet)
    try:
        fleet.update(inventory())
        fleet.apply_health(HealthEvent(GpuUuid("GPU-2"), healthy=False, xid=79))

        def node_counts() -> tuple[dict[str, str], dict[str, str]]:
            r = control_plane.kubectl("get", "node", str(kubelet.node_name), "-o", "json")
            status = json.loads(r.stdout)["status"] if r.returncode == 0 else {}
            pick = {GPU, MIG_1G, MIG_3G}
            return (
                {k: v for k, v in status.get("capacity", {}).items() if k in pick},
                {k: v for k, v in status.get("allocatable", {}).items() if k in pick},
            )

        deadline = time.monotonic() + scaled(30)
        want = ({GPU: "4", MIG_1G: "4", MIG_3G: "1"}, {GPU: "2", MIG_1G: "4", MIG_3G: "1"})
        while (got := await asyncio.to_thread(node_counts)) != want and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # polling the apiserver; the Node has no change feed here
        assert want == got
        assert HealthState(unhealthy_gpus=frozenset({GpuUuid("GPU-2")})) == fleet.health
    finally:
        await fleet.stop()
