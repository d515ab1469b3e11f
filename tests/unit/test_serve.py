"""sharing.deviceplugin against the Python fake kubelet: registration, updates, restarts, health, RPCs."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from sharing.deviceplugin import Fleet, FleetSettings
from sharing.deviceplugin.service import DeviceFeed, to_proto
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, inventory_from
from sharing.kubelet import PodResourcesClient
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.kubelet.api import podresources_v1_pb2 as prapi
from sharing.kubelet.api import podresources_v1_pb2_grpc as prapi_grpc
from sharing.model import GpuUuid, HealthEvent, MigUuid
from tests.unit.fakekubelet import FakeKubelet, is_extended_resource_name

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.5gb"


def replicas(gpu: str, n: int, numa: int | None = None) -> list[Device]:
    return [Device(DeviceId(f"{gpu}::{i}"), Health.HEALTHY, numa, GpuUuid(gpu), replica=i) for i in range(n)]


def migs(gpu: str, *uuids: str) -> list[Device]:
    return [Device(DeviceId(u), Health.HEALTHY, 0, GpuUuid(gpu), MigUuid(u)) for u in uuids]


INVENTORY = inventory_from(
    {GPU: replicas("GPU-1", 2, numa=0) + replicas("GPU-2", 2), MIG: migs("GPU-0", "MIG-a", "MIG-b")}
)


def counts(kubelet: FakeKubelet) -> tuple[dict[str, int], dict[str, int]]:
    return kubelet.capacity(), kubelet.allocatable()


async def test_registers_one_plugin_per_resource(
    kubelet: FakeKubelet, fleet: Fleet, plugin_dir: Path
) -> None:
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.capacity() == {GPU: 4, MIG: 2})
    assert ({GPU: 4, MIG: 2}, {GPU: 4, MIG: 2}) == counts(kubelet)
    assert {GPU: {"GPU-1::0", "GPU-1::1", "GPU-2::0", "GPU-2::1"}} == {GPU: set(kubelet.devices(GPU))}
    sockets = sorted(ep for _, ep in kubelet.registrations)
    assert [s.startswith(("gpu-sharing-gpu-", "gpu-sharing-mig-1g.5gb-")) for s in sockets] == [True, True]
    assert all((plugin_dir / s).is_socket() for s in sockets)
    options = kubelet.endpoints[GPU].options
    assert (True, False) == (options.get_preferred_allocation_available, options.pre_start_required)
    await fleet.sync()
    assert [(s.resource, s.registered, s.devices) for s in fleet.status()] == [(GPU, True, 4), (MIG, True, 2)]


async def test_topology_is_sent_when_numa_is_known(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.capacity().get(GPU) == 4)
    stream = kubelet.plugin(GPU).ListAndWatch(api.Empty())
    first = await anext(aiter(stream))
    stream.cancel()
    topology = {d.ID: [n.ID for n in d.topology.nodes] for d in first.devices}
    assert {"GPU-1::0": [0], "GPU-1::1": [0], "GPU-2::0": [], "GPU-2::1": []} == topology


async def test_inventory_changes_are_pushed_without_reregistering(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.capacity() == {GPU: 4, MIG: 2})
    fleet.update(inventory_from({GPU: replicas("GPU-1", 3), MIG: migs("GPU-0", "MIG-a")}))
    await kubelet.wait(lambda: kubelet.capacity() == {GPU: 3, MIG: 1})
    assert (1, 1) == (kubelet.registered(GPU), kubelet.registered(MIG))


async def test_removed_resource_stops_and_new_one_registers(
    kubelet: FakeKubelet, fleet: Fleet, plugin_dir: Path
) -> None:
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.capacity() == {GPU: 4, MIG: 2})
    mig_socket = kubelet.endpoints[MIG].socket
    fleet.update(
        inventory_from({GPU: replicas("GPU-1", 4), "nvidia.com/mig-3g.20gb": migs("GPU-0", "MIG-c")})
    )
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 0, "nvidia.com/mig-3g.20gb": 1})
    assert not mig_socket.exists()
    assert 1 == kubelet.registered(GPU)
    assert [GPU, "nvidia.com/mig-3g.20gb"] == [s.resource for s in fleet.status()]


async def test_bursts_coalesce_latest_wins(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(INVENTORY)
    # Both plugins registered: the burst withdraws MIG, whose capacity the kubelet then keeps (unhealthy)
    # only if it was ever registered; a wait on GPU alone let the burst start before it was.
    await kubelet.wait(lambda: kubelet.capacity() == {GPU: 4, MIG: 2})
    before = kubelet.endpoints[GPU].updates
    for n in range(1, 51):
        fleet.update(inventory_from({GPU: replicas("GPU-1", n)}))
    await fleet.sync()
    await kubelet.wait(lambda: kubelet.capacity() == {GPU: 50, MIG: 2})
    assert kubelet.endpoints[GPU].updates - before < 50
    assert 1 == kubelet.registered(GPU)


async def test_kubelet_restart_reregisters_on_fresh_sockets(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 2})
    old = {ep for _, ep in kubelet.registrations}
    await kubelet.restart()
    assert {GPU: 0, MIG: 0} == kubelet.capacity()
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 2})
    assert (2, 2) == (kubelet.registered(GPU), kubelet.registered(MIG))
    assert not old & {ep for _, ep in kubelet.registrations[2:]}


async def test_dropped_stream_reregisters(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 2})
    await kubelet.end_stream(MIG)
    await kubelet.wait(lambda: kubelet.registered(MIG) == 2 and kubelet.allocatable() == {GPU: 4, MIG: 2})
    assert 1 == kubelet.registered(GPU)


async def test_registers_when_the_kubelet_comes_up(plugin_dir: Path, fleet: Fleet) -> None:
    fleet.update(INVENTORY)
    await fleet.sync()
    assert [(s.resource, s.registered) for s in fleet.status()] == [(GPU, False), (MIG, False)]
    kubelet = await FakeKubelet(plugin_dir).start()
    try:
        await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 2})
    finally:
        await kubelet.stop()


async def test_refused_registration_is_reported_and_retried(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(inventory_from({"gpu": replicas("GPU-1", 1), GPU: replicas("GPU-2", 1)}))
    await kubelet.wait(lambda: len(kubelet.refusals) >= 2 and kubelet.capacity() == {GPU: 1})
    await fleet.sync()
    bad = next(s for s in fleet.status() if s.resource == "gpu")
    assert not bad.registered
    assert bad.last_error is not None
    assert 'the ResourceName "gpu" is invalid' in bad.last_error


async def test_health_events_flip_devices_without_restart(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 2})
    assert not fleet.apply_health(HealthEvent(GpuUuid("GPU-1"), healthy=False, xid=13))  # application XID
    assert fleet.apply_health(HealthEvent(GpuUuid("GPU-1"), healthy=False, xid=79))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2, MIG: 2})
    assert {GPU: 4, MIG: 2} == kubelet.capacity()
    assert fleet.apply_health(HealthEvent(GpuUuid("GPU-0"), healthy=False, xid=48, mig_uuid=MigUuid("MIG-b")))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2, MIG: 1})
    assert "Unhealthy" == kubelet.devices(MIG)["MIG-b"]
    assert fleet.apply_health(HealthEvent(GpuUuid("GPU-1"), healthy=True))
    assert fleet.apply_health(HealthEvent(GpuUuid("GPU-0"), healthy=True))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 2})
    assert (1, 1) == (kubelet.registered(GPU), kubelet.registered(MIG))


async def test_health_survives_inventory_updates(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.apply_health(HealthEvent(GpuUuid("GPU-2"), healthy=False, xid=79))
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2, MIG: 2})
    fleet.update(inventory_from({GPU: replicas("GPU-2", 3)}))
    await kubelet.wait(lambda: kubelet.capacity().get(GPU) == 3)
    assert 0 == kubelet.allocatable()[GPU]


# --- the RPCs the kubelet calls ------------------------------------------------------------


@pytest.fixture
async def served(kubelet: FakeKubelet, fleet: Fleet) -> FakeKubelet:
    fleet.update(
        Inventory(
            resources=inventory_from(
                {GPU: replicas("GPU-1", 2) + replicas("GPU-2", 2), MIG: migs("GPU-0", "MIG-a")}
            ).resources,
            fail_requests_greater_than_one=False,
        )
    )
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 1})
    return kubelet


def allocate_request(*containers: list[str]) -> api.AllocateRequest:
    return api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )


async def test_allocate_returns_visible_devices(served: FakeKubelet) -> None:
    reply = await served.plugin(GPU).Allocate(
        allocate_request(["GPU-1::0", "GPU-1::1"], ["GPU-2::0", "GPU-1::0"])
    )
    envs = [dict(r.envs) for r in reply.container_responses]
    assert [{"NVIDIA_VISIBLE_DEVICES": "GPU-1"}, {"NVIDIA_VISIBLE_DEVICES": "GPU-2,GPU-1"}] == envs
    reply = await served.plugin(MIG).Allocate(allocate_request(["MIG-a"]))
    assert {"NVIDIA_VISIBLE_DEVICES": "MIG-a"} == dict(reply.container_responses[0].envs)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        pytest.param(
            allocate_request(["GPU-1::0", "GPU-9::0"]), "unknown device IDs GPU-9::0", id="unknown-id"
        ),
        pytest.param(allocate_request(), "Allocate without container requests", id="no-containers"),
        pytest.param(allocate_request([]), "names no devices", id="no-devices"),
        pytest.param(allocate_request(["GPU-1::0", "GPU-1::0"]), "more than once", id="duplicate"),
    ],
)
async def test_bad_allocate_is_invalid_argument(
    served: FakeKubelet, request_: api.AllocateRequest, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await served.plugin(GPU).Allocate(request_)
    assert grpc.StatusCode.INVALID_ARGUMENT == err.value.code()
    assert message in (err.value.details() or "")


async def test_fail_requests_greater_than_one(kubelet: FakeKubelet, fleet: Fleet) -> None:
    fleet.update(inventory_from({GPU: replicas("GPU-1", 2)}, fail_requests_greater_than_one=True))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kubelet.plugin(GPU).Allocate(allocate_request(["GPU-1::0", "GPU-1::1"]))
    assert grpc.StatusCode.INVALID_ARGUMENT == err.value.code()
    assert "failRequestsGreaterThanOne" in (err.value.details() or "")
    reply = await kubelet.plugin(GPU).Allocate(allocate_request(["GPU-1::1"]))
    assert {"NVIDIA_VISIBLE_DEVICES": "GPU-1"} == dict(reply.container_responses[0].envs)


async def test_preferred_allocation_spreads_replicas(served: FakeKubelet) -> None:
    request = api.PreferredAllocationRequest(
        container_requests=[
            api.ContainerPreferredAllocationRequest(
                available_deviceIDs=["GPU-1::0", "GPU-1::1", "GPU-2::0", "GPU-2::1"], allocation_size=2
            )
        ]
    )
    reply = await served.plugin(GPU).GetPreferredAllocation(request)
    assert [["GPU-1::0", "GPU-2::0"]] == [list(r.deviceIDs) for r in reply.container_responses]
    bad = api.PreferredAllocationRequest(
        container_requests=[
            api.ContainerPreferredAllocationRequest(available_deviceIDs=["GPU-1::0"], allocation_size=0)
        ]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await served.plugin(GPU).GetPreferredAllocation(bad)
    assert grpc.StatusCode.INVALID_ARGUMENT == err.value.code()


async def test_prestart_is_a_noop(served: FakeKubelet) -> None:
    reply = await served.plugin(GPU).PreStartContainer(api.PreStartContainerRequest(devices_ids=["GPU-1::0"]))
    assert api.PreStartContainerResponse() == reply


async def test_stop_removes_sockets(kubelet: FakeKubelet, plugin_dir: Path) -> None:
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    await fleet.start()
    fleet.update(INVENTORY)
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4, MIG: 2})
    await fleet.stop()
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 0, MIG: 0})
    assert [p.name for p in plugin_dir.iterdir() if p.name != "kubelet.sock"] == []


# --- building blocks -----------------------------------------------------------------------


async def test_feed_sends_current_then_latest() -> None:
    feed = DeviceFeed(tuple(replicas("GPU-1", 1)))
    seen: list[int] = []

    async def consume() -> None:
        async for devices in feed.watch():
            seen.append(len(devices))

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    for n in (2, 3, 4):
        feed.publish(tuple(replicas("GPU-1", n)))
    assert not feed.publish(tuple(replicas("GPU-1", 4)))
    feed.close()
    await asyncio.wait_for(task, 1)
    assert [1, 4] == seen


def test_feed_response_is_what_the_kubelet_would_get_from_each_device() -> None:
    """The response built from cached per-device bytes equals one built device by device: order,
    health flips, NUMA or not, an ID long enough for a two-byte length, a device listed twice."""
    long_id = Device(DeviceId("MIG-" + "f" * 200), Health.HEALTHY, None, GpuUuid("GPU-9"), MigUuid("MIG-x"))
    devices = (*replicas("GPU-1", 3, numa=1), *replicas("GPU-2", 2), long_id)
    feed = DeviceFeed(devices)

    def plain(listed: tuple[Device, ...]) -> api.ListAndWatchResponse:
        return api.ListAndWatchResponse(devices=[to_proto(d) for d in listed])

    assert feed.response(devices) == plain(devices)
    flipped = tuple(replace(d, health=Health.UNHEALTHY) if d.gpu_uuid == "GPU-1" else d for d in devices)
    feed.publish(flipped)
    assert feed.response(flipped) == plain(flipped)
    assert [d.health for d in feed.response(flipped).devices][:3] == [Health.UNHEALTHY.value] * 3
    twice = (*flipped, flipped[0])
    feed.publish(twice)
    assert feed.response(twice) == plain(twice)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/mig-1g.5gb.shared", True),
        ("gpu", False),
        ("kubernetes.io/gpu", False),
        ("nvidia.com/" + "x" * 63, True),
        ("nvidia.com/" + "x" * 64, False),
    ],
)
def test_fake_kubelet_resource_name_rule(name: str, ok: bool) -> None:
    assert ok == is_extended_resource_name(name)


class _FakePodResources:
    async def Get(self, request: prapi.GetPodResourcesRequest, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not used")

    async def List(
        self, request: prapi.ListPodResourcesRequest, context: object
    ) -> prapi.ListPodResourcesResponse:
        def devices(resource: str, *ids: str) -> list[prapi.ContainerDevices]:
            # The kubelet sends one entry per device (and NUMA node).
            return [prapi.ContainerDevices(resource_name=resource, device_ids=[i]) for i in ids]

        pods = [
            prapi.PodResources(
                name="a",
                namespace="default",
                containers=[
                    prapi.ContainerResources(
                        name="c1", devices=devices(MIG, "MIG-a") + devices(GPU, "GPU-1::0")
                    ),
                    prapi.ContainerResources(name="c2", devices=devices(GPU, "GPU-1::0", "GPU-2::1")),
                ],
            ),
            prapi.PodResources(name="b", namespace="x", containers=[prapi.ContainerResources(name="c")]),
        ]
        return prapi.ListPodResourcesResponse(pod_resources=pods)

    async def GetAllocatableResources(
        self, request: prapi.AllocatableResourcesRequest, context: object
    ) -> prapi.AllocatableResourcesResponse:
        return prapi.AllocatableResourcesResponse(
            devices=[prapi.ContainerDevices(resource_name=MIG, device_ids=["MIG-a", "MIG-b"])]
        )


async def test_pod_resources_client_aggregates(plugin_dir: Path) -> None:
    server = grpc.aio.server()
    prapi_grpc.add_PodResourcesListerServicer_to_server(_FakePodResources(), server)
    socket = plugin_dir / "pr.sock"
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    try:
        client = PodResourcesClient(socket)
        assert {MIG: frozenset({"MIG-a"}), GPU: frozenset({"GPU-1::0", "GPU-2::1"})} == await client.in_use()
        assert {MIG: frozenset({"MIG-a", "MIG-b"})} == await client.allocatable()
    finally:
        await server.stop(None)


async def test_pod_resources_client_error_says_where(plugin_dir: Path) -> None:
    client = PodResourcesClient(plugin_dir / "absent.sock", timeout=0.5)
    with pytest.raises(Exception, match=r"PodResources List on .*absent.sock failed"):
        await client.in_use()
