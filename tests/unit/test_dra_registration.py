"""The DRA pool waits for the kubelet: no device is added before the kubelet has confirmed the plugin's
registration, at the agent's start and again after a kubelet restart; each agent process serves
sockets of its own and removes only those nothing answers on.

A pod the scheduler places on a device of a driver the kubelet does not know yet fails "DRA driver
gpu.nvidia.com is not registered" and waits out the kubelet's retry: a restarted agent's pods sat in
ContainerCreating for over a minute.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from sharing.config.spec import MigStrategy, Rule, Selector, SharingConfig
from sharing.devices import build_inventory
from sharing.dra import DraPaths
from sharing.dra.frontend import DraFrontEnd
from sharing.dra.plugin import DraPlugin
from sharing.gpu.devfiles import DeviceFiles
from sharing.kubelet.api import pluginregistration_v1_pb2 as reg
from sharing.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from sharing.mig import default_catalog
from sharing.model import DriverInfo, Gpu, GpuUuid, NodeState
from tests.polling import until
from tests.unit.fakekube import FakeKube

CATALOG = default_catalog()
NODE_NAME = "node-a"


def _h100(i: int) -> Gpu:
    return Gpu(i, GpuUuid(f"GPU-{i}"), "NVIDIA H100 80GB HBM3", 81559, False, False, False, (),
               compute_capability=(9, 0), minor=i)  # fmt: skip


NODE = NodeState((_h100(0), _h100(1)), driver=DriverInfo("550.107.02", 12040))
INVENTORY = build_inventory(
    NODE, SharingConfig(name="whole", mig_strategy=MigStrategy.MIXED, rules=(Rule(Selector(all=True)),))
)


def held(kube: FakeKube) -> set[str]:
    """The device names of the pool as the API server holds it."""
    return {d.name for s in kube.slices.values() for d in s.spec.devices}


async def notify(plugin: DraPlugin, registered: bool = True) -> None:
    """What the kubelet's plugin watcher does with a registration socket it finds."""
    async with grpc.aio.insecure_channel(f"unix://{plugin.paths.registration_socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        await stub.GetInfo(reg.InfoRequest(), timeout=5)
        status = reg.RegistrationStatus(plugin_registered=registered, error="" if registered else "refused")
        await stub.NotifyRegistrationStatus(status, timeout=5)


def make_socket(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


@pytest.fixture
def dirs(plugin_dir: Path) -> DraPaths:
    """Under a short directory: unix socket paths are limited to 107 bytes."""
    return DraPaths(plugin_dir / "plugins", plugin_dir / "plugins_registry")


@pytest.fixture
async def front(dirs: DraPaths, plugin_dir: Path) -> AsyncIterator[tuple[DraFrontEnd, FakeKube, Path]]:
    kube = FakeKube(NODE_NAME, {})
    kubelet_sock = plugin_dir / "device-plugins" / "kubelet.sock"
    kubelet = make_socket(kubelet_sock)
    dra = DraFrontEnd(
        kube=cast(Any, kube), node_name=NODE_NAME, files=cast(DeviceFiles, None), cdi_dir=plugin_dir / "cdi",
        catalog=CATALOG, paths=dirs, kubelet_socket=kubelet_sock, kubelet_poll_s=0.01,
    )  # fmt: skip
    try:
        await dra.start()
        yield dra, kube, kubelet_sock
    finally:
        await dra.stop()
        kubelet.close()


async def test_the_pool_adds_no_device_until_the_kubelet_confirms_the_registration(
    front: tuple[DraFrontEnd, FakeKube, Path],
) -> None:
    dra, kube, _ = front
    assert "" == await dra.publish(INVENTORY, NODE)
    assert set() == held(kube)
    await notify(dra.plugin, registered=False)  # refused: still nothing
    assert "" == await dra.publish(INVENTORY, NODE)
    assert set() == held(kube)
    await notify(dra.plugin)
    await until("the pool published", lambda: held(kube) == {"gpu-0", "gpu-1"})


async def test_a_withdrawal_goes_through_while_additions_wait(
    front: tuple[DraFrontEnd, FakeKube, Path],
) -> None:
    dra, kube, kubelet_sock = front
    await notify(dra.plugin)
    assert "" == await dra.publish(INVENTORY, NODE)
    await until("the pool published", lambda: held(kube) == {"gpu-0", "gpu-1"})
    kubelet_sock.unlink()  # the kubelet restarts: a new kubelet.sock
    restarted = make_socket(kubelet_sock)
    try:
        await until("additions held", lambda: dra.publisher.hold_additions)
        assert dra.plugin.registration.registered is None  # not confirmed by this kubelet yet
        one = build_inventory(
            NodeState(NODE.gpus[:1], driver=NODE.driver),
            SharingConfig(name="whole", mig_strategy=MigStrategy.MIXED, rules=(Rule(Selector(all=True)),)),
        )
        assert "" == await dra.publish(one, NODE)  # GPU 1 withdrawn: at once
        assert {"gpu-0"} == held(kube)
        kube.slices.clear()  # the new kubelet wipes the node's slices at its start
        assert "" == await dra.publish(INVENTORY, NODE)
        assert set() == held(kube)  # not put back before it has registered the plugin
        await notify(dra.plugin)
        await until("the pool back", lambda: held(kube) == {"gpu-0", "gpu-1"})
    finally:
        restarted.close()


def test_each_agent_process_has_sockets_of_its_own(tmp_path: Path) -> None:
    one = DraPaths(tmp_path / "plugins", tmp_path / "plugins_registry")
    two = DraPaths(tmp_path / "plugins", tmp_path / "plugins_registry")
    assert one.registration_socket.name == f"gpu.nvidia.com-{one.instance}-reg.sock"
    assert one.dra_socket == tmp_path / "plugins" / "gpu.nvidia.com" / f"dra-{one.instance}.sock"
    assert {one.registration_socket, one.dra_socket}.isdisjoint({two.registration_socket, two.dra_socket})


async def test_sockets_of_a_killed_agent_are_removed_and_a_live_ones_are_kept(
    dirs: DraPaths, tmp_path: Path
) -> None:
    """kill -9 leaves an agent's sockets behind; the kubelet would keep trying them. One that answers
    is another live instance (a rolling update's other pod): removing it would unregister that one."""
    live = make_socket(dirs.registry_dir / "gpu.nvidia.com-live0001-reg.sock")
    dead = make_socket(dirs.registry_dir / "gpu.nvidia.com-dead0001-reg.sock")
    dead_dra = make_socket(dirs.driver_dir / "dra-dead0001.sock")
    legacy = make_socket(dirs.driver_dir / "dra.sock")  # an agent from before sockets had their own names
    for s in (dead, dead_dra, legacy):
        s.close()  # the process is gone; its socket files are not
    foreign = make_socket(dirs.registry_dir / "other.example.com-reg.sock")
    foreign.close()
    plugin = DraFrontEnd(
        kube=cast(Any, FakeKube(NODE_NAME, {})), node_name=NODE_NAME, files=cast(DeviceFiles, None),
        cdi_dir=tmp_path / "cdi", catalog=CATALOG, paths=dirs,
    ).plugin  # fmt: skip
    await plugin.start()
    try:
        left = sorted(
            p.name for d in (dirs.registry_dir, dirs.driver_dir) for p in d.iterdir() if p.is_socket()
        )
        assert (
            sorted(
                [
                    "gpu.nvidia.com-live0001-reg.sock",
                    "other.example.com-reg.sock",
                    dirs.registration_socket.name,
                    dirs.dra_socket.name,
                ]
            )
            == left
        )
    finally:
        await plugin.stop()
        live.close()


async def test_an_agent_that_stops_takes_the_pool_with_it(front: tuple[DraFrontEnd, FakeKube, Path]) -> None:
    """Left behind, the pool lets the scheduler place pods that the kubelet cannot prepare until the
    next agent has registered, and such a pod waits for the kubelet's resync, a minute."""
    dra, kube, _ = front
    await notify(dra.plugin)
    assert "" == await dra.publish(INVENTORY, NODE)
    await until("the pool published", lambda: held(kube) == {"gpu-0", "gpu-1"})
    await dra.leave()
    assert set() == held(kube)
    assert not dra.plugin.serving


async def test_an_agent_that_stops_while_another_instance_serves_leaves_it_the_pool(
    front: tuple[DraFrontEnd, FakeKube, Path], dirs: DraPaths
) -> None:
    dra, kube, _ = front
    await notify(dra.plugin)
    assert "" == await dra.publish(INVENTORY, NODE)
    await until("the pool published", lambda: held(kube) == {"gpu-0", "gpu-1"})
    successor = make_socket(dirs.registry_dir / "gpu.nvidia.com-next0001-reg.sock")  # a rolling update's pod
    try:
        await dra.leave()
    finally:
        successor.close()
    assert {"gpu-0", "gpu-1"} == held(kube)
