"""What the agent reads and asks of the Kubernetes API: plain frozen values, the errors, and the
`KubeClient` Protocol that `sharing.kube.client.ApiClient` implements (tests fake it in memory)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sharing.errors import KubeError
from sharing.model import BoundPod, ClaimAllocation


class GoneError(KubeError):
    """The watch's resource version is too old (HTTP 410): list again, then watch from there."""


class NotFoundError(KubeError):
    """HTTP 404."""


class RefusedByBudgetError(KubeError):
    """HTTP 429 from the Eviction API: a PodDisruptionBudget does not allow it now."""


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


@dataclass(frozen=True, slots=True)
class ConfigMapObject:
    """The ConfigMap of named configs; `data` is None when it does not exist."""

    namespace: str
    name: str
    resource_version: str
    data: Mapping[str, str] | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch: ADDED, MODIFIED or DELETED with the object after it, or BOOKMARK.

    A BOOKMARK carries no object, only a newer resource version to resume from.
    """

    kind: str
    object: NodeObject | ConfigMapObject | None
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

    def create_node_event(self, node: NodeObject, kind: str, reason: str, message: str) -> None: ...

    def set_unschedulable(self, name: str, unschedulable: bool) -> NodeObject: ...

    def evict(self, namespace: str, pod: str) -> bool: ...

    def list_node_pods(self, node: str) -> tuple[BoundPod, ...]:
        """The pods bound to this node that have not ended (spec.nodeName), with what they ask for."""
        ...

    def list_pool_claims(self, driver: str, pool: str) -> tuple[ClaimAllocation, ...]:
        """The ResourceClaims that have devices of this driver's pool allocated."""
        ...
