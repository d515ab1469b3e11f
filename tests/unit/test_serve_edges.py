"""The device-plugin servers at their edges: hostile requests, a slow kubelet, sockets a kill left behind.

Each test reproduces a defect found by trying the plugins as an attacker and a crashing node would.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest
from lab.deadlines import scaled

from sharing.deviceplugin import Fleet, FleetSettings
from sharing.deviceplugin import plugin as plugin_module
from sharing.deviceplugin.plugin import PluginServer
from sharing.devices.inventory import inventory_from
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from tests.unit.fakekubelet import FakeKubelet
from tests.unit.test_serve import GPU, MIG, migs, replicas

MIG_3G = "nvidia.com/mig-3g.20gb"


@pytest.fixture
async def served(kubelet: FakeKubelet, fleet: Fleet) -> FakeKubelet:
    fleet.update(inventory_from({GPU: replicas("GPU-1", 2), MIG: migs("GPU-0", "MIG-a")}))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2, MIG: 1})
    return kubelet


def allocate(*ids: str) -> api.AllocateRequest:
    return api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=list(ids))])


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param([f"GPU-x-{n}" for n in range(10_000)], id="10000-unknown-ids"),
        pytest.param(["G" * (1 << 20)], id="one-1MiB-id"),
    ],
)
async def test_a_huge_bad_allocate_is_invalid_argument_with_a_bounded_message(
    served: FakeKubelet, ids: list[str]
) -> None:
    """The message used to echo the whole request: past gRPC's metadata limit it became RESOURCE_EXHAUSTED."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await served.plugin(GPU).Allocate(allocate(*ids))
    assert grpc.StatusCode.INVALID_ARGUMENT == err.value.code()
    details = err.value.details() or ""
    assert "unknown device IDs" in details
    assert len(details) < 1100


async def test_preferred_allocation_refuses_must_include_ids_outside_the_available_list(
    served: FakeKubelet,
) -> None:
    request = api.PreferredAllocationRequest(
        container_requests=[
            api.ContainerPreferredAllocationRequest(
                available_deviceIDs=["GPU-1::1"], must_include_deviceIDs=["GPU-1::0"], allocation_size=1
            )
        ]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await served.plugin(GPU).GetPreferredAllocation(request)
    assert grpc.StatusCode.INVALID_ARGUMENT == err.value.code()
    assert "GPU-1::0 are not in the available list" in (err.value.details() or "")


async def test_a_slow_registration_holds_back_no_other_resource(kubelet: FakeKubelet, fleet: Fleet) -> None:
    """Register may wait up to its timeout; the other plugins' devices and health must still flow."""
    kubelet.hold[MIG_3G] = asyncio.Event()
    fleet.update(inventory_from({GPU: replicas("GPU-1", 2), MIG_3G: migs("GPU-0", "MIG-c")}))
    await kubelet.wait(lambda: kubelet.allocatable().get(GPU) == 2)
    fleet.update(inventory_from({GPU: replicas("GPU-1", 3), MIG_3G: migs("GPU-0", "MIG-c")}))
    await kubelet.wait(lambda: kubelet.allocatable().get(GPU) == 3)
    assert MIG_3G not in kubelet.allocatable()  # still waiting for its Register answer
    kubelet.hold[MIG_3G].set()
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 3, MIG_3G: 1})


async def test_sockets_a_killed_agent_left_are_removed_at_start(
    kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    """kill -9 leaves the sockets behind (66 after 56 kills); only ours that nothing listens on are
    removed, nothing else."""
    left = []
    for name in ("gpu-sharing-gpu-0a1b2c3d.sock", "gpu-sharing-mig-1g.5gb-00ff00ff.sock"):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(plugin_dir / name))
        s.close()
        left.append(plugin_dir / name)
    theirs = plugin_dir / "nvidia-gpu.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(theirs))
    s.close()
    # A rolling update's old agent still serves beside the new one: its socket is ours by name, alive.
    serving = socket.socket(socket.AF_UNIX)
    serving.bind(str(plugin_dir / "gpu-sharing-gpu-feedf00d.sock"))
    serving.listen()
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02))
    await fleet.start()
    try:
        assert [p.exists() for p in left] == [False, False]
        assert theirs.exists()
        assert (plugin_dir / "gpu-sharing-gpu-feedf00d.sock").exists()
        assert (plugin_dir / "kubelet.sock").exists()
    finally:
        serving.close()
        await fleet.stop()


async def test_a_device_handed_out_counts_as_held_until_the_kubelet_lists_it(
    served: FakeKubelet, fleet: Fleet
) -> None:
    """The kubelet records a pod's devices only after Allocate returns: the plugin remembers them."""
    await served.plugin(MIG).Allocate(allocate("MIG-a"))
    assert frozenset({"MIG-a"}) == fleet.recently_allocated(30)
    fleet.forget_allocated(frozenset({"MIG-a"}))
    assert frozenset() == fleet.recently_allocated(30)


async def test_a_device_handed_out_counts_as_held_across_a_kubelet_restart(
    served: FakeKubelet, fleet: Fleet
) -> None:
    """A kubelet restart makes every plugin register again on a fresh server: the memory of what was
    handed out a moment ago used to go with the old server, so a device the kubelet had not listed
    yet counted as free."""
    await served.plugin(MIG).Allocate(allocate("MIG-a"))
    registered = served.registered(MIG)
    await served.restart()
    await served.wait(lambda: served.registered(MIG) > registered and served.allocatable()[MIG] == 1)
    assert frozenset({"MIG-a"}) == fleet.recently_allocated(30)


async def test_a_device_handed_out_then_withdrawn_stays_listed_unhealthy_until_the_kubelet_lists_it(
    kubelet: FakeKubelet, fleet: Fleet
) -> None:
    """The kubelet reads a device it allocated from the plugin's last list once Allocate has answered:
    a withdrawal must not take it out of that list before the kubelet has recorded the allocation
    (tests/integration/test_deviceplugin_kubelet.py shows the kubelet's panic). Kept, it is offered
    to no other pod, and an Allocate that names it again is refused."""
    fleet.update(inventory_from({GPU: replicas("GPU-1", 2) + replicas("GPU-2", 2)}))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 4})
    await kubelet.plugin(GPU).Allocate(allocate("GPU-1::0"))
    fleet.update(inventory_from({GPU: replicas("GPU-2", 2)}))  # GPU-1 withdrawn
    listed = {"GPU-1::0": "Unhealthy", "GPU-2::0": "Healthy", "GPU-2::1": "Healthy"}
    await kubelet.wait(lambda: kubelet.devices(GPU) == listed)
    for again, why in (("GPU-1::0", "not healthy"), ("GPU-1::1", "unknown device IDs")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kubelet.plugin(GPU).Allocate(allocate(again))
        assert grpc.StatusCode.INVALID_ARGUMENT == err.value.code()
        assert why in str(err.value.details())
    fleet.forget_allocated(frozenset({"GPU-1::0"}))  # the kubelet lists the pod that got it
    await kubelet.wait(lambda: kubelet.devices(GPU) == {"GPU-2::0": "Healthy", "GPU-2::1": "Healthy"})


async def test_a_device_kept_for_an_allocate_goes_when_its_time_is_up(
    kubelet: FakeKubelet, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod the kubelet never lists (its admission failed on another resource) keeps nothing listed
    for long: the fleet wakes when the record's time is up, with no other update to carry it. (The
    window, shortened here, must outlast the moment from Allocate to the update: a deadline, scaled.)"""
    monkeypatch.setattr(plugin_module, "HANDED_OUT_KEPT_S", scaled(2.0))
    fleet.update(inventory_from({GPU: replicas("GPU-1", 1) + replicas("GPU-2", 1)}))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2})
    await kubelet.plugin(GPU).Allocate(allocate("GPU-1::0"))
    fleet.update(inventory_from({GPU: replicas("GPU-2", 1)}))
    await kubelet.wait(lambda: kubelet.devices(GPU) == {"GPU-1::0": "Unhealthy", "GPU-2::0": "Healthy"})
    await kubelet.wait(lambda: kubelet.devices(GPU) == {"GPU-2::0": "Healthy"})


async def test_a_registration_the_kubelet_drops_before_its_stream_is_made_again(
    kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    """Seen under load: a kubelet restart made the fleet register nvidia.com/gpu twice in 7 ms; the
    first endpoint's stream ended after the second Register, the kubelet dropped the second client
    before its ListAndWatch (kubernetes#121994), and the resource stayed at allocatable 0 while
    the fleet, its Register answered, believed itself registered."""
    kubelet.drop_before_watch.add(GPU)
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, poll_interval_s=0.02, stream_timeout_s=0.5))
    await fleet.start()
    try:
        fleet.update(inventory_from({GPU: replicas("GPU-1", 2)}))
        await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2})
        assert 2 == kubelet.registered(GPU)
    finally:
        await fleet.stop()


async def test_a_withdrawal_while_a_plugin_restarts_reaches_the_kubelet_with_its_first_list(
    kubelet: FakeKubelet, plugin_dir: Path
) -> None:
    """A kubelet restart makes every plugin start again on a fresh socket. A withdrawal published
    while its gRPC server started went to the feed before the new one and was lost: the
    registration then handed the kubelet the withdrawn devices as healthy (the soak, seed 1111 step
    131: replicas of GPUs already in MIG mode offered as `nvidia.com/gpu`)."""
    server = PluginServer(GPU, plugin_dir)
    server.update(tuple(replicas("GPU-1", 2) + replicas("GPU-2", 2)), False)
    starting = asyncio.create_task(server.start())
    await asyncio.sleep(0)  # the start is under way, inside grpc's server start
    assert not starting.done()
    server.update(tuple(replicas("GPU-2", 2)), False)  # GPU-1's replicas withdrawn meanwhile
    await starting
    try:
        await server.register(plugin_dir / "kubelet.sock", timeout=10)
        await kubelet.wait(lambda: kubelet.capacity().get(GPU) == 2)
        assert {"GPU-2::0", "GPU-2::1"} == set(kubelet.devices(GPU))
    finally:
        await server.stop()


async def test_a_plugin_start_cancelled_midway_leaves_nothing_serving(plugin_dir: Path) -> None:
    """The fleet cancels a registration when its resource goes; a server half started must not stay
    behind on a socket (serving the devices it had) that nothing stops."""
    server = PluginServer(GPU, plugin_dir)
    server.update(tuple(replicas("GPU-1", 2)), False)
    starting = asyncio.create_task(server.start())
    await asyncio.sleep(0)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not server.serving
    assert [] == [p.name for p in plugin_dir.iterdir()]


async def test_a_resource_withdrawn_while_its_plugin_registers_again_is_never_offered_again(
    kubelet: FakeKubelet, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak (seed 1111): a kubelet restart made every plugin register again, and a change withdrew
    a resource meanwhile. The fleet cancelled that registration, but grpcio's server stop, where the
    registration was, swallowed the cancellation (grpcio 1.85, measured: 8 of 150 tries of this
    sequence); the registration then served the withdrawn devices on a fresh socket and the kubelet
    offered them healthy after they were destroyed. Here the stop holds the registration until the
    withdrawal is under way, and swallows its cancellation as grpcio's does."""
    servers = grpc.aio._server.Server  # the class grpc.aio.server() makes
    real_stop = servers.stop
    inside, release = asyncio.Event(), asyncio.Event()

    async def stop(self: grpc.aio._server.Server, grace: float | None) -> None:
        task = asyncio.current_task()
        if task is not None and task.get_name() == f"register-{MIG}":
            inside.set()
            try:
                await asyncio.shield(release.wait())
            except asyncio.CancelledError:
                await release.wait()  # as grpcio's: the stop goes on, and the task with it
        await real_stop(self, grace)

    fleet.update(inventory_from({GPU: replicas("GPU-1", 2), MIG: migs("GPU-0", "MIG-a")}))
    await kubelet.wait(lambda: kubelet.allocatable() == {GPU: 2, MIG: 1})
    monkeypatch.setattr(servers, "stop", stop)
    await kubelet.restart()
    await asyncio.wait_for(inside.wait(), scaled(5))  # MIG's registration again: stopping its server
    fleet.update(inventory_from({GPU: replicas("GPU-1", 2)}))  # the MIG devices withdrawn
    withdrawn = asyncio.create_task(fleet.sync())
    release.set()
    await withdrawn
    registering = [t for t in asyncio.all_tasks() if t.get_name() == f"register-{MIG}"]
    await asyncio.wait_for(asyncio.gather(*registering, return_exceptions=True), scaled(15))
    await kubelet.wait(lambda: kubelet.allocatable().get(GPU) == 2)
    assert 0 == kubelet.allocatable().get(MIG, 0)
    assert [] == [p.name for p in kubelet.plugin_dir.iterdir() if "mig" in p.name]
