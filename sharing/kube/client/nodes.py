"""The calls of the core API group the agent makes about its own Node: read and watch it, patch its
labels, record Events about it, cordon it and evict its pods (drain mode), list the pods bound to it,
and read and watch the ConfigMaps of named configs."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from sharing.kube.api import (
    ConfigMapObject,
    NodeObject,
    NotFoundError,
    RefusedByBudgetError,
    WatchEvent,
)
from sharing.kube.client.transport import Transport
from sharing.model import BoundPod
from sharing.text import bounded

MERGE_PATCH = "application/merge-patch+json"


class NodeCalls(Transport):
    """Nodes, Events, pods and ConfigMaps (core/v1)."""

    def __init__(self, kubeconfig: str | None = None, *, request_timeout_s: float = 10.0) -> None:
        super().__init__(kubeconfig, request_timeout_s=request_timeout_s)
        self._names = itertools.count()

    def get_node(self, name: str) -> NodeObject:
        """Read the Node."""
        return _node(self._json(f"read node {name}", "GET", f"/api/v1/nodes/{quote(name)}"))

    def watch_node(self, name: str, resource_version: str, timeout_s: int) -> Iterator[WatchEvent]:
        """Changes of the Node after `resource_version`, until the server ends the watch."""
        return self._watch("/api/v1/nodes", _node, f"metadata.name={name}", resource_version, timeout_s)

    def get_configmap(self, namespace: str, name: str) -> ConfigMapObject:
        """Read the ConfigMap; a missing one comes back with data None (not an error)."""
        path = f"/api/v1/namespaces/{quote(namespace)}/configmaps/{quote(name)}"
        try:
            return _configmap(self._json(f"read configmap {namespace}/{name}", "GET", path))
        except NotFoundError:
            return ConfigMapObject(namespace, name, "", None)

    def watch_configmap(
        self, namespace: str, name: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        """Changes of the ConfigMap after `resource_version` (or from now when it is empty)."""
        path = f"/api/v1/namespaces/{quote(namespace)}/configmaps"
        return self._watch(path, _configmap, f"metadata.name={name}", resource_version, timeout_s)

    def patch_node_labels(
        self, name: str, patch: Mapping[str, str | None], annotations: Mapping[str, str | None] | None = None
    ) -> NodeObject:
        """Merge-patch labels (and annotations; None removes one); returns the Node after the patch."""
        body: dict[str, Any] = {"metadata": {"labels": dict(patch)}}
        if annotations:
            body["metadata"]["annotations"] = dict(annotations)
        path = f"/api/v1/nodes/{quote(name)}"
        return _node(self._json(f"patch labels of node {name}", "PATCH", path, body, MERGE_PATCH))

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
        """Record an Event about the Node (in `default`, where the kubelet puts node events)."""
        now = datetime.now(UTC)
        first_stamp = (first or now).strftime("%Y-%m-%dT%H:%M:%SZ")
        stamp = (last or first or now).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{node.name}.{int(now.timestamp() * 1e6):x}{next(self._names)}"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid},
            "reason": reason,
            "message": bounded(message, 1000),
            "type": kind,
            "source": {"component": "gpu-sharing", "host": node.name},
            "firstTimestamp": first_stamp,
            "lastTimestamp": stamp,
            "count": count,
        }
        self._json(f"create event {reason}", "POST", "/api/v1/namespaces/default/events", event)

    def set_unschedulable(self, name: str, unschedulable: bool) -> NodeObject:
        """Cordon (True) or uncordon (False) the Node, as `kubectl cordon` does (drain mode only)."""
        body = {"spec": {"unschedulable": unschedulable or None}}
        what = f"{'cordon' if unschedulable else 'uncordon'} node {name}"
        return _node(self._json(what, "PATCH", f"/api/v1/nodes/{quote(name)}", body, MERGE_PATCH))

    def evict(self, namespace: str, pod: str) -> bool:
        """Ask the Eviction API to evict a pod; False when a PodDisruptionBudget refuses it (HTTP 429)."""
        path = f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(pod)}/eviction"
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace},
        }
        try:
            self._json(f"evict pod {namespace}/{pod}", "POST", path, body)
        except NotFoundError:
            return True  # already gone
        except RefusedByBudgetError:
            return False
        return True

    def list_node_pods(self, node: str) -> tuple[BoundPod, ...]:
        """The pods bound to this node that have not ended (the kubelet's own view comes from the same
        selector: pkg/kubelet/config/apiserver.go, `NewSourceApiserver`, spec.nodeName)."""
        selector = f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
        answer = self._json(
            f"list pods on node {node}", "GET", "/api/v1/pods", query=[("fieldSelector", selector)]
        )
        return tuple(_bound_pod(item) for item in answer.get("items") or ())

    def list_nominated_pods(self, node: str) -> tuple[BoundPod, ...]:
        """The pods the scheduler is binding to this node and has not bound yet: it names the node in
        `status.nominatedNodeName` before its PreBind plugins run (where DRA writes the claims'
        allocations) and binds after them (k8s.io/kubernetes pkg/scheduler/schedule_one.go
        `bindingCycle`, gate NominatedNodeNameForExpectation, on by default from 1.35)."""
        selector = f"status.nominatedNodeName={node},status.phase!=Succeeded,status.phase!=Failed"
        answer = self._json(
            f"list pods nominated to node {node}", "GET", "/api/v1/pods", query=[("fieldSelector", selector)]
        )
        pods = (_bound_pod(item) for item in answer.get("items") or ())
        return tuple(p for p in pods if not p.bound)  # a bound one is in `list_node_pods`


def _node(obj: Mapping[str, Any]) -> NodeObject:
    meta = obj.get("metadata", {})
    return NodeObject(
        meta.get("name", ""),
        meta.get("uid", ""),
        meta.get("resourceVersion", ""),
        dict(meta.get("labels") or {}),
        dict(meta.get("annotations") or {}),
        bool((obj.get("spec") or {}).get("unschedulable")),
        {k: str(v) for k, v in ((obj.get("status") or {}).get("allocatable") or {}).items()},
    )


def _bound_pod(obj: Mapping[str, Any]) -> BoundPod:
    """A pod as the agent reads it: what it asks for and the ResourceClaims it names (field names:
    https://github.com/kubernetes/api/blob/v0.37.2/core/v1/types.go `PodResourceClaim`,
    `PodResourceClaimStatus`, `PodExtendedResourceClaimStatus`)."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    containers = [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]
    resources = {
        name
        for c in containers
        for kind in ("requests", "limits")
        for name in ((c.get("resources") or {}).get(kind) or {})
    }
    made = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or ()}
    claims = [c.get("resourceClaimName") or made.get(c.get("name")) for c in spec.get("resourceClaims") or ()]
    extended = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    names = tuple(sorted({n for n in (*claims, extended) if isinstance(n, str) and n}))
    started = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    ids = tuple(
        (str(c["containerID"]).rpartition("://")[2], str(c.get("name", "")))
        for c in started
        if c.get("containerID")
    )
    return BoundPod(
        meta.get("namespace", ""),
        meta.get("name", ""),
        frozenset(resources),
        names,
        bound=bool(spec.get("nodeName")),
        extended_claim=bool(extended),
        uid=meta.get("uid", ""),
        containers=ids,
    )


def _configmap(obj: Mapping[str, Any]) -> ConfigMapObject:
    meta = obj.get("metadata", {})
    return ConfigMapObject(
        meta.get("namespace", ""),
        meta.get("name", ""),
        meta.get("resourceVersion", ""),
        dict(obj.get("data") or {}),
    )
