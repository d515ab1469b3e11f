"""The Kubernetes API, behind one small Protocol: the agent's one door to the API server.

The agent needs little: its own Node (labels, watched), one ConfigMap (watched), label patches and
Events on the Node. The calls block, so callers run these methods in threads (`sharing.watch`
does); objects come back as plain frozen values, never client models. They go over
`sharing.kubehttp` (the standard library), or over the official client's transport for a
kubeconfig only that client understands (exec plugins and the like), imported only then.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import quote, urlencode

from sharing import __version__, kubehttp, kubelib
from sharing.errors import KubeError
from sharing.model import BoundPod
from sharing.text import bounded


class GoneError(KubeError):
    """The watch's resource version is too old (HTTP 410): list again, then watch from there."""


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

    def list_node_pods(self, node: str) -> tuple[BoundPod, ...]: ...


class ApiClient:
    """KubeClient from a kubeconfig file or in-cluster; the JSON is read into frozen values directly
    (no generated API classes or models)."""

    def __init__(self, kubeconfig: str | None = None, *, request_timeout_s: float = 10.0) -> None:
        agent = f"gpu-sharing/{__version__}"
        try:
            try:
                credentials = kubehttp.from_kubeconfig(kubeconfig) if kubeconfig else kubehttp.in_cluster()
                self._http: kubehttp.Http | kubelib.Library = kubehttp.Http(credentials, agent)
            except kubehttp.Unsupported:
                self._http = kubelib.Library(kubeconfig)
        except Exception as err:
            where = kubeconfig or "the in-cluster service account"
            raise KubeError(f"cannot load Kubernetes credentials from {where}: {err}") from err
        self._timeout = request_timeout_s
        self._names = itertools.count()
        self.requests = 0

    def close(self) -> None:
        """Close the kept-alive connection (watches close their own when they end)."""
        self._http.close()

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
        return _node(
            self._json(
                f"patch labels of node {name}", "PATCH", f"/api/v1/nodes/{quote(name)}", body=body,
                content_type="application/merge-patch+json",
            )
        )  # fmt: skip

    def create_node_event(self, node: NodeObject, kind: str, reason: str, message: str) -> None:
        """Record an Event about the Node (in `default`, where the kubelet puts node events)."""
        now = datetime.now(UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{node.name}.{int(now.timestamp() * 1e6):x}{next(self._names)}"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid},
            "reason": reason,
            "message": bounded(message, 1000),
            "type": kind,
            "source": {"component": "gpu-sharing", "host": node.name},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        self._json(f"create event {reason}", "POST", "/api/v1/namespaces/default/events", body=event)

    def set_unschedulable(self, name: str, unschedulable: bool) -> NodeObject:
        """Cordon (True) or uncordon (False) the Node, as `kubectl cordon` does (drain mode only)."""
        body = {"spec": {"unschedulable": unschedulable or None}}
        path = f"/api/v1/nodes/{quote(name)}"
        what = f"{'cordon' if unschedulable else 'uncordon'} node {name}"
        return _node(self._json(what, "PATCH", path, body=body, content_type="application/merge-patch+json"))

    def evict(self, namespace: str, pod: str) -> bool:
        """Ask the Eviction API to evict a pod; False when a PodDisruptionBudget refuses it (HTTP 429)."""
        path = f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(pod)}/eviction"
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace},
        }
        try:
            self._json(f"evict pod {namespace}/{pod}", "POST", path, body=body)
        except NotFoundError:
            return True  # already gone
        except RefusedByBudgetError:
            return False
        return True

    def list_node_pods(self, node: str) -> tuple[BoundPod, ...]:
        """The pods bound to this node that have not ended (the kubelet's own view comes from the same
        selector: pkg/kubelet/config/apiserver.go, `NewSourceApiserver`, spec.nodeName)."""
        selector = f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
        path = f"/api/v1/pods?{urlencode({'fieldSelector': selector})}"
        answer = self._json(f"list pods on node {node}", "GET", path)
        return tuple(_bound_pod(item) for item in answer.get("items") or ())

    def _json(
        self,
        what: str,
        method: str,
        path: str,
        *,
        body: object = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        self.requests += 1
        data = None if body is None else json.dumps(body).encode()
        try:
            status, reason, raw = self._http.request(method, path, data, content_type, self._timeout)
        except kubehttp.TransportError as err:  # refused, TLS, timeouts: the API server is unreachable
            raise KubeError(f"{what}: {bounded(str(err))}") from err
        if not 200 <= status < 300:
            raise _status_error(what, status, reason, raw)
        try:
            value: dict[str, Any] = json.loads(raw)
        except ValueError as err:
            raise KubeError(f"{what}: unreadable answer: {err}") from err
        return value

    def _watch(
        self, path: str, convert: Any, field_selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        query = [
            ("watch", "true"),
            ("fieldSelector", field_selector),
            ("timeoutSeconds", str(timeout_s)),
            ("allowWatchBookmarks", "true"),
        ]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        what = f"watch {field_selector}"
        self.requests += 1
        try:
            stream = self._http.watch(f"{path}?{urlencode(query)}", self._timeout, timeout_s + self._timeout)
        except kubehttp.TransportError as err:
            raise KubeError(f"{what}: {bounded(str(err))}") from err
        try:
            if not 200 <= stream.status < 300:
                raise _status_error(what, stream.status, stream.reason, stream.body())
            for line in stream.lines():
                raw = json.loads(line)
                kind = raw.get("type")
                obj = raw.get("object") or {}
                if kind == "ERROR":
                    message = bounded(str(obj.get("message", obj)))
                    if obj.get("code") == 410:
                        raise GoneError(f"watch expired: {message}")
                    raise KubeError(f"{what} failed: {message}")
                if kind == "BOOKMARK":
                    yield WatchEvent(kind, None, obj.get("metadata", {}).get("resourceVersion", ""))
                elif kind in ("ADDED", "MODIFIED", "DELETED"):
                    converted = convert(obj)
                    yield WatchEvent(kind, converted, converted.resource_version)
        except KubeError:
            raise
        except Exception as err:  # the connection broke, or a torn line
            raise WatchBrokenError(f"{what}: {type(err).__name__}: {bounded(str(err))}") from err
        finally:
            stream.close()


class NotFoundError(KubeError):
    """HTTP 404."""


class RefusedByBudgetError(KubeError):
    """HTTP 429 from the Eviction API: a PodDisruptionBudget does not allow it now."""


class WatchBrokenError(KubeError):
    """A watch stream broke after it started: resume from the last resource version seen."""


def _status_error(what: str, status: int, reason: str, body: Any) -> KubeError:
    try:
        message = json.loads(body or b"{}").get("message", "")
    except (ValueError, TypeError, AttributeError):
        message = ""
    text = f"{what}: HTTP {status} {bounded(str(reason), 80)}" + (
        f": {bounded(str(message))}" if message else ""
    )
    if status == 429:
        return RefusedByBudgetError(text)
    if status == 410:
        return GoneError(text)
    if status == 404:
        return NotFoundError(text)
    if status in (401, 403):
        text += " (check the agent's ServiceAccount and RBAC in deploy/)"
    return KubeError(text)


def _node(obj: Mapping[str, Any]) -> NodeObject:
    meta = obj.get("metadata", {})
    return NodeObject(
        meta.get("name", ""),
        meta.get("uid", ""),
        meta.get("resourceVersion", ""),
        dict(meta.get("labels") or {}),
        dict(meta.get("annotations") or {}),
        bool((obj.get("spec") or {}).get("unschedulable")),
    )


def _bound_pod(obj: Mapping[str, Any]) -> BoundPod:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    containers = [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]
    resources = {
        name
        for c in containers
        for kind in ("requests", "limits")
        for name in ((c.get("resources") or {}).get(kind) or {})
    }
    return BoundPod(meta.get("namespace", ""), meta.get("name", ""), frozenset(resources))


def _configmap(obj: Mapping[str, Any]) -> ConfigMapObject:
    meta = obj.get("metadata", {})
    return ConfigMapObject(
        meta.get("namespace", ""),
        meta.get("name", ""),
        meta.get("resourceVersion", ""),
        dict(obj.get("data") or {}),
    )
