"""What the publisher writes to make the API server hold the wanted pool, and what it says was dropped."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

import pytest

from sharing.kube.api import (
    Capacity,
    CounterSet,
    DeviceTaint,
    NodeObject,
    RequestPolicy,
    ResourceSliceObject,
    SliceDevice,
    SliceSpec,
    WatchEvent,
)
from sharing.kube.resourceslices import PoolPlan, SlicePublisher, dropped, plan_pool
from tests.polling import poll
from tests.unit.fakekube import FakeKube

A = (SliceDevice("gpu-0"), SliceDevice("gpu-1"))
B = (SliceDevice("gpu-2"),)


def spec(devices: tuple[SliceDevice, ...], generation: int = 0, count: int = 2) -> SliceSpec:
    return SliceSpec("gpu.nvidia.com", "n", "n", generation, count, devices)


def held(
    name: str, devices: tuple[SliceDevice, ...], generation: int = 3, count: int = 2, owner: str = "u"
) -> ResourceSliceObject:
    return ResourceSliceObject(name, "1", spec(devices, generation, count), (owner,))


WANTED = (spec(A), spec(B))
S1, S2 = held("s1", A), held("s2", B)
S2_OLD = held("s2", B, generation=2)
S1_3, S2_3 = held("s1", A, count=3), held("s2", B, count=3)
S2_THEIRS = held("s2", B, owner="old")
S3 = held("s3", B)


@pytest.mark.parametrize(
    ("existing", "floor", "expected"),
    [
        ((), 0, PoolPlan(1, creates=(spec(A, 1), spec(B, 1)))),
        ((held("s1", B), held("s2", A)), 0, None),
        ((S1, S2_OLD), 0, PoolPlan(4, updates=((S1, spec(A, 4)), (S2_OLD, spec(B, 4))))),
        ((S1_3, S2_3), 9, PoolPlan(10, updates=((S1_3, spec(A, 10)), (S2_3, spec(B, 10))))),
        ((S1, S2_THEIRS), 0, PoolPlan(4, updates=((S1, spec(A, 4)), (S2_THEIRS, spec(B, 4))))),
        ((S1, S2, S3), 0, PoolPlan(4, updates=((S1, spec(A, 4)), (S2, spec(B, 4))), deletes=(S3,))),
    ],
    ids=[
        "empty-creates-all",
        "in-sync",
        "mixed-generations",
        "wrong-count",
        "other-owner",
        "extra-slice-deleted",
    ],
)
def test_plan(existing: tuple[ResourceSliceObject, ...], floor: int, expected: PoolPlan | None) -> None:
    assert plan_pool(WANTED, existing, floor=floor, owner_uid="u") == expected


def test_nothing_wanted_deletes_everything() -> None:
    assert plan_pool((), (held("s1", A),), floor=0, owner_uid="u") == PoolPlan(4, deletes=(held("s1", A),))


def test_the_stored_form_of_a_pool_counts_as_published() -> None:
    shared = (
        SliceDevice(
            "gpu-0",
            capacity=(("shares", Capacity("4", RequestPolicy("1", "1", "4"))),),
            allow_multiple_allocations=True,
        ),
    )
    kept = (SliceDevice("gpu-0", capacity=(("shares", Capacity("4")),)),)
    existing = (held("s1", kept, count=1),)
    assert plan_pool((spec(shared, count=1),), existing, floor=0, owner_uid="u") is not None
    assert (
        plan_pool(
            (spec(shared, count=1),), existing, floor=0, owner_uid="u", stored={(shared, ()): (kept, ())}
        )
        is None
    )


def test_dropped_names_each_device_and_field() -> None:
    taint = DeviceTaint("gpu.nvidia.com/xid", "48", "NoSchedule")
    policy = Capacity("2", RequestPolicy("1", "1", "2"))
    written = spec(
        (
            SliceDevice("gpu-0", taints=(taint,)),
            SliceDevice("gpu-1", capacity=(("shares", policy),), allow_multiple_allocations=True),
        )
    )
    kept = replace(
        written, devices=(SliceDevice("gpu-0"), SliceDevice("gpu-1", capacity=(("shares", Capacity("2")),)))
    )
    assert dropped(written, kept) == [
        "taints of gpu-0",
        "allowMultipleAllocations of gpu-1",
        "requestPolicy of gpu-1",
    ]


async def test_a_burst_of_wanted_pools_is_one_sync_of_the_newest() -> None:
    kube = FakeKube("n", {})
    publisher = SlicePublisher(kube, "n", "gpu.nvidia.com")
    task = asyncio.create_task(publisher.run())
    try:
        for devices in (A, B, A + B):  # before the loop runs: only the last counts
            publisher.want((spec(devices, count=1),))
        await asyncio.to_thread(poll, "the pool", lambda: publisher.generation, lambda g: g > 0)
        assert [(w[0], w[2]) for w in kube.slice_writes] == [("create", 1)]
        assert [s.spec.devices for s in kube.slices.values()] == [A + B]
        kube.wipe_slices("n")  # the kubelet starts: the pool comes back, one generation on
        await asyncio.to_thread(poll, "the pool again", lambda: publisher.generation, lambda g: g == 2)
        assert [s.spec.devices for s in kube.slices.values()] == [A + B]
    finally:
        task.cancel()
        kube.close()
        await asyncio.gather(task, return_exceptions=True)


def test_a_slice_keeps_what_it_held_when_the_order_of_its_devices_changes() -> None:
    """The scheduler tries slices in name order: a GPU's devices stay in the slice they were in. One
    slice changed alone is one write at the pool's generation (as the upstream publisher does)."""
    existing = (held("s1", B), held("s2", A))
    reordered = (SliceDevice("gpu-1"), SliceDevice("gpu-0"))
    plan = plan_pool((spec(reordered), spec(B)), existing, floor=0, owner_uid="u")
    assert plan == PoolPlan(3, updates=((existing[1], spec(reordered, 3)),))
    withdrawn = (SliceDevice("gpu-1"),)
    plan = plan_pool((spec(withdrawn), spec(B)), existing, floor=0, owner_uid="u")
    assert plan == PoolPlan(3, updates=((existing[1], spec(withdrawn, 3)),))


def test_two_slices_changed_are_rewritten_at_a_new_generation() -> None:
    """Two writes are not atomic: a consumer could see one new slice beside one old one, so every
    slice goes to the next generation, and consumers take only the newest."""
    existing = (held("s1", B), held("s2", A))
    a, b = (SliceDevice("gpu-1"), SliceDevice("gpu-0")), (SliceDevice("gpu-3"),)
    plan = plan_pool((spec(a), spec(b)), existing, floor=0, owner_uid="u")
    assert plan == PoolPlan(4, updates=((existing[0], spec(b, 4)), (existing[1], spec(a, 4))))


class NoCounters(FakeKube):
    """An API server with DRAPartitionableDevices off: it stores slices without any counter."""

    @staticmethod
    def _strip(spec: SliceSpec) -> SliceSpec:
        devices = tuple(replace(d, consumes_counters=()) for d in spec.devices)
        return replace(spec, devices=devices, shared_counters=())

    def create_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        return super().create_resource_slice(self._strip(spec), owner)

    def dry_run_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        return super().dry_run_resource_slice(self._strip(spec), owner)

    def update_resource_slice(
        self, name: str, resource_version: str, spec: SliceSpec, owner: NodeObject
    ) -> ResourceSliceObject:
        return super().update_resource_slice(name, resource_version, self._strip(spec), owner)


def test_devices_whose_counters_the_api_server_drops_are_taken_back_at_once() -> None:
    """Without their counters, overlapping MIG placements could be allocated together: fail closed."""
    counted = CounterSet("gpu-0-counters", (("memory-slice-0", "1"),))
    partitionable = (
        SliceSpec("gpu.nvidia.com", "n", "n", 0, 3, (), (counted,)),
        spec((SliceDevice("gpu-0-mig-1g-5gb-at-0", consumes_counters=(counted,)),), count=3),
        spec(B, count=3),
    )
    kube = NoCounters("n", {})
    publisher = SlicePublisher(kube, "n", "gpu.nvidia.com")
    publisher.want(partitionable)
    publisher.sync()
    assert publisher.counters_dropped
    assert [s.spec.devices for s in kube.slices.values()] == [B]
    assert [(s.spec.generation, s.spec.slice_count) for s in kube.slices.values()] == [(2, 1)]
    publisher.sync()
    assert [w[0] for w in kube.slice_writes] == ["create", "create", "create", "update", "delete", "delete"]
    kube.close()


async def test_a_release_while_a_held_sync_runs_publishes_the_devices() -> None:
    """The kubelet confirms the registration while a sync with additions held is writing: the devices
    go out at once, not at the next resync."""
    loop = asyncio.get_running_loop()
    released = threading.Event()

    class Confirming(FakeKube):
        def list_resource_slices(self, driver: str, node: str) -> tuple[ResourceSliceObject, ...]:
            if not released.is_set():  # the registration is confirmed while this sync runs
                loop.call_soon_threadsafe(lambda: (publisher.release(), released.set()))
                released.wait(10)
            return super().list_resource_slices(driver, node)

    kube = Confirming("n", {})
    publisher = SlicePublisher(kube, "n", "gpu.nvidia.com", resync_s=3600)
    publisher.hold_additions = True
    task = asyncio.create_task(publisher.run())
    try:
        publisher.want((spec(A, count=1),))
        await asyncio.to_thread(publisher.sync)
        await asyncio.to_thread(
            poll,
            "the devices published",
            lambda: [s.spec.devices for s in kube.slices.values()],
            lambda d: d == [A],
        )
        assert released.is_set()
    finally:
        task.cancel()
        kube.close()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_want_the_caller_synced_is_not_read_again_by_the_loop() -> None:
    kube = FakeKube("n", {})
    publisher = SlicePublisher(kube, "n", "gpu.nvidia.com", resync_s=3600)
    task = asyncio.create_task(publisher.run())
    try:
        publisher.want((spec(A, count=1),))
        await asyncio.to_thread(publisher.sync)
        reads = kube.requests
        publisher.want((spec(A + B, count=1),))  # the next change, synced by the loop alone
        await asyncio.to_thread(
            poll,
            "the next pool",
            lambda: [s.spec.devices for s in kube.slices.values()],
            lambda d: d == [A + B],
        )
        # That change's write alone: the pool and its Node are as the first sync left them.
        assert [("update", 1)] == [(w[0], w[2]) for w in kube.slice_writes[1:]]
        assert 1 == kube.requests - reads
    finally:
        task.cancel()
        kube.close()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("change", ["edited", "deleted"])
def test_a_write_that_finds_the_slice_changed_by_someone_else_reads_the_pool_and_plans_again(
    change: str,
) -> None:
    """Someone else's change the watch has not shown yet: the write from the pool as last written
    fails (409 or 404, as the API server answers) and the publisher reads the pool and writes again."""
    kube = FakeKube("n", {})
    publisher = SlicePublisher(kube, "n", "gpu.nvidia.com")
    publisher.want((spec(A, count=1),))
    publisher.sync()
    (name,) = kube.slices
    if change == "edited":  # not through FakeKube's methods: no watch event for it yet
        kube.slices[name] = replace(kube.slices[name], resource_version="edited")
    else:
        del kube.slices[name]
    publisher.want((spec(A + B, count=1),))
    reads = kube.requests
    assert publisher.sync(again=False) is not None
    assert [s.spec.devices for s in kube.slices.values()] == [A + B]
    # The failed write, the list, the Node, the write again.
    assert 4 == kube.requests - reads
    kube.close()


def test_a_withdrawal_reads_the_pool_first() -> None:
    """The default sync (a change withdrawing devices) plans from the pool the API server holds."""
    kube = FakeKube("n", {})
    publisher = SlicePublisher(kube, "n", "gpu.nvidia.com")
    publisher.want((spec(A + B, count=1),))
    publisher.sync()
    (name,) = kube.slices
    kube.slices[name] = replace(kube.slices[name], resource_version="edited")
    publisher.want((spec(A, count=1),))
    reads = kube.requests
    publisher.sync()
    assert [s.spec.devices for s in kube.slices.values()] == [A]
    assert 3 == kube.requests - reads  # the list, the Node, the write
    kube.close()


class _Lock:
    """The publisher's lock, setting `waited` when a thread has to wait for it."""

    def __init__(self) -> None:
        self.inner = threading.Lock()
        self.waited = threading.Event()

    def __enter__(self) -> None:
        if not self.inner.acquire(blocking=False):
            self.waited.set()
            self.inner.acquire()

    def __exit__(self, *_: object) -> None:
        self.inner.release()


class _WatchFirst(FakeKube):
    """An API server whose watch hands the event of an update to the publisher before the update's
    answer comes back (they travel apart on a real one): the update answers once the publisher has
    judged the event, or has to wait for the publisher's lock to judge it."""

    def __init__(self, lock: _Lock) -> None:
        super().__init__("n", {})
        self.lock = lock
        self.seen: Any = None
        self.judges: list[threading.Thread] = []

    def update_resource_slice(
        self, name: str, resource_version: str, spec: SliceSpec, owner: NodeObject
    ) -> ResourceSliceObject:
        made = super().update_resource_slice(name, resource_version, spec, owner)
        progress = self.lock.waited = threading.Event()

        def judge() -> None:
            self.seen(WatchEvent("MODIFIED", made, made.resource_version))
            progress.set()

        self.judges.append(threading.Thread(target=judge))
        self.judges[-1].start()
        progress.wait()
        return made


def test_the_watch_event_of_its_own_write_before_the_answer_is_not_taken_for_someone_elses() -> None:
    lock = _Lock()
    kube = _WatchFirst(lock)
    publisher = SlicePublisher(kube, "n", "gpu.nvidia.com")
    publisher._lock = lock  # type: ignore[assignment]
    kube.seen = publisher._seen
    publisher.want((spec(A, count=1),))
    publisher.sync()
    (made,) = kube.slices.values()
    publisher._seen(WatchEvent("ADDED", made, made.resource_version))  # the create's, after its answer
    publisher.want((spec(A + B, count=1),))
    assert publisher.sync(again=False) is not None  # an update: its event judged before its answer
    for thread in kube.judges:
        thread.join()
    publisher.want((spec(B, count=1),))
    reads = kube.requests
    assert publisher.sync(again=False) is not None
    assert 1 == kube.requests - reads  # the write alone: nobody else changed the pool, it is not read
    kube.close()
