"""The node's ResourceSlices (resource.k8s.io/v1): list, create, replace, delete and watch them, and
their JSON written from and read back into the values of `sharing.kube.api`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote

from sharing.kube.api import (
    AttributeValue,
    Capacity,
    CounterSet,
    DeviceTaint,
    NodeObject,
    NotFoundError,
    RequestPolicy,
    ResourceSliceObject,
    SliceDevice,
    SliceSpec,
    Version,
    WatchEvent,
)
from sharing.kube.client.transport import Transport

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


class SliceCalls(Transport):
    """ResourceSlices of one driver on one node."""

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

    def dry_run_resource_slice(self, spec: SliceSpec, owner: NodeObject) -> ResourceSliceObject:
        """Create a ResourceSlice with `dryRun=All` (never stored): as the API server would store it."""
        body = slice_body(spec, owner)
        body["metadata"]["generateName"] = f"{spec.driver}-{spec.node}-"
        what = f"create a resourceslice of {spec.driver} on node {spec.node} (dry run)"
        return resource_slice(self._json(what, "POST", SLICES, body, query=[("dryRun", "All")]))

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
