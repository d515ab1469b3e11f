"""The Kubernetes API over the official `kubernetes` client: the agent's one door to the API server.

The agent needs little: its own Node (labels, watched), one ConfigMap (watched), label patches and
Events on the Node. The client loads the credentials (a kubeconfig with its contexts, exec plugins,
auth providers, proxies and TLS server names, or the pod's ServiceAccount, whose rotated token it
reads again) and keeps the connections (urllib3). The requests go through its raw `call_api` and the
JSON is read into frozen values directly: no generated models. The calls block, so callers run them
in threads (`sharing.kube.watch` does). `kubernetes` is imported only when a client is made, so
`sharing plan` and `sharing validate` never load it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from sharing import __version__
from sharing.errors import KubeError
from sharing.kube.api import (
    AllocatedConfig,
    AllocatedDevice,
    AttributeValue,
    Capacity,
    ConfigMapObject,
    ConflictError,
    CounterSet,
    DeviceTaint,
    ForbiddenError,
    GoneError,
    NodeObject,
    NotFoundError,
    PendingClaim,
    PodReference,
    PoolClaim,
    PoolClaims,
    RefusedByBudgetError,
    RequestPolicy,
    ResourceClaimObject,
    ResourceSliceObject,
    SliceDevice,
    SliceSpec,
    UnreachableError,
    Version,
    WatchBrokenError,
    WatchEvent,
)
from sharing.model import BoundPod, ClaimAllocation
from sharing.text import bounded

MERGE_PATCH = "application/merge-patch+json"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"


class ApiClient:
    """KubeClient from a kubeconfig file or in-cluster."""

    def __init__(self, kubeconfig: str | None = None, *, request_timeout_s: float = 10.0) -> None:
        try:
            self._api = _official_client(kubeconfig)
        except Exception as err:
            where = kubeconfig or "the in-cluster service account"
            raise KubeError(f"cannot load Kubernetes credentials from {where}: {err}") from err
        self._timeout = request_timeout_s
        self._names = itertools.count()
        self.requests = 0

    def close(self) -> None:
        """Close the kept-alive connections (watches close their own when they end)."""
        self._api.close()

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

    def list_claims_of_pool(self, driver: str, pool: str) -> PoolClaims:
        """Every ResourceClaim (every namespace, one list: no field selector reaches into a claim's
        status) as `driver`'s pool `pool` sees it, with the list's resource version to watch from."""
        answer = self._json(f"list ResourceClaims for pool {pool}", "GET", CLAIMS)
        claims = (_pool_claim(item, driver, pool) for item in answer.get("items") or ())
        version = str((answer.get("metadata") or {}).get("resourceVersion", ""))
        return PoolClaims({(c.namespace, c.name): c for c in claims}, version)

    def watch_claims_of_pool(
        self, driver: str, pool: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        """Changes of every ResourceClaim, each as `driver`'s pool `pool` sees it."""
        return self._watch(
            CLAIMS, lambda obj: _pool_claim(obj, driver, pool), "", resource_version, timeout_s
        )

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject:
        """Read a ResourceClaim (resource.k8s.io/v1, served by default since 1.34); NotFoundError when
        there is none, KubeError when what comes back is not a claim."""
        what = f"read resourceclaim {namespace}/{name}"
        path = f"/apis/resource.k8s.io/v1/namespaces/{quote(namespace)}/resourceclaims/{quote(name)}"
        obj = self._json(what, "GET", path)
        try:
            return _resource_claim(obj)
        except (TypeError, ValueError, AttributeError, KeyError) as err:
            raise KubeError(f"{what}: not a ResourceClaim as resource.k8s.io/v1 writes it ({err})") from err

    def list_resource_slices(self, driver: str, node: str) -> tuple[ResourceSliceObject, ...]:
        """The ResourceSlices of `driver` on `node`."""
        selector = f"spec.driver={driver},spec.nodeName={node}"
        answer = self._json(
            f"list resourceslices of {driver} on node {node}",
            "GET",
            SLICES,
            query=[("fieldSelector", selector)],
        )
        return tuple(resource_slice(item) for item in answer.get("items") or ())

    def create_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        """Create a ResourceSlice named `<driver>-<node>-<random>`, owned by the Node."""
        body = slice_body(spec, owner)
        body["metadata"]["generateName"] = f"{spec.driver}-{spec.node}-"
        what = f"create a resourceslice of {spec.driver} on node {spec.node}"
        return resource_slice(self._json(what, "POST", SLICES, body))

    def update_resource_slice(
        self, name: str, resource_version: str, spec: SliceSpec, owner: NodeObject
    ) -> ResourceSliceObject:
        """Replace the ResourceSlice `name` (HTTP 409 when it changed since `resource_version`)."""
        body = slice_body(spec, owner)
        body["metadata"] |= {"name": name, "resourceVersion": resource_version}
        return resource_slice(
            self._json(f"update resourceslice {name}", "PUT", f"{SLICES}/{quote(name)}", body)
        )

    def delete_resource_slice(self, name: str) -> None:
        """Delete the ResourceSlice `name`; gone already is fine."""
        with contextlib.suppress(NotFoundError):
            self._json(f"delete resourceslice {name}", "DELETE", f"{SLICES}/{quote(name)}")

    def watch_resource_slices(
        self, driver: str, node: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        """Changes of the ResourceSlices of `driver` on `node`."""
        selector = f"spec.driver={driver},spec.nodeName={node}"
        return self._watch(SLICES, resource_slice, selector, resource_version, timeout_s)

    def _call(
        self,
        what: str,
        method: str,
        path: str,
        *,
        body: object,
        content_type: str,
        timeout: float | tuple[float, float],
        query: list[tuple[str, str]] | None = None,
    ) -> Any:
        """The client's raw request (its urllib3 response, body not read yet); KubeError if unreachable."""
        self.requests += 1
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            request = self._api.param_serialize(
                method,
                path,
                query_params=query,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(*request, _request_timeout=timeout)
        except Exception as err:  # refused, TLS, timeouts (after the retry): the API server is unreachable
            raise UnreachableError(f"{what}: {type(err).__name__}: {bounded(str(err))}") from err
        return response.response

    def _json(
        self,
        what: str,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
        *,
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any]:
        response = self._call(
            what, method, path, body=body, content_type=content_type, timeout=self._timeout, query=query
        )
        try:
            raw = response.data
        except Exception as err:  # the connection broke while the answer came
            raise UnreachableError(f"{what}: {type(err).__name__}: {bounded(str(err))}") from err
        if not 200 <= response.status < 300:
            raise _status_error(what, response.status, response.reason, raw)
        try:
            value: dict[str, Any] = json.loads(raw)
        except ValueError as err:
            raise KubeError(f"{what}: unreadable answer: {err}") from err
        return value

    def _watch(
        self, path: str, convert: Any, field_selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        query = [("watch", "true"), ("timeoutSeconds", str(timeout_s)), ("allowWatchBookmarks", "true")]
        if field_selector:
            query.append(("fieldSelector", field_selector))
        if resource_version:
            query.append(("resourceVersion", resource_version))
        what = f"watch {field_selector or path}"
        timeouts = (self._timeout, timeout_s + self._timeout)
        response = self._call(
            what, "GET", path, body=None, content_type="application/json", timeout=timeouts, query=query
        )
        try:
            if not 200 <= response.status < 300:
                raise _status_error(what, response.status, response.reason, response.data)
            for line in response:  # urllib3 yields the stream line by line: one JSON object each
                if not line.strip():
                    continue
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
            response.release_conn()


def _official_client(kubeconfig: str | None) -> Any:
    """The official client's ApiClient, from a kubeconfig or the pod's ServiceAccount."""
    from kubernetes import client, config  # noqa: PLC0415 - ~17 MB: only the agent pays for it
    from urllib3.util.retry import Retry  # noqa: PLC0415

    configuration = client.Configuration()
    if kubeconfig and not os.path.isfile(kubeconfig):
        raise ValueError("no such file")  # the client would say "No configuration found"
    if kubeconfig:
        config.load_kube_config(
            config_file=kubeconfig, client_configuration=configuration, persist_config=False
        )
    else:
        config.load_incluster_config(client_configuration=configuration)  # refreshes the rotated token
    # A kept-alive connection the API server dropped (it restarted) fails the next request
    # (SSLEOFError, connection reset): send it once more on a new connection, whatever the method.
    # Every write the agent makes may be repeated (merge patches; a second Event or eviction is harmless).
    configuration.retries = Retry(total=1, status=0, redirect=0, allowed_methods=None, raise_on_status=False)
    api = client.ApiClient(configuration)
    api.user_agent = f"gpu-sharing/{__version__}"
    return api


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
    if status == 409:
        return ConflictError(text)
    if status in (401, 403):
        return ForbiddenError(text + " (check the agent's ServiceAccount and RBAC in deploy/)")
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


def _claim_allocation(obj: Mapping[str, Any], driver: str, pool: str) -> ClaimAllocation | None:
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or ()
    devices = tuple(
        str(r.get("device", ""))
        for r in results
        if r.get("driver") == driver and r.get("pool") == pool and r.get("device")
    )
    if not devices:
        return None
    namespace = meta.get("namespace", "")
    pods = tuple(
        f"{namespace}/{r.get('name', '')}"
        for r in status.get("reservedFor") or ()
        if r.get("resource") == "pods"
    )
    return ClaimAllocation(namespace, meta.get("name", ""), meta.get("uid", ""), devices, pods)


def _pool_claim(obj: Mapping[str, Any], driver: str, pool: str) -> PoolClaim:
    meta = obj.get("metadata") or {}
    return PoolClaim(
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        str(meta.get("resourceVersion", "")),
        _claim_allocation(obj, driver, pool),
        _pending_claim(obj),
    )


def _pending_claim(obj: Mapping[str, Any]) -> PendingClaim | None:
    """A claim without `status.allocation`, with the classes its requests name (field names:
    https://github.com/kubernetes/api/blob/v0.36.0/resource/v1/types.go `DeviceRequest`)."""
    if (obj.get("status") or {}).get("allocation") is not None:
        return None
    meta = obj.get("metadata") or {}
    classes: list[str] = []
    for request in ((obj.get("spec") or {}).get("devices") or {}).get("requests") or ():
        exactly = request.get("exactly") or {}
        for sub in (exactly, *(request.get("firstAvailable") or ())):
            name = sub.get("deviceClassName")
            if isinstance(name, str) and name:
                classes.append(name)
    return PendingClaim(str(meta.get("namespace", "")), str(meta.get("name", "")), tuple(classes))


def _configmap(obj: Mapping[str, Any]) -> ConfigMapObject:
    meta = obj.get("metadata", {})
    return ConfigMapObject(
        meta.get("namespace", ""),
        meta.get("name", ""),
        meta.get("resourceVersion", ""),
        dict(obj.get("data") or {}),
    )


def _resource_claim(obj: Mapping[str, Any]) -> ResourceClaimObject:
    """The claim's identity, allocation (results and opaque config) and the pods it is reserved for
    (field names: https://github.com/kubernetes/api/blob/v0.36.0/resource/v1/types.go)."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    allocation = status.get("allocation")
    devices = (allocation or {}).get("devices") or {}
    results = tuple(
        AllocatedDevice(
            request=_text(r, "request"),
            driver=_text(r, "driver"),
            pool=_text(r, "pool"),
            device=_text(r, "device"),
            admin_access=bool(r.get("adminAccess")),
            share_id=r.get("shareID") or None,
        )
        for r in devices.get("results") or ()
    )
    config = tuple(
        AllocatedConfig(
            source=str(c.get("source", "")),
            requests=tuple(str(x) for x in c.get("requests") or ()),
            driver=_text(c["opaque"], "driver"),
            parameters=dict(c["opaque"].get("parameters") or {}),
        )
        for c in devices.get("config") or ()
        if c.get("opaque")
    )
    reserved = tuple(
        PodReference(str(r.get("name", "")), str(r.get("uid", "")))
        for r in status.get("reservedFor") or ()
        if r.get("resource") == "pods" and not r.get("apiGroup")
    )
    return ResourceClaimObject(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        allocated=allocation is not None,
        results=results,
        config=config,
        reserved_for=reserved,
    )


def _text(obj: Mapping[str, Any], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} is not a string")
    return value


def slice_body(spec: SliceSpec, owner: NodeObject) -> dict[str, Any]:
    """The JSON of a ResourceSlice (resource.k8s.io/v1) with `spec`, controlled by the Node `owner`."""
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": owner.name, "uid": owner.uid, "controller": True}
            ]
        },
        "spec": {
            "driver": spec.driver,
            "nodeName": spec.node,
            "pool": {
                "name": spec.pool,
                "generation": spec.generation,
                "resourceSliceCount": spec.slice_count,
            },
        },
    }
    if spec.shared_counters:  # a slice of counters has no devices (Kubernetes 1.35+)
        body["spec"]["sharedCounters"] = [_counter_set_body(c) for c in spec.shared_counters]
    else:
        body["spec"]["devices"] = [_device_body(d) for d in spec.devices]
    return body


def _counter_set_body(counters: CounterSet) -> dict[str, Any]:
    return {"name": counters.name, "counters": {name: {"value": value} for name, value in counters.counters}}


def _device_body(device: SliceDevice) -> dict[str, Any]:
    body: dict[str, Any] = {"name": device.name}
    if device.attributes:
        body["attributes"] = {name: _attribute_body(value) for name, value in device.attributes}
    if device.capacity:
        body["capacity"] = {name: _capacity_body(c) for name, c in device.capacity}
    if device.taints:
        body["taints"] = [
            {"key": t.key, "effect": t.effect} | ({"value": t.value} if t.value else {})
            for t in device.taints
        ]
    if device.allow_multiple_allocations:
        body["allowMultipleAllocations"] = True
    if device.consumes_counters:
        body["consumesCounters"] = [
            {"counterSet": c.name, "counters": {name: {"value": value} for name, value in c.counters}}
            for c in device.consumes_counters
        ]
    return body


def _attribute_body(value: AttributeValue) -> dict[str, Any]:
    if isinstance(value, Version):
        return {"version": value.text}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def _capacity_body(capacity: Capacity) -> dict[str, Any]:
    body: dict[str, Any] = {"value": capacity.value}
    if capacity.policy is not None:
        p = capacity.policy
        valid = {"min": p.min} | ({"max": p.max} if p.max else {}) | ({"step": p.step} if p.step else {})
        body["requestPolicy"] = {"default": p.default, "validRange": valid}
    return body


def resource_slice(obj: Mapping[str, Any]) -> ResourceSliceObject:
    """A ResourceSlice read back into values; what the values cannot hold is left out (and so shows
    as a difference from what was written)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    pool = spec.get("pool") or {}
    return ResourceSliceObject(
        name=meta.get("name", ""),
        resource_version=meta.get("resourceVersion", ""),
        spec=SliceSpec(
            driver=spec.get("driver", ""),
            node=spec.get("nodeName") or "",
            pool=pool.get("name", ""),
            generation=int(pool.get("generation") or 0),
            slice_count=int(pool.get("resourceSliceCount") or 0),
            devices=tuple(_device(d) for d in spec.get("devices") or ()),
            shared_counters=tuple(
                _counter_set(c.get("name", ""), c) for c in spec.get("sharedCounters") or ()
            ),
        ),
        owners=tuple(o.get("uid", "") for o in meta.get("ownerReferences") or () if o.get("controller")),
    )


def _device(obj: Mapping[str, Any]) -> SliceDevice:
    return SliceDevice(
        name=obj.get("name", ""),
        attributes=tuple(sorted((k, _attribute(v)) for k, v in (obj.get("attributes") or {}).items())),
        capacity=tuple(sorted((k, _capacity(v)) for k, v in (obj.get("capacity") or {}).items())),
        taints=tuple(
            DeviceTaint(t.get("key", ""), t.get("value", ""), t.get("effect", ""))
            for t in obj.get("taints") or ()
        ),
        allow_multiple_allocations=bool(obj.get("allowMultipleAllocations")),
        consumes_counters=tuple(
            _counter_set(c.get("counterSet", ""), c) for c in obj.get("consumesCounters") or ()
        ),
    )


def _counter_set(name: str, obj: Mapping[str, Any]) -> CounterSet:
    counters = obj.get("counters") or {}
    return CounterSet(
        str(name), tuple(sorted((k, str((v or {}).get("value", ""))) for k, v in counters.items()))
    )


def _attribute(obj: Mapping[str, Any]) -> AttributeValue:
    if "version" in obj:
        return Version(str(obj["version"]))
    if "bool" in obj:
        return bool(obj["bool"])
    if "int" in obj:
        return int(obj["int"])
    return str(obj.get("string", ""))


def _capacity(obj: Mapping[str, Any]) -> Capacity:
    policy = obj.get("requestPolicy")
    if not policy:
        return Capacity(str(obj.get("value", "")))
    valid = policy.get("validRange") or {}
    return Capacity(
        str(obj.get("value", "")),
        RequestPolicy(
            str(policy.get("default", "")), str(valid.get("min", "")), valid.get("max"), valid.get("step")
        ),
    )
