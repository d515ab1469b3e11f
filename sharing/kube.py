"""The Kubernetes API, behind one small Protocol: the only module that imports `kubernetes`.

The agent needs little: its own Node (labels, watched), one ConfigMap (watched), label patches and
Events on the Node. The official client is blocking, so callers run these methods in threads
(`sharing.watch` does); objects come back as plain frozen values, never client models.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from sharing.errors import KubeError


class GoneError(KubeError):
    """The watch's resource version is too old (HTTP 410): list again, then watch from there."""


@dataclass(frozen=True, slots=True)
class NodeObject:
    """What the agent reads of its Node."""

    name: str
    uid: str
    resource_version: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ConfigMapObject:
    """The ConfigMap of named configs; `data` is None when it does not exist."""

    namespace: str
    name: str
    resource_version: str
    data: Mapping[str, str] | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch: ADDED, MODIFIED or DELETED, with the object after it."""

    kind: str
    object: NodeObject | ConfigMapObject


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

    def patch_node_labels(self, name: str, patch: Mapping[str, str | None]) -> NodeObject: ...

    def create_node_event(self, node: NodeObject, kind: str, reason: str, message: str) -> None: ...


class ApiClient:
    """KubeClient over the official `kubernetes` client, from a kubeconfig file or in-cluster."""

    def __init__(self, kubeconfig: str | None = None, *, request_timeout_s: float = 10.0) -> None:
        try:
            if kubeconfig:
                api_client = config.new_client_from_config(config_file=kubeconfig)
            else:
                config.load_incluster_config()
                api_client = client.ApiClient()
        except Exception as err:
            where = kubeconfig or "the in-cluster service account"
            raise KubeError(f"cannot load Kubernetes credentials from {where}: {err}") from err
        self._core = client.CoreV1Api(api_client)
        self._timeout = request_timeout_s
        self._names = itertools.count()
        self.requests = 0

    def get_node(self, name: str) -> NodeObject:
        """Read the Node."""
        return _node(self._call("read node " + name, self._core.read_node, name))

    def watch_node(self, name: str, resource_version: str, timeout_s: int) -> Iterator[WatchEvent]:
        """Changes of the Node after `resource_version`, until the server ends the watch."""
        return self._watch(
            self._core.list_node,
            _node,
            field_selector=f"metadata.name={name}",
            resource_version=resource_version,
            timeout_s=timeout_s,
        )

    def get_configmap(self, namespace: str, name: str) -> ConfigMapObject:
        """Read the ConfigMap; a missing one comes back with data None (not an error)."""
        self.requests += 1
        try:
            found = self._core.read_namespaced_config_map(name, namespace, _request_timeout=self._timeout)
        except ApiException as err:
            if err.status == 404:
                return ConfigMapObject(namespace, name, "", None)
            raise _kube_error(f"read configmap {namespace}/{name}", err) from err
        except Exception as err:
            raise KubeError(f"read configmap {namespace}/{name}: {err}") from err
        return _configmap(found)

    def watch_configmap(
        self, namespace: str, name: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        """Changes of the ConfigMap after `resource_version` (or from now when it is empty)."""
        return self._watch(
            self._core.list_namespaced_config_map,
            _configmap,
            namespace,
            field_selector=f"metadata.name={name}",
            resource_version=resource_version,
            timeout_s=timeout_s,
        )

    def patch_node_labels(self, name: str, patch: Mapping[str, str | None]) -> NodeObject:
        """Merge-patch labels (None removes a label); returns the Node after the patch."""
        body = {"metadata": {"labels": dict(patch)}}
        return _node(self._call("patch labels of node " + name, self._core.patch_node, name, body))

    def create_node_event(self, node: NodeObject, kind: str, reason: str, message: str) -> None:
        """Record an Event about the Node (in `default`, where the kubelet puts node events)."""
        now = datetime.now(UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                name=f"{node.name}.{int(now.timestamp() * 1e6):x}{next(self._names)}"
            ),
            involved_object=client.V1ObjectReference(kind="Node", name=node.name, uid=node.uid),
            reason=reason,
            message=message[:1024],
            type=kind,
            source=client.V1EventSource(component="gpu-sharing", host=node.name),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        self._call("create event " + reason, self._core.create_namespaced_event, "default", event)

    def _call(self, what: str, method: Any, *args: Any) -> Any:
        self.requests += 1
        try:
            return method(*args, _request_timeout=self._timeout)
        except ApiException as err:
            raise _kube_error(what, err) from err
        except Exception as err:  # connection refused, TLS, timeouts: the API server is unreachable
            raise KubeError(f"{what}: {type(err).__name__}: {err}") from err

    def _watch(
        self,
        method: Any,
        convert: Any,
        *args: Any,
        field_selector: str,
        resource_version: str,
        timeout_s: int,
    ) -> Iterator[WatchEvent]:
        self.requests += 1
        stream = watch.Watch()
        try:
            for raw in stream.stream(
                method,
                *args,
                field_selector=field_selector,
                resource_version=resource_version or None,
                timeout_seconds=timeout_s,
                allow_watch_bookmarks=False,
                _request_timeout=(self._timeout, timeout_s + self._timeout),
            ):
                if raw["type"] == "ERROR":
                    status = raw["raw_object"]
                    if status.get("code") == 410:
                        raise GoneError(f"watch expired: {status.get('message', '')}")
                    raise KubeError(f"watch failed: {status.get('message', status)}")
                yield WatchEvent(raw["type"], convert(raw["object"]))
        except ApiException as err:
            raise _kube_error("watch " + field_selector, err) from err
        except KubeError:
            raise
        except Exception as err:
            raise KubeError(f"watch {field_selector}: {type(err).__name__}: {err}") from err
        finally:
            stream.stop()


def _kube_error(what: str, err: Any) -> KubeError:
    if err.status == 410:
        return GoneError(f"{what}: resource version too old")
    reason = f"HTTP {err.status} {err.reason}"
    if err.status in (401, 403):
        reason += " (check the agent's ServiceAccount and RBAC in deploy/)"
    return KubeError(f"{what}: {reason}")


def _node(obj: Any) -> NodeObject:
    meta = obj.metadata
    return NodeObject(meta.name, meta.uid or "", meta.resource_version or "", dict(meta.labels or {}))


def _configmap(obj: Any) -> ConfigMapObject:
    meta = obj.metadata
    return ConfigMapObject(meta.namespace, meta.name, meta.resource_version or "", dict(obj.data or {}))
