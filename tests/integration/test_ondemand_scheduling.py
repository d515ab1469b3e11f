"""On-demand MIG as the real kube-apiserver stores it and the real kube-scheduler allocates it: the
partitionable pool is accepted as written (no field dropped), a seeded sequence of 30 random claims
and releases never gets two overlapping placements and gets every claim allocated that fits a free
placement, small claims pack one GPU so the largest profile fits another, and a pod with
`nvidia.com/mig-3g.20gb` in its limits gets an on-demand device through the chart's class.

The same control plane as tests/integration/test_dra_scheduling.py (kube-scheduler, the chart's
DeviceClasses, a Ready Node without a kubelet: pods are bound, never run). After each allocation the
pool is published again in the order the placement policy gives for the claims prepared on the node,
as the agent does (the test stands in for the kubelet: an allocated claim's pod is bound, so it counts
as prepared); the scheduler may allocate from the order before (it is still safe, only less good), so
the tests assert what holds either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import lab
import pytest

from sharing.dra.names import DRIVER, parse_ondemand_name, profile_slug
from sharing.dra.partitions import partitionable_slices
from sharing.kube import ApiClient
from sharing.kube.api import SliceSpec
from sharing.kube.client import resource_slice
from sharing.kube.resourceslices import SlicePublisher
from sharing.mig import Placement, default_catalog
from sharing.mig.policy import Fit, fit
from sharing.model import DriverInfo, Gpu, GpuUuid, NodeState
from tests.integration import test_dra_scheduling as base
from tests.integration.test_dra_scheduling import (
    A,
    allocated,
    claim,
    claim_of_pod,
    get,
    legacy_pod,
    pod,
    ready_node,
    unschedulable,
)
from tests.polling import poll

pytestmark = pytest.mark.integration
scheduler = base.scheduler
"""The control plane with kube-scheduler and the chart's DeviceClasses (a fixture)."""
ns = base.ns

CATALOG = default_catalog()
A100 = CATALOG.product("A100-SXM4-40GB")


def dynamic_a100(index: int) -> Gpu:
    return Gpu(index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", 40960, True, True, True,
               compute_capability=(8, 0), minor=index, brand="Nvidia", profiles=A100)  # fmt: skip


class OnDemandPool:
    """Two dynamic A100s published as the agent publishes them, again after every allocation."""

    def __init__(self, cp: lab.ControlPlane, name: str) -> None:
        self.cp = cp
        self.name = name
        self.node = NodeState((dynamic_a100(0), dynamic_a100(1)), driver=DriverInfo("550.107.02", 12040))
        self.api = ApiClient(str(cp.kubeconfig))
        self.publisher = SlicePublisher(self.api, name, DRIVER)

    def wanted(self, taken: list[str]) -> tuple[SliceSpec, ...]:
        return partitionable_slices(self.name, self.node, {"GPU-0", "GPU-1"}, CATALOG, prepared=taken)

    async def publish(self, taken: list[str]) -> None:
        """Publish the pool for what is allocated now; back once the API server holds it."""
        self.publisher.want(self.wanted(taken))
        await asyncio.to_thread(self.publisher.sync)


@contextlib.asynccontextmanager
async def ondemand(cp: lab.ControlPlane) -> AsyncIterator[OnDemandPool]:
    name = f"n-{uuid.uuid4().hex[:6]}"
    ready_node(cp, name)
    found = OnDemandPool(cp, name)
    task = asyncio.create_task(found.publisher.run())
    try:
        await found.publish([])
        yield found
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        found.api.close()


def mig_claim(cp: lab.ControlPlane, ns: str, name: str, profile: str, node: str) -> None:
    request = {
        "name": "mig",
        "exactly": {
            "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": f"{A}.profile == '{profile}'"}}],
        },
    }
    claim(cp, ns, name, [request])
    pod(cp, ns, f"p-{name}", name, node)


def placed(device: str) -> tuple[int, str, int]:
    """(GPU index, profile slug, start) of an on-demand device."""
    parsed = parse_ondemand_name(device)
    assert parsed is not None, device
    return parsed


def overlapping(devices: list[str]) -> list[tuple[str, str]]:
    """Pairs of allocated devices whose placements share a memory slice of one GPU."""
    spans = []
    for device in devices:
        gpu, slug, start = placed(device)
        size = next(p.size for p in A100.profiles if profile_slug(p.name) == slug)
        spans.append((device, gpu, start, start + size))
    return [
        (a[0], b[0])
        for i, a in enumerate(spans)
        for b in spans[i + 1 :]
        if a[1] == b[1] and a[2] < b[3] and b[2] < a[3]
    ]


async def test_the_api_server_stores_the_partitionable_pool_as_written(
    scheduler: lab.ControlPlane, ns: str
) -> None:
    async with ondemand(scheduler) as found:
        assert found.publisher.problems == ()
        stored = sorted(
            (resource_slice(item).spec for item in _slices(scheduler, found.name)),
            key=_first,
        )
        wanted = sorted(found.wanted([]), key=_first)
        generation = found.publisher.generation
        assert stored == [
            type(s)(s.driver, s.node, s.pool, generation, s.slice_count, s.devices, s.shared_counters)
            for s in wanted
        ]


def _first(spec: SliceSpec) -> str:
    return spec.devices[0].name if spec.devices else ""


def _slices(cp: lab.ControlPlane, node: str) -> list[dict[str, Any]]:
    items = json.loads(cp.kubectl("get", "resourceslices", "-o", "json", check=True).stdout)["items"]
    return [i for i in items if i["spec"].get("nodeName") == node]


async def test_claims_in_turn_pack_one_gpu_never_overlap_and_leave_room_for_the_largest(
    scheduler: lab.ControlPlane, ns: str
) -> None:
    async with ondemand(scheduler) as found:
        taken: list[str] = []

        async def allocate(name: str, profile: str) -> str:
            mig_claim(scheduler, ns, name, profile, found.name)
            devices = await asyncio.to_thread(poll, name, lambda: allocated(scheduler, ns, name), bool)
            taken.extend(devices)
            await found.publish(taken)
            return str(devices[0])

        small = [await allocate(f"small-{n}", "1g.5gb") for n in range(7)]
        gpus = {placed(d)[0] for d in small}
        assert len(gpus) == 1  # packed onto one GPU
        large = await allocate("large", "7g.40gb")
        assert placed(large)[0] not in gpus
        assert overlapping(taken) == []
        for device, n in zip(small[:4], range(4), strict=True):
            release(scheduler, ns, f"small-{n}")
            taken.remove(device)
        await asyncio.to_thread(
            poll,
            "the claims gone",
            lambda: [n for n in range(4) if _exists(scheduler, ns, f"small-{n}")],
            lambda left: left == [],
        )
        await found.publish(taken)
        medium = await allocate("medium", "3g.20gb")
        assert placed(medium)[0] in gpus
        assert overlapping(taken) == []


def release(cp: lab.ControlPlane, ns: str, name: str) -> None:
    """What the pod's end and the resourceclaim controller do (no kubelet, no controller manager
    here): the pod goes, the claim is deallocated, then deleted."""
    cp.kubectl("delete", "pod", f"p-{name}", "-n", ns, "--force", "--grace-period=0", check=True)
    gone = json.dumps({"status": {"allocation": None, "reservedFor": None}})
    cp.kubectl("patch", "resourceclaim", name, "-n", ns, "--subresource=status", "--type=merge", "-p", gone,
               check=True)  # fmt: skip
    unguarded = json.dumps({"metadata": {"finalizers": None}})
    cp.kubectl("patch", "resourceclaim", name, "-n", ns, "--type=merge", "-p", unguarded, check=True)
    cp.kubectl("delete", "resourceclaim", name, "-n", ns, "--wait=false", check=True)


def _exists(cp: lab.ControlPlane, ns: str, name: str) -> bool:
    return cp.kubectl("get", "resourceclaim", name, "-n", ns).returncode == 0


async def test_a_pod_asking_for_a_mig_extended_resource_gets_an_on_demand_device(
    scheduler: lab.ControlPlane, ns: str
) -> None:
    async with ondemand(scheduler) as found:
        legacy_pod(scheduler, ns, "legacy", "nvidia.com/mig-3g.20gb", found.name)
        name = await asyncio.to_thread(
            poll, "the pod's claim", lambda: claim_of_pod(scheduler, ns, "legacy"), bool
        )
        devices = await asyncio.to_thread(
            poll, "its allocation", lambda: allocated(scheduler, ns, name), bool
        )
        assert len(devices) == 1
        assert placed(devices[0])[1:] == ("3g-20gb", 4)  # best fit: a 4g.20gb stays possible at 0
        assert get(scheduler, "pod", ns, "legacy")["spec"]["nodeName"] == found.name


PROFILES = ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")


async def test_random_claims_and_releases_never_overlap_and_every_claim_that_fits_is_allocated(
    scheduler: lab.ControlPlane, ns: str
) -> None:
    seed = 19
    rng = random.Random(seed)
    async with ondemand(scheduler) as found:
        taken: dict[str, str] = {}  # claim -> device
        outcomes: list[str] = []
        for step in range(30):
            if taken and rng.random() < 0.4:
                name = rng.choice(sorted(taken))
                release(scheduler, ns, name)
                del taken[name]
                await found.publish(sorted(taken.values()))
                continue
            profile = rng.choice(PROFILES)
            name = f"c{step}"
            fits = any(
                fit(A100, occupied(sorted(taken.values()), gpu), profile) is Fit.FITS for gpu in (0, 1)
            )
            mig_claim(scheduler, ns, name, profile, found.name)
            if fits:
                devices = await asyncio.to_thread(
                    poll, name, lambda n=name: allocated(scheduler, ns, n), bool
                )
                assert placed(devices[0])[1] == profile_slug(profile), (seed, step)
                taken[name] = devices[0]
                outcomes.append("allocated")
                await found.publish(sorted(taken.values()))
            else:
                reason = await asyncio.to_thread(
                    poll, f"{name} refused", lambda n=name: unschedulable(scheduler, ns, f"p-{n}"), bool
                )
                assert "cannot allocate all claims" in reason, (seed, step)
                assert allocated(scheduler, ns, name) == []
                outcomes.append("refused")
                scheduler.kubectl("delete", "pod", f"p-{name}", "-n", ns, "--force", "--grace-period=0")
                scheduler.kubectl("delete", "resourceclaim", name, "-n", ns, "--wait=false")
            assert overlapping(list(taken.values())) == [], (seed, step)
        print(f"seed {seed}: {Counter(outcomes)}")
        assert set(outcomes) == {"allocated", "refused"}  # the sequence tried both


def occupied(devices: list[str], gpu: int) -> list[Placement]:
    """The placements of GPU `gpu` the allocated devices take."""
    found = []
    for device in devices:
        index, slug, start = placed(device)
        if index == gpu:
            profile = next(p for p in A100.profiles if profile_slug(p.name) == slug)
            found.append(Placement(profile.name, start, profile.size))
    return found
