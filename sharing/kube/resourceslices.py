"""Keeping the node's ResourceSlices on the API server exactly as wanted: create, update, delete, re-create.

The pool is the node's (pool name = node name, `spec.nodeName` set) and its slices are owned by the Node
as controller, so they go with it. Any change bumps the pool's generation in every slice and sets
`resourceSliceCount`, as consumers require (k8s.io/api resource/v1 types.go, `ResourcePool`). The
kubelet deletes a node's slices when it starts and about 30 s after a driver unregisters
(kubernetes/kubernetes#141912, `defaultWipingDelay`), and anyone may edit them: a watch on the pool
wakes the publisher, which puts back what is wanted. An API server whose feature gates are off
silently drops the fields they guard (taints, `allowMultipleAllocations`, request policies): what was
written is compared with what was stored, the difference is logged once per change with the gate
to turn on, and the stored form counts as published (no endless rewrites).

Wanted pools come from `want()` (latest wins: a burst of changes is one sync of the newest); `run()`
syncs them from a thread, because the client blocks, and again every `resync_s` whatever happens.
Between those reads the pool as last written is the publisher's own (its watch says when anyone else
changes it): a change of the node's claims is one write, without a list of the pool or a read of the
Node before it; a write that finds the slice changed or gone (409, 404) reads both and plans again.

While `hold_additions` is set (the kubelet has not confirmed the driver's registration), devices the
pool does not hold already are not added: a pod the scheduler placed on them would fail "DRA driver
... is not registered" and wait out the kubelet's retry (10 s and more, k8s.io/kubernetes
pkg/kubelet/pod_workers.go backOffPeriod). What the pool holds stays, and withdrawals go through.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import structlog

from sharing.errors import KubeError
from sharing.kube.api import (
    ConflictError,
    CounterSet,
    GoneError,
    KubeClient,
    NodeObject,
    NotFoundError,
    ResourceSliceObject,
    SliceDevice,
    SliceSpec,
    WatchEvent,
)
from sharing.text import bounded

log = structlog.get_logger(__name__)
Content = tuple[tuple[SliceDevice, ...], tuple[CounterSet, ...]]
"""What a slice holds: its devices and its counter sets."""


def content(spec: SliceSpec) -> Content:
    """The devices and counter sets of a slice, as the pool compares them."""
    return spec.devices, spec.shared_counters


BACKOFF_MAX_S = 30.0
GATES = {
    "taints": "DRADeviceTaints",
    "allowMultipleAllocations": "DRAConsumableCapacity",
    "requestPolicy": "DRAConsumableCapacity",
    "sharedCounters": "DRAPartitionableDevices",
    "consumesCounters": "DRAPartitionableDevices",
}
"""The feature gate (kube-apiserver) without which the API server drops a field (types.go +featureGate)."""


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """What makes the API server hold the wanted pool: every slice written at `generation`."""

    generation: int
    updates: tuple[tuple[ResourceSliceObject, SliceSpec], ...] = ()
    creates: tuple[SliceSpec, ...] = ()
    deletes: tuple[ResourceSliceObject, ...] = ()


def plan_pool(
    wanted: Sequence[SliceSpec],
    existing: Sequence[ResourceSliceObject],
    *,
    floor: int,
    owner_uid: str,
    stored: dict[Content, Content] | None = None,
) -> PoolPlan | None:
    """None when `existing` already is the wanted pool; else the writes, at a generation above
    `floor` and above every existing one. `stored` maps wanted contents to the form the API server
    stores them in (after it dropped fields)."""
    stored = stored or {}
    held = Counter(content(s.spec) for s in existing)
    expected = Counter(stored.get(content(w), content(w)) for w in wanted)
    generations = {s.spec.generation for s in existing}
    if (
        held == expected
        and len(generations) <= 1
        and all(s.spec.slice_count == len(wanted) for s in existing)
        and all(owner_uid in s.owners for s in existing)
    ):
        return None
    top = max([floor, *generations])
    ordered = sorted(existing, key=lambda s: s.name)
    # One slice whose content changed, and nothing else (no slice added, removed or owned anew): it is
    # updated alone, at the generation the pool has, as the upstream publisher does ("Kept generation
    # because at most one update API call is necessary", k8s.io/dynamic-resource-allocation v0.37.2
    # resourceslice/resourceslicecontroller.go): one write, and no consumer can see two slices of the
    # pool out of step. A prepare on a dynamic GPU changes that GPU's slice only.
    single = _single_update(wanted, ordered, top, owner_uid, stored)
    if single is not None:
        return single
    generation = top + 1
    specs = [replace(w, generation=generation, slice_count=len(wanted)) for w in wanted]
    # A slice keeps what it held (the same devices or counter sets, in another order or form): the
    # scheduler tries slices in name order (first fit), so what was first stays first.
    free = list(ordered)
    pairs: list[tuple[ResourceSliceObject, SliceSpec]] = []
    rest: list[SliceSpec] = []
    for spec in specs:
        same = next((s for s in free if _identity(s.spec) == _identity(spec)), None)
        if same is None:
            rest.append(spec)
        else:
            free.remove(same)
            pairs.append((same, spec))
    pairs += zip(free, rest, strict=False)
    return PoolPlan(
        generation,
        updates=tuple(sorted(pairs, key=lambda pair: pair[0].name)),
        creates=tuple(rest[len(free) :]),
        deletes=tuple(free[len(rest) :]),
    )


def _single_update(
    wanted: Sequence[SliceSpec],
    ordered: Sequence[ResourceSliceObject],
    generation: int,
    owner_uid: str,
    stored: dict[Content, Content],
) -> PoolPlan | None:
    """The plan that updates one slice at the pool's generation, where that is all that changed."""
    if len(wanted) != len(ordered) or not ordered:
        return None
    if any(
        s.spec.generation != generation or s.spec.slice_count != len(wanted) or owner_uid not in s.owners
        for s in ordered
    ):
        return None
    left = list(ordered)
    changed: list[SliceSpec] = []
    for spec in wanted:
        same = next((s for s in left if content(s.spec) == stored.get(content(spec), content(spec))), None)
        if same is None:
            changed.append(spec)
        else:
            left.remove(same)
    if len(changed) != 1 or len(left) != 1:
        return None
    spec = replace(changed[0], generation=generation, slice_count=len(wanted))
    return PoolPlan(generation, updates=((left[0], spec),))


def _held(wanted: Sequence[SliceSpec], existing: Sequence[ResourceSliceObject]) -> tuple[SliceSpec, ...]:
    """The wanted pool less the devices `existing` does not offer (counter sets kept as wanted)."""
    offered = {d.name for s in existing for d in s.spec.devices}
    kept = [replace(s, devices=tuple(d for d in s.devices if d.name in offered)) for s in wanted]
    kept = [s for s in kept if s.devices or s.shared_counters]
    return tuple(replace(s, slice_count=len(kept)) for s in kept)


def _identity(spec: SliceSpec) -> frozenset[str]:
    """What a slice is about: the names of its devices and counter sets."""
    return frozenset(d.name for d in spec.devices) | frozenset(c.name for c in spec.shared_counters)


def dropped(written: SliceSpec, stored: SliceSpec) -> list[str]:
    """What the API server left out of a slice, one phrase per device and field."""
    found: list[str] = []
    kept = {d.name: d for d in stored.devices}
    for device in written.devices:
        back = kept.get(device.name)
        if back is None:
            found.append(f"device {device.name}")
            continue
        if device.taints and not back.taints:
            found.append(f"taints of {device.name}")
        if device.allow_multiple_allocations and not back.allow_multiple_allocations:
            found.append(f"allowMultipleAllocations of {device.name}")
        if any(c.policy for _, c in device.capacity) and not any(c.policy for _, c in back.capacity):
            found.append(f"requestPolicy of {device.name}")
        if dict(device.attributes).keys() - dict(back.attributes).keys():
            found.append(f"attributes of {device.name}")
        if device.consumes_counters and not back.consumes_counters:
            found.append(f"consumesCounters of {device.name}")
    if written.shared_counters and not stored.shared_counters:
        found.append("sharedCounters")
    if not found and written != stored:
        found.append("fields")
    return found


class SlicePublisher:
    """Holds the node's pool of `driver` on the API server as `want()` last said."""

    def __init__(
        self, kube: KubeClient, node: str, driver: str, *, resync_s: float = 60.0, watch_timeout_s: int = 300
    ) -> None:
        self.kube = kube
        self.node = node
        self.driver = driver
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.generation = 0
        """The pool's generation last written (0: none yet)."""
        self.published: tuple[ResourceSliceObject, ...] = ()
        self.problems: tuple[str, ...] = ()
        """What the API server dropped of the pool last written, one sentence each."""
        self.counters_dropped = False
        """The API server dropped counters once: devices that consume counters are not published."""
        self._wanted: tuple[SliceSpec, ...] | None = None
        self._synced: tuple[tuple[SliceSpec, ...], bool] | None = None
        """The wanted pool the last sync made the API server hold, and whether additions were held
        then (a `want` then `sync` is not synced again by the loop; a `release` since is news)."""
        self._changed_by_others = False
        self._owner: NodeObject | None = None
        self._known = False
        """`published` and `_owner` are the pool and its Node as the API server holds them (a sync
        completed; the watch says when anyone else changes the pool)."""
        """The Node as last read for a write (its UID: what the slices must be owned by)."""
        self._stored: dict[Content, Content] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self._written: set[str] = set()
        """Resource versions this publisher wrote that its watch has not seen yet."""
        self._lock = threading.Lock()
        self.hold_additions = False
        """Add no device the pool does not hold already (see the module's docstring)."""
        self.said_missing: frozenset[str] = frozenset()
        """Gates already said to be off (`sharing.kube.features`): their dropped fields are not news."""

    def release(self) -> None:
        """Add what is wanted from now on (the kubelet uses the driver)."""
        self.hold_additions = False
        self._wake.set()

    @property
    def wanted(self) -> tuple[SliceSpec, ...]:
        """The pool as last wanted (none before the first `want`)."""
        return self._wanted or ()

    def want(self, slices: Sequence[SliceSpec]) -> None:
        """The pool to publish now (replaces any wanted before and not yet published)."""
        self._wanted = tuple(slices)
        self._wake.set()

    async def run(self) -> None:
        """Sync until cancelled: on `want()`, on any change of the pool by others, every `resync_s`."""
        self._loop = asyncio.get_running_loop()
        watcher = threading.Thread(target=self._watch, name="watch-resourceslices", daemon=True)
        watcher.start()
        failures = 0
        try:
            while True:
                timeout = self.resync_s if failures == 0 else min(BACKOFF_MAX_S, 0.5 * 2**failures)
                woken = False
                try:
                    async with asyncio.timeout(timeout):
                        woken = await self._wake.wait()
                except TimeoutError:
                    pass
                self._wake.clear()
                if self._wanted is None:
                    continue
                try:
                    # Woken by `want` alone: what the caller's own `sync` has written is not read again.
                    await asyncio.to_thread(self.sync, again=not woken or failures > 0)
                    failures = 0
                except KubeError as err:
                    failures += 1
                    log.warning("resourceslices_not_synced", error=bounded(str(err)))
                except Exception as err:  # a bug must not end publishing silently: say it, try again
                    failures += 1
                    log.error(
                        "resourceslices_sync_crashed", error=f"{type(err).__name__}: {bounded(str(err))}"
                    )
        finally:
            self._stopped.set()

    def sync(self, *, again: bool = True) -> PoolPlan | None:
        """Make the API server hold the wanted pool (blocking); the plan it took, None when in sync.
        Without `again`, a pool already synced as wanted, that nobody else changed since, is not
        read again, and one nobody else changed since the last sync is planned from what was written."""
        if self._wanted is None:
            return None
        with self._lock:
            done = self._synced
            current = done is not None and done[0] is self._wanted and done[1] == self.hold_additions
            if not again and current and not self._changed_by_others:
                return None
            read = again or self._changed_by_others or not self._known
            wanted, held, self._changed_by_others = self._wanted, self.hold_additions, False
            seen = self.counters_dropped
            self._known = False  # until this sync is done: a failed one leaves the pool unknown
            try:
                plan = self._sync(self._safe(self._wanted), read=read)
            except (ConflictError, NotFoundError):
                if read:
                    raise
                plan = self._sync(self._safe(self._wanted), read=True)  # someone changed it: read it
            if self.counters_dropped and not seen:
                # Devices without their counters could be allocated together where the hardware
                # cannot hold them (overlapping MIG placements): take them all back at once.
                log.error(
                    "partitionable_devices_withdrawn",
                    hint="the API server drops counters (feature gate DRAPartitionableDevices off): "
                    "on-demand MIG devices are not offered; turn the gate on and restart the agent",
                )
                plan = self._sync(self._safe(self._wanted), read=True)
            self._known = True
            self._synced = (wanted, held)
            return plan

    def _safe(self, wanted: tuple[SliceSpec, ...]) -> tuple[SliceSpec, ...]:
        """The wanted pool, without counters and the devices that consume them once the API server
        was seen to drop them (fail closed)."""
        if not self.counters_dropped:
            return wanted
        kept = [
            replace(s, devices=tuple(d for d in s.devices if not d.consumes_counters))
            for s in wanted
            if not s.shared_counters
        ]
        kept = [s for s in kept if s.devices]
        return tuple(replace(s, slice_count=len(kept)) for s in kept)

    def _sync(self, wanted: tuple[SliceSpec, ...], *, read: bool) -> PoolPlan | None:
        """One round of writes towards `wanted` (the caller holds the lock). With `read`, the pool
        is listed and the Node read before a write; without, both are taken as last written."""
        existing = self.kube.list_resource_slices(self.driver, self.node) if read else self.published
        if self.hold_additions:
            wanted = _held(wanted, existing)
        if (
            self._owner is not None
            and plan_pool(
                wanted, existing, floor=self.generation, owner_uid=self._owner.uid, stored=self._stored
            )
            is None
        ):
            self.published = tuple(existing)
            return None
        owner = self._owner
        if read or owner is None:  # afresh for writes: a Node made again has a new UID
            owner = self._owner = self.kube.get_node(self.node)
        plan = plan_pool(wanted, existing, floor=self.generation, owner_uid=owner.uid, stored=self._stored)
        if plan is None:
            self.published = tuple(existing)
            return None
        rewritten = {old.name for old, _ in plan.updates} | {old.name for old in plan.deletes}
        kept = [s for s in existing if s.name not in rewritten]
        results: list[ResourceSliceObject] = []
        problems: list[str] = []
        if len(self._written) > 1024:  # versions the watch never showed (it started after them)
            self._written.clear()
        for old, spec in plan.updates:
            results.append(
                self._written_as(
                    spec,
                    self.kube.update_resource_slice(old.name, old.resource_version, spec, owner),
                    problems,
                )
            )
        for spec in plan.creates:
            results.append(self._written_as(spec, self.kube.create_resource_slice(spec, owner), problems))
        for old in plan.deletes:
            self.kube.delete_resource_slice(old.name)
        self.generation = plan.generation
        self.published = tuple(sorted([*kept, *results], key=lambda s: s.name))
        if problems and tuple(problems) != self.problems:
            gates = sorted({g for field, g in GATES.items() if any(field in p for p in problems)})
            said = gates and set(gates) <= self.said_missing
            (log.debug if said else log.warning)(
                "resourceslice_fields_dropped",
                dropped=bounded("; ".join(problems)),
                feature_gates=",".join(gates) or "unknown",
                hint="the API server lacks these features: turn the gates on (API server, scheduler)",
            )
        self.problems = tuple(problems)
        if any("Counters" in p for p in problems):
            self.counters_dropped = True
        log.info(
            "resourceslices_published",
            generation=plan.generation,
            slices=len(results),
            devices=sum(len(s.devices) for s in wanted),
            updated=len(plan.updates),
            created=len(plan.creates),
            deleted=len(plan.deletes),
        )
        return plan

    def _written_as(
        self, spec: SliceSpec, stored: ResourceSliceObject, problems: list[str]
    ) -> ResourceSliceObject:
        self._written.add(stored.resource_version)
        if stored.spec != spec:
            problems += [f"{stored.name}: {p}" for p in dropped(spec, stored.spec)]
            self._stored[content(spec)] = content(stored.spec)
        return stored

    def _watch(self) -> None:
        """Wake the loop when someone else changes, deletes or adds a slice of the pool."""
        version = ""
        failures = 0
        while not self._stopped.is_set():
            try:
                for event in self.kube.watch_resource_slices(
                    self.driver, self.node, version, self.watch_timeout_s
                ):
                    failures = 0
                    version = event.resource_version or version
                    self._seen(event)
                    if self._stopped.is_set():
                        return
            except GoneError:
                version = ""
            except KubeError as err:
                failures += 1
                log.debug("resourceslice_watch_failed", error=bounded(str(err)))
                self._stopped.wait(min(BACKOFF_MAX_S, 0.2 * 2**failures))

    def _seen(self, event: WatchEvent) -> None:
        """One event of the pool's watch: a change this publisher did not write wakes the loop to
        read the pool. The event of a write can come through the watch before the write's answer:
        a sync under way is waited for, so that the version it wrote is known before the event is
        judged someone else's (else every such race costs a list of the pool)."""
        if event.kind == "BOOKMARK":
            return
        with self._lock:
            if event.resource_version in self._written:
                self._written.discard(event.resource_version)
                return
        self._changed_by_others = True
        self._trigger()

    def _trigger(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)
