"""Whose are the GPU processes: each held slice gets its own pod's processes, never the device's copied."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.model import ClaimHold, GpuUuid, Holding, MigUuid
from sharing.readings import DeviceReading, GpuReading, NodeReadings, ProcessReading
from sharing.usage.attribute import HeldSlice, Pod, SliceUse, Unattributed, attribute, held_slices
from sharing.usage.cgroup import PodProcess

GIB = 1 << 30
GPU = "GPU-aaaa"
MIG = "MIG-bbbb"
MIG2 = "MIG-cccc"
SHARED = "nvidia.com/gpu.shared"
PODS = {
    "uid-a": Pod("ml", "a", {"ctr-a": "main"}),
    "uid-b": Pod("ml", "b", {"ctr-b": "main", "ctr-b2": "sidecar"}),
    "uid-c": Pod("web", "c", {"ctr-c": "main"}),
}


def gpu(*processes: ProcessReading, used: int = 0) -> GpuReading:
    """A GPU without MIG (its one device is itself)."""
    device = DeviceReading(GPU, used, 24 * GIB, tuple(processes))
    return GpuReading(0, GpuUuid(GPU), 70.0, 40.0, used, 24 * GIB, 0.5, False, False, (device,))


def mig_gpu(*devices: DeviceReading) -> GpuReading:
    return GpuReading(1, GpuUuid("GPU-mig"), 90.0, 45.0, 0, 80 * GIB, None, True, True, devices)


def held(
    device: str, pod: str, container: str = "main", *, uuid: str = GPU, resource: str = SHARED
) -> HeldSlice:
    namespace, name = pod.split("/")
    gpu_uuid = GPU if uuid == GPU else "GPU-mig"
    return HeldSlice(resource, device, uuid, gpu_uuid, namespace, name, container)


OWNERS = {
    10: PodProcess("uid-a", "ctr-a"),
    20: PodProcess("uid-b", "ctr-b"),
    21: PodProcess("uid-b", "ctr-b2"),
    30: PodProcess("uid-c", "ctr-c"),
    40: PodProcess("uid-unknown", "ctr-x"),
}


@dataclass(frozen=True)
class Case:
    readings: NodeReadings
    held: tuple[HeldSlice, ...]
    uses: list[tuple[str, str, int, float | None, tuple[int, ...]]]
    """(device, pod, memory used, SM, PIDs) per held slice, in slice order."""
    unattributed: list[Unattributed]


CASES = {
    "two-pods-time-sharing-a-gpu-get-their-own": Case(
        NodeReadings(
            0, (gpu(ProcessReading(10, 3 * GIB, 0.6), ProcessReading(20, 1 * GIB, 0.1), used=4 * GIB),)
        ),
        (held(f"{GPU}::0", "ml/a"), held(f"{GPU}::1", "ml/b")),
        [(f"{GPU}::0", "a", 3 * GIB, 0.6, (10,)), (f"{GPU}::1", "b", 1 * GIB, 0.1, (20,))],
        [],
    ),
    "a-pod-with-no-process-uses-nothing": Case(
        NodeReadings(0, (gpu(ProcessReading(10, 3 * GIB, 0.6), used=3 * GIB),)),
        (held(f"{GPU}::0", "ml/a"), held(f"{GPU}::1", "ml/b")),
        [(f"{GPU}::0", "a", 3 * GIB, 0.6, (10,)), (f"{GPU}::1", "b", 0, 0.0, ())],
        [],
    ),
    "a-process-of-no-pod-is-unattributed": Case(
        NodeReadings(0, (gpu(ProcessReading(10, GIB, 0.2), ProcessReading(99, 2 * GIB, 0.3)),)),
        (held(f"{GPU}::0", "ml/a"),),
        [(f"{GPU}::0", "a", GIB, 0.2, (10,))],
        [Unattributed(GPU, GPU, 2 * GIB, (99,))],
    ),
    "processes-of-pods-holding-no-slice-there-or-unknown-are-unattributed": Case(
        NodeReadings(0, (gpu(ProcessReading(30, GIB, 0.2), ProcessReading(40, GIB, 0.1)),)),
        (held(f"{GPU}::0", "ml/a"),),
        [(f"{GPU}::0", "a", 0, 0.0, ())],
        [Unattributed(GPU, GPU, 2 * GIB, (30, 40))],
    ),
    "each-container-counts-on-the-replica-it-holds": Case(
        NodeReadings(0, (gpu(ProcessReading(20, GIB, 0.7), ProcessReading(21, GIB, 0.6)),)),
        (held(f"{GPU}::0", "ml/b", "main"), held(f"{GPU}::1", "ml/b", "sidecar")),
        # Each container's processes count on the replica that container holds.
        [(f"{GPU}::0", "b", GIB, 0.7, (20,)), (f"{GPU}::1", "b", GIB, 0.6, (21,))],
        [],
    ),
    "a-pod-holding-two-replicas-is-counted-once-its-shares-capped": Case(
        NodeReadings(0, (gpu(ProcessReading(10, GIB, 0.7), ProcessReading(1010, GIB, 0.6)),)),
        (held(f"{GPU}::3", "ml/a"), held(f"{GPU}::1", "ml/a")),
        [(f"{GPU}::1", "a", 2 * GIB, 1.0, (10, 1010)), (f"{GPU}::3", "a", 0, 0.0, ())],
        [],
    ),
    "a-mig-device-held-whole-gets-its-gpu-instances-activity": Case(
        NodeReadings(
            0, (mig_gpu(DeviceReading(MIG, 2 * GIB, 20 * GIB, (ProcessReading(10, 2 * GIB),), 1, 0.4, 0.5)),)
        ),
        (held(MIG, "ml/a", uuid=MIG, resource="nvidia.com/mig-3g.40gb"),),
        [(MIG, "a", 2 * GIB, 0.4, (10,))],
        [],
    ),
    "replicas-of-a-mig-device-get-memory-but-no-sm": Case(
        NodeReadings(
            0,
            (
                mig_gpu(
                    DeviceReading(
                        MIG, 3 * GIB, 20 * GIB, (ProcessReading(10, GIB), ProcessReading(20, 2 * GIB)), 1, 0.9
                    )
                ),
            ),
        ),
        (held(f"{MIG}::0", "ml/a", uuid=MIG), held(f"{MIG}::1", "ml/b", uuid=MIG)),
        [(f"{MIG}::0", "a", GIB, None, (10,)), (f"{MIG}::1", "b", 2 * GIB, None, (20,))],
        [],
    ),
    "each-mig-device-has-its-own-processes": Case(
        NodeReadings(
            0,
            (
                mig_gpu(
                    DeviceReading(MIG, GIB, 10 * GIB, (ProcessReading(10, GIB),), 1, None),
                    DeviceReading(MIG2, GIB, 10 * GIB, (ProcessReading(20, GIB),), 2, None),
                ),
            ),
        ),
        # Pod b's process runs on MIG2, which pod b does not hold.
        (held(MIG, "ml/a", uuid=MIG), held(MIG, "ml/b", uuid=MIG)),
        [(MIG, "a", GIB, None, (10,)), (MIG, "b", 0, None, ())],
        [Unattributed("GPU-mig", MIG2, GIB, (20,))],
    ),
    "a-slice-whose-device-is-not-read-has-no-figures": Case(
        NodeReadings(0, ()),
        (held(f"{GPU}::0", "ml/a"),),
        [(f"{GPU}::0", "a", 0, None, ())],
        [],
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_attribute(case: Case) -> None:
    owners = {**OWNERS, 1010: PodProcess("uid-a", "ctr-a")}
    result = attribute(case.readings, case.held, owners, PODS)
    assert case.uses == [
        (u.held.device, u.held.pod, u.memory_used_bytes, u.sm, u.processes) for u in result.slices
    ]
    assert case.unattributed == list(result.unattributed)


def test_a_slice_offers_its_devices_memory_or_its_mps_limit() -> None:
    readings = NodeReadings(0, (gpu(),))
    mps = HeldSlice(SHARED, f"{GPU}::0", GPU, GPU, "ml", "a", "main", memory_limit_bytes=4 * GIB)
    uses = attribute(readings, [mps, held(f"{GPU}::1", "ml/b")], OWNERS, PODS).slices
    assert [4 * GIB, 24 * GIB] == [u.memory_total_bytes for u in uses]


def device(uuid: str, replica: int | None = None, *, mig: bool = False, mps: bool = False) -> Device:
    ident = uuid if replica is None else f"{uuid}::{replica}"
    return Device(
        DeviceId(ident), Health.HEALTHY, None, GpuUuid("GPU-mig" if mig else GPU),
        MigUuid(uuid) if mig else None, replica, mps=mps,
    )  # fmt: skip


def test_held_slices_are_the_advertised_slices_pods_hold() -> None:
    inventory = Inventory(
        (
            (
                ResourceName(SHARED),
                (device(GPU, 0, mps=True), device(GPU, 1, mps=True), device(GPU, 2, mps=True)),
            ),
            (ResourceName("nvidia.com/mig-1g.10gb"), (device(MIG, mig=True), device(MIG2, mig=True))),
        )
    )
    holdings = [
        Holding("ml", "a", "main", SHARED, frozenset({f"{GPU}::0"})),
        Holding("ml", "b", "main", SHARED, frozenset({f"{GPU}::2", "GPU-gone::0"})),
    ]
    claims = [ClaimHold("ml", "claim", ("ml/c", "ml/d"), frozenset({MIG2}))]
    found = held_slices(inventory, holdings, claims, {GPU: 8 * GIB})
    assert [
        (SHARED, f"{GPU}::0", GPU, "ml", "a", "main", 8 * GIB),
        (SHARED, f"{GPU}::2", GPU, "ml", "b", "main", 8 * GIB),
        ("nvidia.com/mig-1g.10gb", MIG2, MIG2, "ml", "c", "", None),
        ("nvidia.com/mig-1g.10gb", MIG2, MIG2, "ml", "d", "", None),
    ] == [
        (s.resource, s.device, s.uuid, s.namespace, s.pod, s.container, s.memory_limit_bytes) for s in found
    ]


def test_uses_keep_the_slice_order() -> None:
    result = attribute(
        NodeReadings(0, (gpu(),)), [held(f"{GPU}::1", "ml/b"), held(f"{GPU}::0", "ml/a")], {}, PODS
    )
    assert all(isinstance(u, SliceUse) for u in result.slices)
    assert [f"{GPU}::0", f"{GPU}::1"] == [u.held.device for u in result.slices]
