"""The node's pool as ResourceSlices: every whole GPU and MIG device the hardware has, as NVIDIA's driver
publishes them (pure: no I/O, no clock).

A claim written for NVIDIA's DRA driver must select the same devices here, so the attributes, their
types and the capacities are NVIDIA's (kubernetes-sigs/dra-driver-nvidia-gpu,
site/content/docs/reference/resourceslice-attributes.md; built in cmd/gpu-kubelet-plugin/deviceinfo.go
`GpuInfo.Attributes`, mig.go `CommonAttributesMig` / `CommonCapacitiesMig`): versions are semver
(`cudaComputeCapability` 8.0.0), memory is bytes, engines are counts. `index` and `minor` (and
`parentIndex` on MIG devices) are the ones v25.3 published (deviceinfo.go at tag v25.3.2), which claims
written then may still select on.

Time-sliced replicas are consumable capacity, not devices (docs/dra.md, "Sharing"): a device the config
replicates N times is published once with `allowMultipleAllocations` and a `shares` capacity of N
(NVIDIA's name, cmd/gpu-kubelet-plugin/consumable_shares.go); each allocation takes one share unless it
asks for more, and every other capacity costs an allocation nothing unless it asks for it (a capacity
without a request policy would be consumed whole: resource.k8s.io/v1 types.go, `DeviceCapacity`).
With failRequestsGreaterThanOne an allocation can take one share at most.

A compute instance smaller than its GPU instance is a MIG device of its own profile, `profile` written
as go-nvlib writes it (`1c.3g.20gb`: `sharing.mig.device_profile`), with its GPU instance's memory and
engines (its compute instances share them) and its own multiprocessors: a claim for a `3g.20gb` never
gets one compute slice of it. NVIDIA's driver publishes no such device (it keeps only profiles whose
compute slices are the GPU instance's, cmd/gpu-kubelet-plugin/nvlib.go `getGpuInfo`, and fails to
enumerate a GPU with another: `getMigDevices`).

Unhealthy devices carry NVIDIA's health taints (cmd/gpu-kubelet-plugin/device_health.go,
`healthEventToTaint`): `gpu.nvidia.com/xid=<xid>` or `gpu.nvidia.com/gpu-lost`, effect NoSchedule, so
new claims avoid them and running pods keep running; recovery drops the taint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from sharing.devices import Device, Health, Inventory
from sharing.dra.names import DRIVER, device_name
from sharing.kube.api import (
    AttributeValue,
    Capacity,
    DeviceTaint,
    RequestPolicy,
    SliceDevice,
    SliceSpec,
    Version,
)
from sharing.mig import Catalog, Product, Profile, default_catalog, device_profile
from sharing.model import DriverInfo, Gpu, NodeState

MAX_DEVICES = 128
"""Devices per ResourceSlice (k8s.io/api resource/v1 types.go, `ResourceSliceMaxDevices`)."""
MAX_DEVICES_WITH_TAINTS = 64
"""... when any device of the slice has taints (`ResourceSliceMaxDevicesWithAdvancedFeatures`)."""
TAINT_XID = f"{DRIVER}/xid"
TAINT_GPU_LOST = f"{DRIVER}/gpu-lost"
NO_SCHEDULE = "NoSchedule"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
"""The standard attribute (k8s.io/dynamic-resource-allocation deviceattribute/attribute.go)."""
NUMA_NODE = "resource.kubernetes.io/numaNode"
"""An int, where the GPU's NUMA node is known (NVIDIA: deviceinfo.go, `addNumaNodeAttribute`)."""
SHARES = "shares"

# NVML's architecture as go-nvlib names it (pkg/nvlib/device/device.go, GetArchitectureAsString), from
# the CUDA compute capability where NVML's own answer was not read (https://developer.nvidia.com/cuda-gpus).
_ARCHITECTURES = {3: "Kepler", 5: "Maxwell", 6: "Pascal", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}


@dataclass(frozen=True, slots=True)
class _Physical:
    """One device of the hardware (a whole GPU or a MIG device) and how the inventory offers it."""

    device: Device
    replicas: int
    unhealthy: bool


def build_slices(
    node_name: str,
    node: NodeState,
    inventory: Inventory,
    catalog: Catalog | None = None,
    *,
    xids: Mapping[str, int] | None = None,
    generation: int = 1,
) -> tuple[SliceSpec, ...]:
    """The pool `node_name` as ResourceSlice specs: the inventory's devices that the hardware has.

    `node` is the node as last seen: a GPU that became unreadable is kept (with its last known state,
    as the rollout keeps it) and listed in `node.unreadable`, so its devices carry `gpu-lost`.
    `xids` names the last XID of an unhealthy GPU or MIG device (by UUID), the value of its taint.
    A pool without devices is no slice at all.
    """
    catalog = catalog if catalog is not None else default_catalog()
    devices = [
        built
        for physical in _physical(inventory)
        if (built := _device(physical, node, inventory, catalog, xids or {})) is not None
    ]
    devices.sort(key=lambda pair: pair[0])
    published = [device for _, device in devices]
    limit = MAX_DEVICES_WITH_TAINTS if any(d.taints for d in published) else MAX_DEVICES
    chunks = [tuple(published[i : i + limit]) for i in range(0, len(published), limit)]
    return tuple(SliceSpec(DRIVER, node_name, node_name, generation, len(chunks), chunk) for chunk in chunks)


def with_generation(specs: Sequence[SliceSpec], generation: int) -> tuple[SliceSpec, ...]:
    """The same slices at another pool generation."""
    return tuple(replace(s, generation=generation) for s in specs)


def _physical(inventory: Inventory) -> list[_Physical]:
    """Each hardware device once, with its replica count and health (replicas collapse into shares)."""
    found: dict[str, _Physical] = {}
    for _, devices in inventory.resources:
        for d in devices:
            seen = found.get(d.uuid)
            replicas = 1 if d.replica is None else d.replica + 1
            unhealthy = d.health is Health.UNHEALTHY
            if seen is None:
                found[d.uuid] = _Physical(replace(d, replica=None), replicas, unhealthy)
            else:
                found[d.uuid] = _Physical(
                    seen.device, max(seen.replicas, replicas), seen.unhealthy or unhealthy
                )
    return list(found.values())


def _device(
    physical: _Physical, node: NodeState, inventory: Inventory, catalog: Catalog, xids: Mapping[str, int]
) -> tuple[tuple[int, int], SliceDevice] | None:
    """(sort key, device) for one hardware device; None when the hardware does not have it."""
    d = physical.device
    gpu = node.gpu(d.gpu_uuid)
    if gpu is None:
        return None
    attributes = _gpu_attributes(gpu, node.driver)
    if d.mig_uuid is None:
        if gpu.mig_enabled:
            return None  # a GPU in MIG mode runs nothing as a whole GPU
        attributes |= {"type": "gpu", "uuid": gpu.uuid, "index": gpu.index}
        if gpu.minor is not None:
            attributes["minor"] = gpu.minor
        capacity = {"memory": _bytes(gpu.memory_mib)}
        key = (gpu.index, -1)
    else:
        found = next(
            ((gi, ci) for gi, ci in gpu.mig_devices if ci.uuid == d.mig_uuid and gpu.mig_enabled), None
        )
        if found is None:
            return None
        gi, ci = found
        mig_index = int(d.index.partition(":")[2] or 0)
        profile = device_profile(gi, ci)
        attributes |= {
            "type": "mig",
            "uuid": d.mig_uuid,
            "parentUUID": gpu.uuid,
            "profile": profile,
            "index": mig_index,
            "parentIndex": gpu.index,
        }
        capacity = _mig_capacity(_profile(gpu, gi.profile, catalog))
        if profile != gi.profile:  # a part of its GPU instance: its memory and engines, its own SMs
            capacity.pop("multiprocessors", None)
            if ci.multiprocessors is not None:
                capacity["multiprocessors"] = _count(ci.multiprocessors)
        key = (gpu.index, mig_index)
    caps = {name: Capacity(value) for name, value in capacity.items()}
    shared = physical.replicas > 1
    if shared:
        top = 1 if inventory.fail_requests_greater_than_one else physical.replicas
        caps = {name: Capacity(c.value, RequestPolicy("0", "0", c.value)) for name, c in caps.items()}
        caps[SHARES] = Capacity(_count(physical.replicas), RequestPolicy("1", "1", _count(top), "1"))
    taints: tuple[DeviceTaint, ...] = ()
    if physical.unhealthy:
        taints = (_taint(d, node, xids),)
    return key, SliceDevice(
        name=device_name(d),
        attributes=tuple(sorted(attributes.items())),
        capacity=tuple(sorted(caps.items())),
        taints=taints,
        allow_multiple_allocations=shared,
    )


def _gpu_attributes(gpu: Gpu, driver: DriverInfo | None) -> dict[str, AttributeValue]:
    """What a whole GPU and its MIG devices share (NVIDIA's MIG devices inherit these from the parent)."""
    attributes: dict[str, AttributeValue] = {"productName": gpu.product}
    if gpu.brand:
        attributes["brand"] = gpu.brand
    architecture = gpu.architecture or _architecture(gpu.compute_capability)
    if architecture:
        attributes["architecture"] = architecture
    if gpu.compute_capability is not None:
        attributes["cudaComputeCapability"] = Version("{}.{}.0".format(*gpu.compute_capability))
    if driver is not None:
        if (version := semver(driver.version)) is not None:
            attributes["driverVersion"] = version
        if driver.cuda_version:
            # NVIDIA: "%v.%v" of v/1000 and (v%1000)/10 (cmd/gpu-kubelet-plugin/nvlib.go, getGpuInfo).
            cuda = driver.cuda_version
            attributes["cudaDriverVersion"] = Version(f"{cuda // 1000}.{cuda % 1000 // 10}.0")
    if gpu.pci_bus_id:
        attributes[PCI_BUS_ID] = gpu.pci_bus_id
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attributes[NUMA_NODE] = gpu.numa_node
    return attributes


def _architecture(capability: tuple[int, int] | None) -> str | None:
    if capability is None:
        return None
    major, minor = capability
    if major == 7:
        return "Volta" if minor < 5 else "Turing"
    if major == 8:
        return "Ampere" if minor < 9 else "Ada Lovelace"
    return _ARCHITECTURES.get(major)


def semver(text: str) -> Version | None:
    """`550.107.02` as semver `550.107.2` (what Masterminds semver's String() makes of it, as NVIDIA's
    driver publishes it); None when it is not dotted numbers."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return Version(".".join(str(n) for n in numbers))


def _profile(gpu: Gpu, name: str, catalog: Catalog) -> Profile | None:
    """The profile as the driver reports it, else as the catalog knows the product."""
    product: Product | None = gpu.profiles
    if product is None or product.profile(name) is None:
        known = catalog.for_gpu(gpu.product, gpu.pci_device_id)
        product = known if isinstance(known, Product) else None
    return product.profile(name) if product is not None else None


def _mig_capacity(profile: Profile | None) -> dict[str, str]:
    """memory, multiprocessors and the engines of a MIG device, each where it is known."""
    if profile is None:
        return {}
    capacity = {"memory": _bytes(profile.memory_mib)}
    if profile.multiprocessors is not None:
        capacity["multiprocessors"] = _count(profile.multiprocessors)
    if profile.engines is not None:
        e = profile.engines
        capacity |= {
            "copyEngines": _count(e.copy),
            "decoders": _count(e.decoder),
            "encoders": _count(e.encoder),
            "jpegEngines": _count(e.jpeg),
            "ofaEngines": _count(e.ofa),
        }
    return capacity


def _taint(device: Device, node: NodeState, xids: Mapping[str, int]) -> DeviceTaint:
    lost = any(u.uuid == device.gpu_uuid for u in node.unreadable)
    if lost:
        return DeviceTaint(TAINT_GPU_LOST, "", NO_SCHEDULE)
    xid = xids.get(device.uuid, xids.get(device.gpu_uuid))
    return DeviceTaint(TAINT_XID, "" if xid is None else str(xid), NO_SCHEDULE)


_BINARY = ("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)
_DECIMAL = ("E", 18), ("P", 15), ("T", 12), ("G", 9), ("M", 6), ("k", 3)


def _bytes(mib: int) -> str:
    """MiB as a quantity in the API server's canonical form (`40Gi`, `4864Mi`), so what is written
    reads back the same (k8s.io/apimachinery pkg/api/resource quantity.go, CanonicalizeBytes)."""
    value = mib << 20
    if value == 0:
        return "0"
    for suffix, shift in _BINARY:
        if value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def _count(value: int) -> str:
    """A count in canonical decimal form (1000 reads back as `1k`)."""
    if value == 0:
        return "0"
    for suffix, exponent in _DECIMAL:
        if value % 10**exponent == 0:
            return f"{value // 10**exponent}{suffix}"
    return str(value)
