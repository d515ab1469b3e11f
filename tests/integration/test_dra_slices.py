"""The node's ResourceSlices on a real kube-apiserver, published with the agent's own token.

The API server's validation is the test of every slice spec (DNS-label names, attribute types, the
64/128 device limits, request policies, taints); the chart's RBAC and admission policy (rendered with
dra.enabled) are applied as a user installs them, and the publisher runs as the agent's
ServiceAccount with a token bound to a pod on its node, so it gets only what the agent gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lab
import pytest
import structlog.testing

from sharing.config.spec import MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.devices import HealthState, build_inventory
from sharing.devices.inventory import mig_resource
from sharing.dra.names import DRIVER
from sharing.dra.slices import build_slices
from sharing.errors import KubeError
from sharing.kube import ApiClient
from sharing.kube.api import SliceDevice, SliceSpec
from sharing.kube.client import resource_slice
from sharing.kube.features import CONSUMABLE, PARTITIONABLE, TAINTS, ClusterFeatures, probe
from sharing.kube.resourceslices import SlicePublisher
from sharing.mig import default_catalog
from sharing.model import (
    ComputeInstance,
    DriverInfo,
    Gpu,
    GpuInstance,
    GpuUuid,
    HealthEvent,
    MigUuid,
    NodeState,
)
from tests.apiserver import agent_token, refusal
from tests.polling import poll

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpu-sharing"
NAME = "gpu-sharing-dra"
NAMESPACE = "gpu-sharing-dra"
TEMPLATES = ("rbac.yaml", "admission-policy.yaml", "deviceclasses.yaml")
CATALOG = default_catalog()
DRIVER_INFO = DriverInfo("550.107.02", 12040)


@pytest.fixture(scope="module")
def chart(control_plane: lab.ControlPlane) -> lab.ControlPlane:
    """The chart's RBAC, admission policies and DeviceClasses with dra.enabled, under their own name."""
    rendered = subprocess.run(
        [str(lab.binaries().helm), "template", "x", str(CHART), "--namespace", NAMESPACE,
         "--set", "dra.enabled=true", "--set", f"fullnameOverride={NAME}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    docs = [d for d in rendered.split("\n---\n") if d.strip("-\n").split("\n", 1)[0].endswith(TEMPLATES)]
    control_plane.kubectl("create", "namespace", NAMESPACE)
    control_plane.kubectl("apply", "-f", "-", input="\n---\n".join(docs), check=True)
    return control_plane


@dataclass
class Node:
    name: str
    uid: str
    api: ApiClient


@pytest.fixture
def node(chart: lab.ControlPlane) -> Iterator[Node]:
    """A Node (no kubelet: only the object) and the agent's client, its token bound to a pod there."""
    name = f"dra-{uuid.uuid4().hex[:6]}"
    manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    chart.kubectl("create", "-f", "-", input=json.dumps(manifest), check=True)
    uid = json.loads(chart.kubectl("get", "node", name, "-o", "json", check=True).stdout)["metadata"]["uid"]
    token = agent_token(chart, name, service_account=NAME, namespace=NAMESPACE)
    api = ApiClient(str(chart.token_kubeconfig(token, f"agent-{name}")))
    yield Node(name, uid, api)
    api.close()
    chart.kubectl("delete", "resourceslices", f"--field-selector=spec.nodeName={name}")
    chart.kubectl("delete", "node", name, "--wait=false")


def a100(index: int, *profiles: str) -> Gpu:
    """An A100-SXM4-40GB, in MIG mode with one device per profile when given any."""
    instances = tuple(
        GpuInstance(n, p, n, 1, (ComputeInstance(0, MigUuid(f"MIG-{index}-{n}"), mig_index=n),))
        for n, p in enumerate(profiles)
    )
    return Gpu(
        index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", 40960, True, bool(profiles), bool(profiles),
        instances, compute_capability=(8, 0), minor=index, pci_bus_id=f"0000:{index % 256:02x}:00.0",
    )  # fmt: skip


def wanted_pool(name: str, gpus: int, *, sick: int | None = None) -> tuple[SliceSpec, ...]:
    """GPU 0 in MIG mode, its MIG devices and GPU 1 time-sliced 4 ways, the rest whole; GPU `sick` with
    an XID."""
    node = NodeState(
        (a100(0, "3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"), *(a100(i) for i in range(1, gpus))),
        driver=DRIVER_INFO,
    )
    shared = Rule(Selector(indices=(0, 1)), replicas=Replicas(default=4))
    config = SharingConfig(name="t", mig_strategy=MigStrategy.MIXED, rules=(shared,))
    health = None if sick is None else HealthState().apply(HealthEvent(GpuUuid(f"GPU-{sick}"), False, xid=48))
    inventory = build_inventory(node, config, health, CATALOG)
    xids = {} if sick is None else {f"GPU-{sick}": 48}
    return build_slices(name, node, inventory, CATALOG, xids=xids)


def stored(cp: lab.ControlPlane, node: str) -> list[dict[str, Any]]:
    listed = cp.kubectl(
        "get", "resourceslices", f"--field-selector=spec.nodeName={node}", "-o", "json", check=True
    )
    return list(json.loads(listed.stdout)["items"])


def devices_of(specs: tuple[SliceSpec, ...]) -> dict[str, SliceDevice]:
    return {d.name: d for s in specs for d in s.devices}


def pool_is(wanted: tuple[SliceSpec, ...], *, above: int = 0) -> Any:
    """True when the stored pool is complete at one generation above `above` with exactly `wanted`."""

    def ok(items: list[dict[str, Any]]) -> bool:
        slices = [resource_slice(i).spec for i in items]
        generations = {s.generation for s in slices}
        return (
            len(slices) == len(wanted)
            and len(generations) == 1
            and min(generations) > above
            and all(s.slice_count == len(wanted) for s in slices)
            and devices_of(tuple(slices)) == devices_of(wanted)
        )

    return ok


@contextlib.asynccontextmanager
async def publishing(node: Node) -> AsyncIterator[SlicePublisher]:
    publisher = SlicePublisher(node.api, node.name, DRIVER, resync_s=30)
    task = asyncio.create_task(publisher.run())
    try:
        yield publisher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_pool_is_published_exactly_and_follows_a_change(
    chart: lab.ControlPlane, node: Node
) -> None:
    # 72 devices, one of them tainted: at most 64 a slice, so two slices.
    first = wanted_pool(node.name, 69, sick=5)
    assert [len(s.devices) for s in first] == [64, 8]
    async with publishing(node) as publisher:
        publisher.want(first)
        items = await asyncio.to_thread(
            poll, "the first pool", lambda: stored(chart, node.name), pool_is(first)
        )
        generation = resource_slice(items[0]).spec.generation
        assert publisher.problems == ()  # every field written was kept
        for item in items:
            meta = item["metadata"]
            assert meta["name"].startswith(f"{DRIVER}-{node.name}-")
            assert meta["ownerReferences"] == [
                {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid, "controller": True}
            ]
            assert (item["spec"]["driver"], item["spec"]["nodeName"]) == (DRIVER, node.name)
        shared = devices_of(tuple(resource_slice(i).spec for i in items))["gpu-1"]
        assert shared.allow_multiple_allocations

        second = wanted_pool(node.name, 10)
        assert len(second) == 1
        publisher.want(second)
        await asyncio.to_thread(
            poll, "the changed pool", lambda: stored(chart, node.name), pool_is(second, above=generation)
        )


async def test_slices_wiped_behind_its_back_are_put_back(chart: lab.ControlPlane, node: Node) -> None:
    wanted = wanted_pool(node.name, 3)
    async with publishing(node) as publisher:
        publisher.want(wanted)
        items = await asyncio.to_thread(poll, "the pool", lambda: stored(chart, node.name), pool_is(wanted))
        generation = resource_slice(items[0]).spec.generation
        # What the kubelet does when it starts (and ~30 s after a driver unregisters).
        chart.kubectl("delete", "resourceslices", f"--field-selector=spec.nodeName={node.name}", check=True)
        await asyncio.to_thread(
            poll, "the pool again", lambda: stored(chart, node.name), pool_is(wanted, above=generation)
        )


def test_the_admission_policy_keeps_the_agent_to_its_own_nodes_slices(
    chart: lab.ControlPlane, node: Node
) -> None:
    other = f"other-{uuid.uuid4().hex[:6]}"
    chart.kubectl(
        "create",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": other}}),
        check=True,
    )
    owner = node.api.get_node(node.name)
    foreign = wanted_pool(other, 1)[0]

    def attempt() -> str:
        """Try to publish a slice for the other node; '' when the API server took it (then undo it)."""
        try:
            made = node.api.create_resource_slice(foreign, owner)
        except KubeError as err:
            return str(err)
        chart.kubectl("delete", "resourceslice", made.name)
        return ""

    refused = refusal(attempt)
    expected = f"the gpu-sharing agent on {node.name} may only change ResourceSlices of its own node"
    assert f"{expected}, not those of {other}" in refused
    assert stored(chart, other) == []
    chart.kubectl("delete", "node", other, "--wait=false")


def test_the_agent_asks_what_the_api_server_keeps_with_its_own_token_and_stores_nothing(
    chart: lab.ControlPlane, node: Node
) -> None:
    assert probe(node.api, DRIVER, node.name) == ClusterFeatures(frozenset(), known=True)
    assert stored(chart, node.name) == []


@pytest.fixture(scope="module")
def gates_off(cluster_binaries: lab.Binaries) -> Iterator[lab.ControlPlane]:
    """An API server without consumable capacity, device taints and partitionable devices (beta, on
    by default in 1.36; off by default in 1.34)."""
    # DRADeviceTaintRules (beta in 1.37) depends on DRADeviceTaints: off with it, or the server exits.
    gates = "--feature-gates=DRAConsumableCapacity=false,DRADeviceTaints=false,DRADeviceTaintRules=false,"
    gates += "DRAPartitionableDevices=false"
    with lab.ControlPlane(bins=cluster_binaries, extra_apiserver_args=[gates]) as cp:
        yield cp


def test_fields_the_api_server_drops_are_said_once_and_not_rewritten(gates_off: lab.ControlPlane) -> None:
    name = "gateless"
    node = json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    gates_off.kubectl("create", "-f", "-", input=node, check=True)
    api = ApiClient(str(gates_off.kubeconfig))
    try:
        publisher = SlicePublisher(api, name, DRIVER)
        publisher.want(wanted_pool(name, 3, sick=2))
        with structlog.testing.capture_logs() as logs:
            first = publisher.sync()
        assert first is not None
        (slice_,) = stored(gates_off, name)
        shared = ["gpu-0-mig-0", "gpu-0-mig-1", "gpu-0-mig-2", "gpu-0-mig-3", "gpu-1"]
        expected = [
            f"{what} of {d}" for d in shared for what in ("allowMultipleAllocations", "requestPolicy")
        ]
        expected.append("taints of gpu-2")
        assert publisher.problems == tuple(f"{slice_['metadata']['name']}: {e}" for e in expected)
        said = [e for e in logs if e["event"] == "resourceslice_fields_dropped"]
        assert [(e["log_level"], e["feature_gates"]) for e in said] == [
            ("warning", "DRAConsumableCapacity,DRADeviceTaints")
        ]
        # What the API server keeps of the pool counts as published: no rewrite on the next sync.
        assert publisher.sync() is None
    finally:
        api.close()


def test_the_gates_an_api_server_has_off_are_told_by_name(gates_off: lab.ControlPlane) -> None:
    name = "probed"
    node = json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    gates_off.kubectl("create", "-f", "-", input=node, check=True)
    api = ApiClient(str(gates_off.kubeconfig))
    try:
        expected = ClusterFeatures(frozenset({CONSUMABLE, PARTITIONABLE, TAINTS}), known=True)
        assert probe(api, DRIVER, name) == expected
        assert stored(gates_off, name) == []
    finally:
        api.close()
        gates_off.kubectl("delete", "node", name, "--wait=false")


def test_the_chart_ships_a_device_class_per_catalog_mig_profile(chart: lab.ControlPlane) -> None:
    listed = json.loads(chart.kubectl("get", "deviceclasses", "-o", "json", check=True).stdout)["items"]
    ours = {c["metadata"]["name"]: c["spec"].get("extendedResourceName") for c in listed}
    profiles = {p.name for product in CATALOG.products for p in product.profiles}
    expected = {"gpu.nvidia.com": "nvidia.com/gpu", "mig.nvidia.com": None} | {
        f"{mig_resource(p).removeprefix('nvidia.com/')}.nvidia.com": mig_resource(p) for p in profiles
    }
    assert ours == expected


def test_a_token_without_a_node_claim_may_change_no_slice(chart: lab.ControlPlane, node: Node) -> None:
    made = chart.kubectl("create", "token", NAME, "-n", NAMESPACE)  # not bound to a pod: no node claim
    assert made.returncode == 0, made.stderr
    loose = ApiClient(str(chart.token_kubeconfig(made.stdout.strip(), f"loose-{node.name}")))
    try:
        mine = wanted_pool(node.name, 1)[0]
        owner = loose.get_node(node.name)

        def attempt() -> str:
            try:
                made = loose.create_resource_slice(mine, owner)
            except KubeError as err:
                return str(err)
            chart.kubectl("delete", "resourceslice", made.name)
            return ""

        refused = refusal(attempt)
        assert (
            "the gpu-sharing agent's token carries no node claim; it may change no ResourceSlice" in refused
        )
    finally:
        loose.close()
