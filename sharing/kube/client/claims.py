"""The ResourceClaims (resource.k8s.io/v1) the DRA front-end reads, one at a time by name: the claim a
prepare is for, and the claims the node's pods name (`sharing.kube.podclaims`). It never lists or
watches them: that would be every claim of the cluster, for every node."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from sharing.errors import KubeError
from sharing.kube.api import AllocatedConfig, AllocatedDevice, PodReference, ResourceClaimObject
from sharing.kube.client.transport import Transport


class ClaimCalls(Transport):
    """ResourceClaims: read one."""

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
