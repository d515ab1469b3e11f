"""The published pool as the real kube-scheduler allocates it: classes, CEL on NVIDIA's attributes,
shares of a time-sliced GPU, failRequestsGreaterThanOne, and tainted devices.

A control plane of its own with kube-scheduler (its default profile has the DynamicResources plugin),
a Node object that looks Ready (no kubelet: pods are bound, never run), the chart's DeviceClasses, and
the pool published by the publisher. Claims are created directly and pods reference them; what the
tests read is what a user reads: a claim's `status.allocation` and a pending pod's scheduler reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import lab
import pytest
from lab.components import scheduler_args
from lab.process import Process

from sharing.config.spec import MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.devices import HealthState, build_inventory
from sharing.dra.names import DRIVER
from sharing.dra.slices import build_slices
from sharing.kube import ApiClient
from sharing.kube.resourceslices import SlicePublisher
from sharing.mig import default_catalog
from sharing.model import (
    ComputeInstance,
    DriverInfo,
    Gpu,
    GpuInstance,
    GpuUuid,
    HealthEvent,
    MigUuid,
    NodeState,
)
from tests.polling import poll

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpu-sharing"
CATALOG = default_catalog()
A = f"device.attributes['{DRIVER}']"
MIG_3G = "nvidia.com/mig-3g.20gb"


@pytest.fixture(scope="module")
def scheduler(cluster_binaries: lab.Binaries) -> Iterator[lab.ControlPlane]:
    with lab.ControlPlane(bins=cluster_binaries) as cp:
        process = Process(
            "kube-scheduler", scheduler_args(cluster_binaries, cp.kubeconfig), cp.dir / "scheduler.log"
        )
        process.start()
        rendered = subprocess.run(
            [str(cluster_binaries.helm), "template", "x", str(CHART), "--set", "dra.enabled=true",
             "--show-only", "templates/deviceclasses.yaml"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        cp.kubectl("apply", "-f", "-", input=rendered, check=True)
        try:
            yield cp
        finally:
            process.stop()


def a100(index: int, *profiles: str) -> Gpu:
    instances = tuple(
        GpuInstance(n, p, n, 1, (ComputeInstance(0, MigUuid(f"MIG-{index}-{n}"), mig_index=n),))
        for n, p in enumerate(profiles)
    )
    return Gpu(
        index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", 40960, True, bool(profiles), bool(profiles),
        instances, compute_capability=(8, 0), minor=index, pci_bus_id=f"0000:{index + 16:02x}:00.0",
        brand="Nvidia",
    )  # fmt: skip


def ready_node(cp: lab.ControlPlane, name: str) -> None:
    status = {
        "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
        "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake"}],
    }
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "status": status}
    cp.kubectl("create", "-f", "-", input=json.dumps(node), check=True)
    # The API server taints a new Node not-ready (admission TaintNodesByCondition); no kubelet clears it.
    cp.kubectl(
        "patch", "node", name, "--type=json", "-p", '[{"op": "remove", "path": "/spec/taints"}]', check=True
    )
    patch = json.dumps({"status": status})
    cp.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p", patch, check=True)


@contextlib.asynccontextmanager
async def pool(cp: lab.ControlPlane, *, fail_over_one: bool = False) -> AsyncIterator[str]:
    """A node whose GPU 0 has four MIG devices (3g.20gb, 2g.10gb, 1g.5gb x2), GPU 1 is time-sliced
    4 ways, GPU 2 whole and healthy, GPU 3 whole with an XID; published and complete."""
    name = f"n-{uuid.uuid4().hex[:6]}"
    ready_node(cp, name)
    node = NodeState(
        (a100(0, "3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"), a100(1), a100(2), a100(3)),
        driver=DriverInfo("550.107.02", 12040),
    )
    rule = Rule(Selector(indices=(1,)), replicas=Replicas(default=4))
    config = SharingConfig(
        name="t", mig_strategy=MigStrategy.MIXED, fail_requests_greater_than_one=fail_over_one, rules=(rule,)
    )
    sick = HealthState().apply(HealthEvent(GpuUuid("GPU-3"), False, xid=48))
    wanted = build_slices(
        name, node, build_inventory(node, config, sick, CATALOG), CATALOG, xids={"GPU-3": 48}
    )
    api = ApiClient(str(cp.kubeconfig))
    publisher = SlicePublisher(api, name, DRIVER)
    task = asyncio.create_task(publisher.run())
    try:
        publisher.want(wanted)
        await asyncio.to_thread(poll, "the pool", lambda: publisher.generation, lambda g: g > 0)
        yield name
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        api.close()


def claim(cp: lab.ControlPlane, ns: str, name: str, requests: list[dict[str, Any]], **extra: Any) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": requests, **extra}},
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(body), check=True)


def on(node: str) -> dict[str, Any]:
    """Node affinity to exactly `node` (each test has a Node of its own)."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def pod(cp: lab.ControlPlane, ns: str, name: str, claim_name: str, node: str) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "affinity": on(node),
            "resourceClaims": [{"name": "c", "resourceClaimName": claim_name}],
            "containers": [{"name": "main", "image": "x", "resources": {"claims": [{"name": "c"}]}}],
        },
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(body), check=True)


def get(cp: lab.ControlPlane, kind: str, ns: str, name: str) -> dict[str, Any]:
    return dict(json.loads(cp.kubectl("get", kind, name, "-n", ns, "-o", "json", check=True).stdout))


def allocated(cp: lab.ControlPlane, ns: str, name: str) -> list[str]:
    """The devices allocated to the claim once the scheduler has allocated it ([] before)."""
    results = get(cp, "resourceclaim", ns, name).get("status", {}).get("allocation", {})
    return sorted(r["device"] for r in results.get("devices", {}).get("results", []))


def unschedulable(cp: lab.ControlPlane, ns: str, name: str) -> str:
    """The scheduler's reason when it found no node for the pod ('' before)."""
    conditions = get(cp, "pod", ns, name).get("status", {}).get("conditions", [])
    return next(
        (
            c.get("message", "")
            for c in conditions
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
        ),
        "",
    )


@pytest.fixture
def ns(scheduler: lab.ControlPlane) -> str:
    name = f"t-{uuid.uuid4().hex[:6]}"
    scheduler.kubectl("create", "namespace", name, check=True)
    return name


async def test_two_mig_devices_of_one_gpu_by_profile(scheduler: lab.ControlPlane, ns: str) -> None:
    async with pool(scheduler) as node:
        selector = [
            {"cel": {"expression": f"{A}.profile == '1g.5gb' && {A}.productName == 'NVIDIA A100-SXM4-40GB'"}}
        ]
        request = {
            "name": "mig",
            "exactly": {"deviceClassName": "mig.nvidia.com", "count": 2, "selectors": selector},
        }
        claim(scheduler, ns, "two", [request], constraints=[{"matchAttribute": f"{DRIVER}/parentUUID"}])
        pod(scheduler, ns, "p", "two", node)
        found = await asyncio.to_thread(poll, "the allocation", lambda: allocated(scheduler, ns, "two"), bool)
        assert found == ["gpu-0-mig-2", "gpu-0-mig-3"]


async def test_a_time_sliced_gpu_is_shared_up_to_its_replicas(scheduler: lab.ControlPlane, ns: str) -> None:
    async with pool(scheduler) as node:
        on_gpu1 = [{"cel": {"expression": f"{A}.uuid == 'GPU-1'"}}]
        for n in range(3):
            claim(
                scheduler,
                ns,
                f"share-{n}",
                [{"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com", "selectors": on_gpu1}}],
            )
            pod(scheduler, ns, f"p{n}", f"share-{n}", node)
        for n in range(3):
            found = await asyncio.to_thread(
                poll, "a share", lambda n=n: allocated(scheduler, ns, f"share-{n}"), bool
            )
            assert found == ["gpu-1"]
        # One share is left of four: a claim for two cannot be allocated, and the pod says why.
        two = {
            "deviceClassName": "gpu.nvidia.com",
            "selectors": on_gpu1,
            "capacity": {"requests": {"shares": "2"}},
        }
        claim(scheduler, ns, "two-shares", [{"name": "g", "exactly": two}])
        pod(scheduler, ns, "p-two", "two-shares", node)
        reason = await asyncio.to_thread(
            poll, "the scheduler's reason", lambda: unschedulable(scheduler, ns, "p-two"), bool
        )
        assert "cannot allocate all claims" in reason
        assert allocated(scheduler, ns, "two-shares") == []


async def test_with_fail_requests_greater_than_one_an_allocation_takes_one_share(
    scheduler: lab.ControlPlane, ns: str
) -> None:
    async with pool(scheduler, fail_over_one=True) as node:
        on_gpu1 = [{"cel": {"expression": f"{A}.uuid == 'GPU-1'"}}]
        two = {
            "deviceClassName": "gpu.nvidia.com",
            "selectors": on_gpu1,
            "capacity": {"requests": {"shares": "2"}},
        }
        claim(scheduler, ns, "two-shares", [{"name": "g", "exactly": two}])
        pod(scheduler, ns, "p-two", "two-shares", node)
        reason = await asyncio.to_thread(
            poll, "the scheduler's reason", lambda: unschedulable(scheduler, ns, "p-two"), bool
        )
        assert "cannot allocate all claims" in reason
        one = {"deviceClassName": "gpu.nvidia.com", "selectors": on_gpu1}
        claim(scheduler, ns, "one-share", [{"name": "g", "exactly": one}])
        pod(scheduler, ns, "p-one", "one-share", node)
        assert await asyncio.to_thread(
            poll, "a share", lambda: allocated(scheduler, ns, "one-share"), bool
        ) == ["gpu-1"]


async def test_a_tainted_gpu_is_not_allocated_to_new_claims(scheduler: lab.ControlPlane, ns: str) -> None:
    async with pool(scheduler) as node:
        for n in range(2):  # GPU 2 and (never) GPU 3: only GPU 2 is healthy among the whole GPUs left
            whole = {
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [{"cel": {"expression": "!device.allowMultipleAllocations"}}],
            }
            claim(scheduler, ns, f"whole-{n}", [{"name": "g", "exactly": whole}])
            pod(scheduler, ns, f"p{n}", f"whole-{n}", node)
        first = await asyncio.to_thread(
            poll,
            "a whole GPU",
            lambda: allocated(scheduler, ns, "whole-0") or allocated(scheduler, ns, "whole-1"),
            bool,
        )
        assert first == ["gpu-2"]
        pending = "p1" if allocated(scheduler, ns, "whole-0") else "p0"
        reason = await asyncio.to_thread(
            poll, "the scheduler's reason", lambda: unschedulable(scheduler, ns, pending), bool
        )
        assert "cannot allocate all claims" in reason


def legacy_pod(cp: lab.ControlPlane, ns: str, name: str, resource: str, node: str) -> None:
    """A pod written for the device plugins: the device in `resources.limits`, no claim."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "affinity": on(node),
            "containers": [{"name": "main", "image": "x", "resources": {"limits": {resource: "1"}}}],
        },
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(body), check=True)


def claim_of_pod(cp: lab.ControlPlane, ns: str, name: str) -> str:
    """The claim the scheduler made for a pod's extended resources ('' before)."""
    status = get(cp, "pod", ns, name).get("status", {})
    return str(status.get("extendedResourceClaimStatus", {}).get("resourceClaimName", ""))


async def test_a_pod_asking_for_a_mig_extended_resource_gets_a_mig_device(
    scheduler: lab.ControlPlane, ns: str
) -> None:
    async with pool(scheduler) as node:
        legacy_pod(scheduler, ns, "legacy", MIG_3G, node)
        name = await asyncio.to_thread(
            poll, "the pod's claim", lambda: claim_of_pod(scheduler, ns, "legacy"), bool
        )
        found = await asyncio.to_thread(poll, "its allocation", lambda: allocated(scheduler, ns, name), bool)
        assert found == ["gpu-0-mig-0"]
        assert get(scheduler, "pod", ns, "legacy")["spec"]["nodeName"] == node


async def test_pods_asking_for_nvidia_com_gpu_take_shares_and_whole_gpus(
    scheduler: lab.ControlPlane, ns: str
) -> None:
    async with pool(scheduler) as node:
        # GPU 1 has 4 shares, GPU 2 is whole, GPU 3 is tainted: five pods fit, the sixth does not.
        for n in range(6):
            legacy_pod(scheduler, ns, f"p{n}", "nvidia.com/gpu", node)

        def placed() -> tuple[list[str], list[str]]:
            devices, pending = [], []
            for n in range(6):
                if (name := claim_of_pod(scheduler, ns, f"p{n}")) and (
                    found := allocated(scheduler, ns, name)
                ):
                    devices += found
                elif unschedulable(scheduler, ns, f"p{n}"):
                    pending.append(f"p{n}")
            return sorted(devices), pending

        devices, pending = await asyncio.to_thread(
            poll, "all six decided", placed, lambda v: len(v[0]) + len(v[1]) == 6
        )
        assert devices == ["gpu-1", "gpu-1", "gpu-1", "gpu-1", "gpu-2"]
        assert len(pending) == 1
