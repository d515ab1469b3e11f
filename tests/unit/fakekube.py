"""An in-memory Kubernetes API for fast agent tests: one Node, ConfigMaps, label patches, Events.

Watches block on a queue per object, so the agent's watch threads see changes the test makes, in
order. Only for unit tests; the e2e tests run the agent against a real kube-apiserver.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import datetime

from sharing.errors import KubeError
from sharing.kube import ConfigMapObject, NodeObject, NotFoundError, WatchEvent
from sharing.kube.api import (
    AllocatedDevice,
    ConflictError,
    PodReference,
    ResourceClaimObject,
    ResourceSliceObject,
    SliceSpec,
)
from sharing.model import BoundPod, ClaimAllocation

# The API server's rules for metadata (k8s.io/apimachinery pkg/util/validation/validation.go:
# IsQualifiedName, IsValidLabelValue; pkg/api/validation/objectmeta.go: TotalAnnotationSizeLimitB).
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ANNOTATIONS_LIMIT = 256 * 1024


def metadata_problems(labels: Mapping[str, str], annotations: Mapping[str, str]) -> list[str]:
    """What the API server rejects a Node update for (one bad entry rejects the whole request)."""
    problems = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        bad_prefix = prefix and (len(prefix) > 253 or not _PREFIX.match(prefix))
        if len(name) > 63 or not _NAME.match(name) or bad_prefix:
            problems.append(f"label key {key!r}")
        if len(value) > 63 or (value and not _NAME.match(value)):
            problems.append(f"label {key}={value!r}")
    if sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items()) > ANNOTATIONS_LIMIT:
        problems.append("annotations over 256 KiB")
    return problems


class FakeKube:
    """KubeClient in memory; `events` collects (type, reason, message)."""

    def __init__(self, node: str, configmaps: Mapping[tuple[str, str], Mapping[str, str] | None]) -> None:
        self.requests = 0
        self.dry_runs = 0
        self.node = NodeObject(node, "uid-1", "1", {})
        self.configmaps = {
            key: ConfigMapObject(key[0], key[1], "1", data) for key, data in configmaps.items()
        }
        self.events: list[tuple[str, str, str]] = []
        self.event_counts: list[int] = []
        """The `count` each Event was recorded with (in the order of `events`)."""
        self.event_times: list[tuple[datetime | None, datetime | None]] = []
        """The first and last time each Event was recorded with (None: now)."""
        self.events_fail: Exception | None = None
        """What creating an Event raises while set (an API server outage, a refusal)."""
        self.evicted: list[str] = []
        """`namespace/pod` of each eviction asked for and granted (drain mode)."""
        self.budget: set[str] = set()
        """`namespace/pod` a PodDisruptionBudget keeps: its eviction is refused (HTTP 429)."""
        self.bound: tuple[BoundPod, ...] = ()
        """The pods bound to the node (none: the tests' pods exist only in the fake kubelet)."""
        self.claims: dict[tuple[str, str], ResourceClaimObject] = {}
        """ResourceClaims by (namespace, name)."""
        self.claim_reads = 0
        """GETs of ResourceClaims."""
        self.nominated: tuple[BoundPod, ...] = ()
        """The pods the scheduler is binding to the node (status.nominatedNodeName)."""
        self.pool_claims: tuple[ClaimAllocation, ...] = ()
        """Claims allocated devices of the node's pool (driver gpu.nvidia.com), each with its pods bound
        to the node: `list_node_pods` lists those pods, naming the claim, and `get_resource_claim`
        reads it, allocated those devices."""
        self.slices: dict[str, ResourceSliceObject] = {}
        """ResourceSlices by name."""
        self.slice_writes: list[tuple[str, str, int]] = []
        """(create | update | delete, slice name, pool generation) in the order they came."""
        self._version = 1
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, ...], queue.Queue[WatchEvent | None]] = {}

    # --- what the test does --------------------------------------------------------------------

    def label(self, **labels: str) -> None:
        with self._lock:
            self.node = replace(
                self.node, resource_version=self._next(), labels={**self.node.labels, **labels}
            )
            self._push(("node",), WatchEvent("MODIFIED", self.node, self.node.resource_version))

    def set_allocatable(self, allocatable: Mapping[str, str]) -> None:
        """The kubelet's status loop writes the Node's allocatable."""
        with self._lock:
            self.node = replace(self.node, resource_version=self._next(), allocatable=dict(allocatable))
            self._push(("node",), WatchEvent("MODIFIED", self.node, self.node.resource_version))

    def set_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        with self._lock:
            cm = ConfigMapObject(namespace, name, self._next(), dict(data))
            self.configmaps[(namespace, name)] = cm
            self._push(("cm", namespace, name), WatchEvent("MODIFIED", cm, cm.resource_version))

    def wipe_slices(self, node: str) -> None:
        """Delete the node's ResourceSlices, as the kubelet does when it starts."""
        with self._lock:
            for name in [n for n, s in self.slices.items() if s.spec.node == node]:
                gone = self.slices.pop(name)
                self._push(("slices",), WatchEvent("DELETED", gone, self._next()))

    def close(self) -> None:
        for q in list(self._queues.values()):
            q.put(None)

    # --- KubeClient ---------------------------------------------------------------------------

    def get_node(self, name: str) -> NodeObject:
        self.requests += 1
        return self.node

    def watch_node(self, name: str, resource_version: str, timeout_s: int) -> Iterator[WatchEvent]:
        self.requests += 1
        return self._stream(("node",))

    def get_configmap(self, namespace: str, name: str) -> ConfigMapObject:
        self.requests += 1
        return self.configmaps.get((namespace, name)) or ConfigMapObject(namespace, name, "", None)

    def watch_configmap(
        self, namespace: str, name: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        self.requests += 1
        return self._stream(("cm", namespace, name))

    def patch_node_labels(
        self, name: str, patch: Mapping[str, str | None], annotations: Mapping[str, str | None] | None = None
    ) -> NodeObject:
        self.requests += 1
        with self._lock:
            labels = {k: v for k, v in {**self.node.labels, **patch}.items() if v is not None}
            notes = {
                k: v for k, v in {**self.node.annotations, **(annotations or {})}.items() if v is not None
            }
            if problems := metadata_problems(labels, notes):
                raise KubeError(f"422 Node {name!r} is invalid: {'; '.join(problems)}")
            self.node = replace(self.node, resource_version=self._next(), labels=labels, annotations=notes)
            self._push(("node",), WatchEvent("MODIFIED", self.node, self.node.resource_version))
            return self.node

    def create_node_event(
        self,
        node: NodeObject,
        kind: str,
        reason: str,
        message: str,
        *,
        first: datetime | None = None,
        last: datetime | None = None,
        count: int = 1,
    ) -> None:
        self.requests += 1
        if self.events_fail is not None:
            raise self.events_fail
        if len(message) > 1024:
            raise KubeError("event message too long")
        self.events.append((kind, reason, message))
        self.event_counts.append(count)
        self.event_times.append((first, last))

    def set_unschedulable(self, name: str, unschedulable: bool) -> NodeObject:
        self.requests += 1
        with self._lock:
            self.node = replace(self.node, resource_version=self._next(), unschedulable=unschedulable)
            self._push(("node",), WatchEvent("MODIFIED", self.node, self.node.resource_version))
            return self.node

    def evict(self, namespace: str, pod: str) -> bool:
        self.requests += 1
        if f"{namespace}/{pod}" in self.budget:
            return False
        self.evicted.append(f"{namespace}/{pod}")
        return True

    def list_node_pods(self, node: str) -> tuple[BoundPod, ...]:
        self.requests += 1
        users = [
            BoundPod(c.namespace, pod.partition("/")[2], frozenset(), (c.name,))
            for c in self.pool_claims
            for pod in c.pods
        ]
        return (*self.bound, *users)

    def list_nominated_pods(self, node: str) -> tuple[BoundPod, ...]:
        self.requests += 1
        return self.nominated

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject:
        self.requests += 1
        self.claim_reads += 1
        claim = self.claims.get((namespace, name))
        if claim is None:
            claim = next(
                (
                    _claim(c, self.node.name)
                    for c in self.pool_claims
                    if (c.namespace, c.name) == (namespace, name)
                ),
                None,
            )
        if claim is None:
            raise NotFoundError(f"read resourceclaim {namespace}/{name}: HTTP 404 Not Found")
        return claim

    def list_resource_slices(self, driver: str, node: str) -> tuple[ResourceSliceObject, ...]:
        self.requests += 1
        with self._lock:
            return tuple(s for s in self.slices.values() if (s.spec.driver, s.spec.node) == (driver, node))

    def create_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        self.requests += 1
        with self._lock:
            made = ResourceSliceObject(
                f"{spec.driver}-{spec.node}-{self._next()}", self._next(), spec, (owner.uid,)
            )
            self.slices[made.name] = made
            self.slice_writes.append(("create", made.name, spec.generation))
            self._push(("slices",), WatchEvent("ADDED", made, made.resource_version))
            return made

    def dry_run_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        self.requests += 1
        self.dry_runs += 1
        return ResourceSliceObject(f"{spec.driver}-{spec.node}-dry-run", "", spec, (owner.uid,))

    def update_resource_slice(
        self, name: str, resource_version: str, spec: SliceSpec, owner: NodeObject
    ) -> ResourceSliceObject:
        self.requests += 1
        with self._lock:
            old = self.slices.get(name)
            if old is None:  # resourceslices are not made by an update (AllowCreateOnUpdate false)
                raise NotFoundError(f"update resourceslice {name}: HTTP 404 Not Found")
            if old.resource_version != resource_version:
                raise ConflictError(f"update resourceslice {name}: HTTP 409 Conflict")
            made = ResourceSliceObject(name, self._next(), spec, (owner.uid,))
            self.slices[name] = made
            self.slice_writes.append(("update", name, spec.generation))
            self._push(("slices",), WatchEvent("MODIFIED", made, made.resource_version))
            return made

    def delete_resource_slice(self, name: str) -> None:
        self.requests += 1
        with self._lock:
            gone = self.slices.pop(name, None)
            if gone is not None:
                self.slice_writes.append(("delete", name, gone.spec.generation))
                self._push(("slices",), WatchEvent("DELETED", gone, self._next()))

    def watch_resource_slices(
        self, driver: str, node: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        self.requests += 1
        return self._stream(("slices",))

    # --- plumbing -----------------------------------------------------------------------------

    def _next(self) -> str:
        self._version += 1
        return str(self._version)

    def _push(self, key: tuple[str, ...], event: WatchEvent) -> None:
        self._queues.setdefault(key, queue.Queue()).put(event)

    def _stream(self, key: tuple[str, ...]) -> Iterator[WatchEvent]:
        q = self._queues.setdefault(key, queue.Queue())
        while (event := q.get()) is not None:
            yield event
        q.put(None)  # every other stream of this object ends too


def _claim(c: ClaimAllocation, pool: str) -> ResourceClaimObject:
    """A claim allocated `c.devices` of the pool, reserved for its pods."""
    results = tuple(AllocatedDevice(f"r{i}", "gpu.nvidia.com", pool, d) for i, d in enumerate(c.devices))
    users = tuple(PodReference(p.partition("/")[2], f"uid-{p}") for p in c.pods)
    return ResourceClaimObject(c.namespace, c.name, c.uid, True, results, (), users)
