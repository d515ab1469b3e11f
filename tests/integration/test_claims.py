"""ResourceClaims as holders, read from a real kube-apiserver: what the scheduler allocated from our
pool counts, whatever namespace, prepared or not; other drivers' and other nodes' pools do not. The
watched view (on-demand pools) follows allocations and deletions as they happen."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

import lab
import pytest
from lab.deadlines import scaled

from sharing.kube import ApiClient, watch_pool_claims
from sharing.kube.api import PendingClaim, PoolClaims
from sharing.model import ClaimAllocation

pytestmark = pytest.mark.integration

DRIVER = "gpu.nvidia.com"
SPEC = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}


def claim(cp: lab.ControlPlane, ns: str, name: str, results: list[dict[str, str]], pods: list[str]) -> str:
    """A claim with an allocation written into its status as the scheduler writes it; its UID."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}
        },
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(body), check=True)
    uid = cp.kubectl("-n", ns, "get", "resourceclaim", name, "-o", "jsonpath={.metadata.uid}", check=True)
    reserved = [{"resource": "pods", "name": p, "uid": str(uuid.uuid4())} for p in pods]
    status = {
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gpu", **r} for r in results]},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
                    ]
                },
            },
            "reservedFor": reserved,
        }
    }
    cp.kubectl(
        "-n", ns, "patch", "resourceclaim", name, "--subresource=status", "--type=merge",
        "-p", json.dumps(status), check=True,
    )  # fmt: skip
    return uid.stdout.strip()


def test_the_claims_allocated_from_our_pool_are_listed_with_their_devices_and_pods(
    control_plane: lab.ControlPlane,
) -> None:
    ns = f"claims-{uuid.uuid4().hex[:6]}"
    pool = f"node-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    ours = {"driver": DRIVER, "pool": pool}
    uid = claim(
        control_plane, ns, "two", [{**ours, "device": "gpu-0-mig-1"}, {**ours, "device": "gpu-1"}], ["p"]
    )
    waiting = claim(control_plane, ns, "waiting", [{**ours, "device": "gpu-2"}], [])
    claim(control_plane, ns, "other-node", [{"driver": DRIVER, "pool": "elsewhere", "device": "gpu-0"}], [])
    claim(control_plane, ns, "other-driver", [{"driver": "example.com", "pool": pool, "device": "gpu-0"}], [])
    unallocated = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "pending", "namespace": ns},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}
        },
    }
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(unallocated), check=True)
    got = ApiClient(str(control_plane.kubeconfig)).list_claims_of_pool(DRIVER, pool).allocated
    assert [
        ClaimAllocation(ns, "two", uid, ("gpu-0-mig-1", "gpu-1"), (f"{ns}/p",)),
        ClaimAllocation(ns, "waiting", waiting, ("gpu-2",), ()),
    ] == sorted(got, key=lambda c: c.name)


def test_one_read_gives_the_pools_claims_and_the_pending_ones_with_their_classes(
    control_plane: lab.ControlPlane,
) -> None:
    ns = f"claims-{uuid.uuid4().hex[:6]}"
    pool = f"node-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    uid = claim(
        control_plane, ns, "small", [{"driver": DRIVER, "pool": pool, "device": "gpu-0-mig-1g-5gb-at-0"}], []
    )
    pending = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "big", "namespace": ns},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "mig", "exactly": {"deviceClassName": "mig-3g.20gb.nvidia.com"}},
                    {
                        "name": "either",
                        "firstAvailable": [
                            {"name": "large", "deviceClassName": "mig-7g.40gb.nvidia.com"},
                            {"name": "any", "deviceClassName": "mig.nvidia.com"},
                        ],
                    },
                ]
            }
        },
    }
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(pending), check=True)
    allocated, waiting = ApiClient(str(control_plane.kubeconfig)).list_claims_of_pool(DRIVER, pool).seen()
    assert (ClaimAllocation(ns, "small", uid, ("gpu-0-mig-1g-5gb-at-0",), ()),) == tuple(
        c for c in allocated if c.namespace == ns
    )
    assert (
        PendingClaim(ns, "big", ("mig-3g.20gb.nvidia.com", "mig-7g.40gb.nvidia.com", "mig.nvidia.com")),
    ) == tuple(c for c in waiting if c.namespace == ns)


async def test_the_watched_view_follows_an_allocation_and_a_deletion(control_plane: lab.ControlPlane) -> None:
    ns = f"claims-{uuid.uuid4().hex[:6]}"
    pool = f"node-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", ns, check=True)
    watched = watch_pool_claims(ApiClient(str(control_plane.kubeconfig)), DRIVER, pool, timeout_s=60)
    changed = asyncio.Event()
    watched.start(changed.set)

    async def until(what: str, ok: Callable[[PoolClaims], bool]) -> PoolClaims:
        async def seen() -> PoolClaims:
            while True:
                changed.clear()
                if watched.current is not None and ok(watched.current):
                    return watched.current
                await changed.wait()

        try:
            return await asyncio.wait_for(seen(), scaled(30))
        except TimeoutError:
            raise AssertionError(f"{what} not seen within 30 s; last: {watched.current}") from None

    def ours(view: PoolClaims) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple((c.name, c.devices) for c in view.allocated if c.namespace == ns)

    try:
        await until("the first list", lambda view: True)
        device = {"driver": DRIVER, "pool": pool, "device": "gpu-0-mig-3g-20gb-at-4"}
        await asyncio.to_thread(claim, control_plane, ns, "trainer", [device], [])
        await until("the allocation", lambda view: ours(view) == (("trainer", ("gpu-0-mig-3g-20gb-at-4",)),))
        await asyncio.to_thread(
            control_plane.kubectl, "-n", ns, "delete", "resourceclaim", "trainer", check=True
        )
        await until("the deletion", lambda view: ours(view) == ())
    finally:
        watched.stop()
