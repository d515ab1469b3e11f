"""The ResourceClaims (resource.k8s.io/v1) the DRA front-end reads: one claim for prepare, and every
claim as the node's pool sees it (what holds its devices, what waits to be allocated), listed and
watched."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote

from sharing.errors import KubeError
from sharing.kube.api import (
    AllocatedConfig,
    AllocatedDevice,
    PendingClaim,
    PodReference,
    PoolClaim,
    PoolClaims,
    ResourceClaimObject,
    WatchEvent,
)
from sharing.kube.client.transport import Transport
from sharing.model import ClaimAllocation

CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"


class ClaimCalls(Transport):
    """ResourceClaims: read one, list and watch them all as a pool sees them."""

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
