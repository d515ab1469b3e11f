"""What the agent reads and asks of the Kubernetes API: plain frozen values, the errors, and the
`KubeClient` Protocol that `sharing.kube.client.ApiClient` implements (tests fake it in memory)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from sharing.errors import KubeError
from sharing.model import BoundPod


class GoneError(KubeError):
    """The watch's resource version is too old (HTTP 410): list again, then watch from there."""


class NotFoundError(KubeError):
    """HTTP 404."""


class ConflictError(KubeError):
    """HTTP 409: the object changed since it was read (or already exists)."""


class RefusedByBudgetError(KubeError):
    """HTTP 429 from the Eviction API: a PodDisruptionBudget does not allow it now."""


class ForbiddenError(KubeError):
    """HTTP 401 or 403: the API server does not let the agent do this (its ServiceAccount's RBAC or
    token). For a moment after an API server starts it is also what any request gets, before the
    server has loaded its authorization data (see `sharing.kube.watch`)."""


class UnreachableError(KubeError):
    """No answer from the API server (refused, reset, timed out, TLS cut off): it is down or restarting."""


class WatchBrokenError(UnreachableError):
    """A watch stream broke after it started: resume from the last resource version seen."""


@dataclass(frozen=True, slots=True)
class NodeObject:
    """What the agent reads of its Node."""

    name: str
    uid: str
    resource_version: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    unschedulable: bool = False
    allocatable: Mapping[str, str] = field(default_factory=dict)
    """`status.allocatable` as the API server has it (what the scheduler counts), quantities as written."""


@dataclass(frozen=True, slots=True)
class ConfigMapObject:
    """The ConfigMap of named configs; `data` is None when it does not exist."""

    namespace: str
    name: str
    resource_version: str
    data: Mapping[str, str] | None


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One entry of a ResourceClaim's `status.allocation.devices.results` (resource.k8s.io/v1)."""

    request: str
    """The claim's request it serves; `<request>/<subrequest>` for a prioritized list."""
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    """Set when the device is shared through consumable capacity (allowMultipleAllocations)."""


@dataclass(frozen=True, slots=True)
class AllocatedConfig:
    """One opaque entry of `status.allocation.devices.config`: parameters for one driver.

    `parameters` is the JSON object the claim or its DeviceClass carries, as the API server stored it.
    """

    source: str
    """FromClass or FromClaim."""
    requests: tuple[str, ...]
    """The requests it applies to; empty: all of them."""
    driver: str
    parameters: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PodReference:
    """A pod a ResourceClaim is reserved for (`status.reservedFor`)."""

    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class ResourceClaimObject:
    """What the DRA front-end reads of a ResourceClaim: who it is, and what the scheduler allocated.

    `allocated` is False when the claim has no `status.allocation` (then results and config are empty).
    """

    namespace: str
    name: str
    uid: str
    allocated: bool = False
    results: tuple[AllocatedDevice, ...] = ()
    config: tuple[AllocatedConfig, ...] = ()
    reserved_for: tuple[PodReference, ...] = ()


@dataclass(frozen=True, slots=True)
class Version:
    """A device attribute of type version (semver 2.0.0, as resource.k8s.io/v1 `DeviceAttribute.version`)."""

    text: str


AttributeValue = str | int | bool | Version
"""A device attribute: `string`, `int`, `bool` or `version` in resource.k8s.io/v1 `DeviceAttribute`."""


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """How one allocation of a shared device consumes a capacity (`CapacityRequestPolicy`, a
    `validRange`); quantities in the API server's canonical form."""

    default: str
    min: str
    max: str | None = None
    step: str | None = None


@dataclass(frozen=True, slots=True)
class Capacity:
    """A device capacity (`DeviceCapacity`): its value in canonical form, its request policy."""

    value: str
    policy: RequestPolicy | None = None


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """A driver-set device taint (`DeviceTaint`; its `timeAdded` is the API server's to set)."""

    key: str
    value: str
    effect: str
    """None, NoSchedule or NoExecute."""


@dataclass(frozen=True, slots=True)
class CounterSet:
    """A named set of counters (`spec.sharedCounters[]`, `consumesCounters[]`: KEP-4815 partitionable
    devices); each counter's value a quantity in canonical form, sorted by counter name."""

    name: str
    counters: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One device of a ResourceSlice (`spec.devices[]`); attributes and capacities sorted by name."""

    name: str
    attributes: tuple[tuple[str, AttributeValue], ...] = ()
    capacity: tuple[tuple[str, Capacity], ...] = ()
    taints: tuple[DeviceTaint, ...] = ()
    allow_multiple_allocations: bool = False
    consumes_counters: tuple[CounterSet, ...] = ()
    """What allocating the device takes from the pool's counter sets (`consumesCounters`)."""


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """The spec of one ResourceSlice of a node-local pool (`spec.nodeName` set)."""

    driver: str
    node: str
    pool: str
    generation: int
    slice_count: int
    devices: tuple[SliceDevice, ...]
    shared_counters: tuple[CounterSet, ...] = ()
    """The counter sets this slice declares (`sharedCounters`); since Kubernetes 1.35 a slice holds
    either devices or counter sets, never both (resource.k8s.io/v1 types.go, `ResourceSliceSpec`)."""


@dataclass(frozen=True, slots=True)
class ResourceSliceObject:
    """A ResourceSlice as the API server holds it."""

    name: str
    resource_version: str
    spec: SliceSpec
    owners: tuple[str, ...] = ()
    """UIDs of its controller owner references."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch: ADDED, MODIFIED or DELETED with the object after it, or BOOKMARK.

    A BOOKMARK carries no object, only a newer resource version to resume from.
    """

    kind: str
    object: NodeObject | ConfigMapObject | ResourceSliceObject | None
    resource_version: str = ""


class KubeClient(Protocol):
    """The Kubernetes API calls the agent makes."""

    requests: int
    """Requests sent so far (watch starts included), so idle traffic can be measured."""

    def get_node(self, name: str) -> NodeObject: ...

    def watch_node(self, name: str, resource_version: str, timeout_s: int) -> Iterator[WatchEvent]: ...

    def get_configmap(self, namespace: str, name: str) -> ConfigMapObject: ...

    def watch_configmap(
        self, namespace: str, name: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]: ...

    def patch_node_labels(
        self, name: str, patch: Mapping[str, str | None], annotations: Mapping[str, str | None] | None = None
    ) -> NodeObject: ...

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
        """An Event about the Node; `first`/`last`/`count`: when it happened (default now) and how often."""

    def set_unschedulable(self, name: str, unschedulable: bool) -> NodeObject: ...

    def evict(self, namespace: str, pod: str) -> bool: ...

    def list_node_pods(self, node: str) -> tuple[BoundPod, ...]:
        """The pods bound to this node that have not ended (spec.nodeName), with what they ask for and
        the claims they name."""
        ...

    def list_nominated_pods(self, node: str) -> tuple[BoundPod, ...]:
        """The pods the scheduler is binding to this node and has not bound yet
        (`status.nominatedNodeName`), with what they ask for and the claims they name."""
        ...

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject:
        """Read a ResourceClaim (resource.k8s.io/v1); NotFoundError when there is none."""
        ...

    def list_resource_slices(self, driver: str, node: str) -> tuple[ResourceSliceObject, ...]:
        """The ResourceSlices of `driver` on `node` (field selectors spec.driver and spec.nodeName)."""
        ...

    def create_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        """Create a ResourceSlice (generateName `<driver>-<node>-`, owned by the Node as controller)."""
        ...

    def dry_run_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        """Create a ResourceSlice with `dryRun=All`: validated and admitted, never stored; the answer
        is the slice as the API server would store it (`sharing.kube.features`)."""
        ...

    def update_resource_slice(
        self, name: str, resource_version: str, spec: SliceSpec, owner: NodeObject
    ) -> ResourceSliceObject:
        """Replace a ResourceSlice's spec (optimistic: fails on a changed resource version)."""
        ...

    def delete_resource_slice(self, name: str) -> None:
        """Delete a ResourceSlice; one already gone is no error."""
        ...

    def watch_resource_slices(
        self, driver: str, node: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        """Changes of the ResourceSlices of `driver` on `node` after `resource_version` (or from now)."""
        ...
