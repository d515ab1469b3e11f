"""The node's pool as ResourceSlices as a scheduler reads them: NVIDIA's attributes, shares, taints."""

from __future__ import annotations

import dataclasses
import re

import pytest

from sharing.config.spec import MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.devices import HealthState, build_inventory, with_health
from sharing.dra.names import DRIVER
from sharing.dra.slices import MAX_DEVICES, MAX_DEVICES_WITH_TAINTS, build_slices, semver, with_generation
from sharing.gpu.nvmlread import bus_id
from sharing.kube.api import Capacity, DeviceTaint, RequestPolicy, SliceDevice, Version
from sharing.mig import Product, default_catalog
from sharing.model import (
    ComputeInstance,
    DriverInfo,
    Gpu,
    GpuInstance,
    GpuUuid,
    HealthEvent,
    MigUuid,
    NodeState,
    UnreadableGpu,
)

CATALOG = default_catalog()
DRIVER_INFO = DriverInfo("550.107.02", 12040)
MIG_PRODUCTS = [p for p in CATALOG.products if p.profiles]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def whole(index: int, product: str = "NVIDIA A100-SXM4-40GB", memory_mib: int = 40960) -> Gpu:
    return Gpu(
        index,
        GpuUuid(f"GPU-{index}"),
        product,
        memory_mib,
        mig_capable=True,
        mig_enabled=False,
        mig_pending=False,
        compute_capability=(8, 0),
        minor=index,
        pci_bus_id=f"0000:{index + 0x10:02x}:00.0",
        brand="Nvidia",
    )


def mig(index: int, product: Product, *profiles: str) -> Gpu:
    """GPU `index` of `product` in MIG mode with one MIG device per profile, in order."""
    instances = tuple(
        GpuInstance(
            n,
            p,
            start=n,
            size=1,
            compute_instances=(ComputeInstance(0, MigUuid(f"MIG-{index}-{n}"), mig_index=n),),
        )
        for n, p in enumerate(profiles)
    )
    return Gpu(
        index,
        GpuUuid(f"GPU-{index}"),
        product.nvml_names[0] if product.nvml_names else f"NVIDIA {product.name}",
        product.memory_mib,
        mig_capable=True,
        mig_enabled=True,
        mig_pending=True,
        instances=instances,
        pci_device_id=product.pci_device_ids[0] << 16 | 0x10DE,
        compute_capability=product.compute_capability,
        minor=index,
    )


def config(replicas: int = 1, *, fail_over_one: bool = False) -> SharingConfig:
    rule = Rule(Selector(all=True), replicas=Replicas(default=replicas))
    return SharingConfig(
        name="t", mig_strategy=MigStrategy.MIXED, fail_requests_greater_than_one=fail_over_one, rules=(rule,)
    )


def pool(node: NodeState, cfg: SharingConfig | None = None, health: HealthState | None = None, **kw: object):  # type: ignore[no-untyped-def]
    inventory = build_inventory(node, cfg, health, CATALOG)
    return build_slices("node-a", node, inventory, CATALOG, **kw)  # type: ignore[arg-type]


def devices(node: NodeState, cfg: SharingConfig | None = None, **kw: object) -> dict[str, SliceDevice]:
    return {d.name: d for s in pool(node, cfg, **kw) for d in s.devices}


def test_a_whole_a100_is_published_with_nvidias_attributes_and_types() -> None:
    node = NodeState((whole(0),), driver=DRIVER_INFO)
    expected = SliceDevice(
        name="gpu-0",
        attributes=(
            ("architecture", "Ampere"),
            ("brand", "Nvidia"),
            ("cudaComputeCapability", Version("8.0.0")),
            ("cudaDriverVersion", Version("12.4.0")),
            ("driverVersion", Version("550.107.2")),
            ("index", 0),
            ("minor", 0),
            ("productName", "NVIDIA A100-SXM4-40GB"),
            ("resource.kubernetes.io/pciBusID", "0000:10:00.0"),
            ("type", "gpu"),
            ("uuid", "GPU-0"),
        ),
        capacity=(("memory", Capacity("40Gi")),),
    )
    (only,) = pool(node)
    assert (only.driver, only.node, only.pool, only.generation, only.slice_count) == (
        DRIVER,
        "node-a",
        "node-a",
        1,
        1,
    )
    assert only.devices == (expected,)


def test_an_a100_in_mig_mode_publishes_its_mig_devices_and_no_whole_gpu() -> None:
    a100 = CATALOG.product("A100-SXM4-40GB")
    node = NodeState((mig(0, a100, "3g.20gb", "2g.10gb", "1g.5gb"),), driver=DRIVER_INFO)
    found = devices(node)
    assert sorted(found) == ["gpu-0-mig-0", "gpu-0-mig-1", "gpu-0-mig-2"]
    three = found["gpu-0-mig-0"]
    assert dict(three.attributes) == {
        "architecture": "Ampere",
        "cudaComputeCapability": Version("8.0.0"),
        "cudaDriverVersion": Version("12.4.0"),
        "driverVersion": Version("550.107.2"),
        "index": 0,
        "parentIndex": 0,
        "parentUUID": "GPU-0",
        "productName": "NVIDIA A100-SXM4-40GB",
        "profile": "3g.20gb",
        "type": "mig",
        "uuid": "MIG-0-0",
    }
    assert dict(three.capacity) == {
        "copyEngines": Capacity("3"),
        "decoders": Capacity("2"),
        "encoders": Capacity("0"),
        "jpegEngines": Capacity("0"),
        "memory": Capacity("19968Mi"),
        "multiprocessors": Capacity("42"),
        "ofaEngines": Capacity("0"),
    }


@pytest.mark.parametrize("product", MIG_PRODUCTS, ids=lambda p: p.name)
def test_every_catalog_profile_gets_its_memory_multiprocessors_and_engines(product: Product) -> None:
    node = NodeState(
        tuple(mig(i, product, p.name) for i, p in enumerate(product.profiles)), driver=DRIVER_INFO
    )
    found = devices(node)
    for i, profile in enumerate(product.profiles):
        device = found[f"gpu-{i}-mig-0"]
        capacity = {k: c.value for k, c in device.capacity}
        expected_memory = profile.memory_mib * 2**20
        assert _quantity(capacity.pop("memory")) == expected_memory
        expected = {}
        if profile.multiprocessors is not None:
            expected["multiprocessors"] = str(profile.multiprocessors)
        if profile.engines is not None:
            e = profile.engines
            expected |= {"copyEngines": str(e.copy), "decoders": str(e.decoder), "encoders": str(e.encoder),
                         "jpegEngines": str(e.jpeg), "ofaEngines": str(e.ofa)}  # fmt: skip
        assert capacity == expected
        assert dict(device.attributes)["profile"] == profile.name


def _quantity(text: str) -> int:
    units = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}
    for suffix, shift in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) << shift
    return int(text)


def test_devices_the_hardware_lacks_are_never_published() -> None:
    a100 = CATALOG.product("A100-SXM4-40GB")
    observed = NodeState((mig(0, a100, "1g.5gb", "1g.5gb"), whole(1)), driver=DRIVER_INFO)
    inventory = build_inventory(observed, None, None, CATALOG)
    # The hardware changed after the inventory was built: one MIG device and GPU 1 are gone.
    now = NodeState((mig(0, a100, "1g.5gb"),), driver=DRIVER_INFO)
    names = [d.name for s in build_slices("node-a", now, inventory, CATALOG) for d in s.devices]
    assert names == ["gpu-0-mig-0"]


def test_replicas_become_shares_of_one_device() -> None:
    node = NodeState((whole(0),), driver=DRIVER_INFO)
    device = devices(node, config(4))["gpu-0"]
    assert device.allow_multiple_allocations
    assert dict(device.capacity) == {
        "memory": Capacity("40Gi", RequestPolicy("0", "0", "40Gi")),
        "shares": Capacity("4", RequestPolicy("1", "1", "4", "1")),
    }


def test_fail_requests_greater_than_one_lets_an_allocation_take_one_share_only() -> None:
    node = NodeState((whole(0),), driver=DRIVER_INFO)
    device = devices(node, config(4, fail_over_one=True))["gpu-0"]
    assert dict(device.capacity)["shares"] == Capacity("4", RequestPolicy("1", "1", "1", "1"))


def test_an_unreplicated_device_is_exclusive() -> None:
    device = devices(NodeState((whole(0),)), config(1))["gpu-0"]
    assert not device.allow_multiple_allocations
    assert "shares" not in dict(device.capacity)


@pytest.mark.parametrize(
    ("count", "unhealthy", "sizes"),
    [
        (MAX_DEVICES, False, [128]),
        (MAX_DEVICES + 1, False, [128, 1]),
        (MAX_DEVICES_WITH_TAINTS, True, [64]),
        (MAX_DEVICES + 1, True, [64, 64, 1]),
    ],
    ids=["128-one-slice", "129-two-slices", "64-tainted-one-slice", "129-tainted-three-slices"],
)
def test_chunks_respect_the_device_limits(count: int, unhealthy: bool, sizes: list[int]) -> None:
    node = NodeState(tuple(whole(i) for i in range(count)), driver=DRIVER_INFO)
    health = HealthState().apply(HealthEvent(GpuUuid("GPU-3"), False, xid=48)) if unhealthy else None
    slices = pool(node, None, health, generation=7)
    assert [len(s.devices) for s in slices] == sizes
    assert {(s.generation, s.slice_count) for s in slices} == {(7, len(sizes))}
    names = [d.name for s in slices for d in s.devices]
    assert names == [f"gpu-{i}" for i in range(count)]  # numeric order, not gpu-10 before gpu-2
    assert all(DNS_LABEL.match(n) for n in names)


def test_an_xid_taints_the_gpu_and_its_mig_devices_and_recovery_clears_it() -> None:
    a100 = CATALOG.product("A100-SXM4-40GB")
    node = NodeState((mig(0, a100, "1g.5gb", "1g.5gb"), whole(1)), driver=DRIVER_INFO)
    inventory = build_inventory(node, None, None, CATALOG)
    sick = HealthState().apply(HealthEvent(GpuUuid("GPU-0"), False, xid=79))
    tainted = build_slices("node-a", node, with_health(inventory, sick), CATALOG, xids={"GPU-0": 79})
    taints = {d.name: d.taints for s in tainted for d in s.devices}
    xid = (DeviceTaint("gpu.nvidia.com/xid", "79", "NoSchedule"),)
    assert taints == {"gpu-0-mig-0": xid, "gpu-0-mig-1": xid, "gpu-1": ()}
    well = sick.apply(HealthEvent(GpuUuid("GPU-0"), True))
    healed = build_slices("node-a", node, with_health(inventory, well), CATALOG)
    assert all(d.taints == () for s in healed for d in s.devices)


def test_a_lost_gpu_is_tainted_gpu_lost() -> None:
    gpu = whole(0)
    node = NodeState((gpu,), unreadable=(UnreadableGpu(0, gpu.uuid, "GPU is lost"),), driver=DRIVER_INFO)
    inventory = with_health(build_inventory(node, None, None, CATALOG), HealthState(frozenset({gpu.uuid})))
    (only,) = build_slices("node-a", node, inventory, CATALOG)
    assert only.devices[0].taints == (DeviceTaint("gpu.nvidia.com/gpu-lost", "", "NoSchedule"),)


def test_generation_is_stamped_on_every_slice() -> None:
    node = NodeState(tuple(whole(i) for i in range(130)), driver=DRIVER_INFO)
    assert {s.generation for s in with_generation(pool(node), 12)} == {12}


def test_no_devices_no_slices() -> None:
    assert pool(NodeState(())) == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("550.107.02", "550.107.2"),
        ("580.126.20", "580.126.20"),
        ("535", "535.0.0"),
        ("r550", None),
        ("", None),
    ],
)
def test_driver_versions_as_semver(text: str, expected: str | None) -> None:
    assert semver(text) == (Version(expected) if expected else None)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(b"00000000:65:00.0", "0000:65:00.0"), (b"0000:3B:00.0", "0000:3b:00.0"), (b"", None)],
)
def test_pci_bus_ids_as_go_nvlib_writes_them(raw: bytes, expected: str | None) -> None:
    assert bus_id(raw) == expected


def test_a_time_sliced_mig_device_shares_and_its_engines_cost_nothing_by_default() -> None:
    a100 = CATALOG.product("A100-SXM4-40GB")
    node = NodeState((mig(0, a100, "1g.5gb"),), driver=DRIVER_INFO)
    device = devices(node, config(2))["gpu-0-mig-0"]
    assert device.allow_multiple_allocations
    assert dict(device.capacity) == {
        "copyEngines": Capacity("1", RequestPolicy("0", "0", "1")),
        "decoders": Capacity("0", RequestPolicy("0", "0", "0")),
        "encoders": Capacity("0", RequestPolicy("0", "0", "0")),
        "jpegEngines": Capacity("0", RequestPolicy("0", "0", "0")),
        "memory": Capacity("4864Mi", RequestPolicy("0", "0", "4864Mi")),
        "multiprocessors": Capacity("14", RequestPolicy("0", "0", "14")),
        "ofaEngines": Capacity("0", RequestPolicy("0", "0", "0")),
        "shares": Capacity("2", RequestPolicy("1", "1", "2", "1")),
    }


@pytest.mark.parametrize("product", MIG_PRODUCTS, ids=lambda p: p.name)
def test_every_device_fits_the_api_servers_limits(product: Product) -> None:
    """At most 32 attributes and capacities together, names of at most 32 characters after the
    domain, strings of at most 64 (k8s.io/api resource/v1 types.go), even shared with every capacity."""
    node = NodeState(
        tuple(mig(i, product, p.name) for i, p in enumerate(product.profiles)), driver=DRIVER_INFO
    )
    for device in devices(node, config(8)).values():
        assert DNS_LABEL.match(device.name)
        assert len(device.attributes) + len(device.capacity) <= 32
        names = [n for n, _ in (*device.attributes, *device.capacity)]
        assert all(len(n.rpartition("/")[2]) <= 32 for n in names)
        assert all(len(v) <= 64 for _, v in device.attributes if isinstance(v, str))


def test_the_numa_node_is_published_where_known() -> None:
    node = NodeState((dataclasses.replace(whole(0), numa_node=1), whole(1)), driver=DRIVER_INFO)
    found = devices(node)
    assert dict(found["gpu-0"].attributes)["resource.kubernetes.io/numaNode"] == 1
    assert "resource.kubernetes.io/numaNode" not in dict(found["gpu-1"].attributes)
