"""The DRA publisher alone against a real kube-apiserver: how long a changed pool takes to be stored.

A Node object (no kubelet) and the publisher as the agent runs it (its asyncio loop, its thread for the
blocking client, its watch). Each change flips the wanted pool between two layouts of 69 A100s (GPU 0 in
MIG mode, GPU 1 shared four ways, one GPU tainted or not: 72 devices in 2 slices, or 72 in 1), then
times `want()` until a second client lists the whole pool at the new generation with exactly the
wanted devices. resourceslice_publish_s_p50/p95 per run. This is the publisher's share of "ResourceSlice
update after a config change"; the reconcile before it is measured by the agent's own parts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import lab

from bench.report import Budget, Results, percentile, say
from sharing.config.spec import MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.devices import HealthState, build_inventory
from sharing.dra.names import DRIVER
from sharing.dra.slices import build_slices
from sharing.kube import ApiClient
from sharing.kube.api import SliceSpec
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

NODE = "bench-dra"
GPUS = 69


def _gpu(index: int, *profiles: str) -> Gpu:
    instances = tuple(
        GpuInstance(n, p, n, 1, (ComputeInstance(0, MigUuid(f"MIG-{index}-{n}"), mig_index=n),))
        for n, p in enumerate(profiles)
    )
    return Gpu(
        index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", 40960, True, bool(profiles), bool(profiles),
        instances, compute_capability=(8, 0), minor=index, pci_bus_id=f"0000:{index % 256:02x}:00.0",
    )  # fmt: skip


def pools() -> tuple[tuple[SliceSpec, ...], tuple[SliceSpec, ...]]:
    """The two layouts a change flips between: one GPU tainted (2 slices) or none (1 slice)."""
    catalog = default_catalog()
    node = NodeState(
        (_gpu(0, "3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"), *(_gpu(i) for i in range(1, GPUS))),
        driver=DriverInfo("550.107.02", 12040),
    )
    config = SharingConfig(
        name="bench",
        mig_strategy=MigStrategy.MIXED,
        rules=(Rule(Selector(indices=(1,)), replicas=Replicas(4)),),
    )
    sick = HealthState().apply(HealthEvent(GpuUuid("GPU-5"), False, xid=48))
    tainted = build_slices(
        NODE, node, build_inventory(node, config, sick, catalog), catalog, xids={"GPU-5": 48}
    )
    clean = build_slices(NODE, node, build_inventory(node, config, None, catalog), catalog)
    return tainted, clean


def _stored(api: ApiClient, wanted: tuple[SliceSpec, ...], above: int) -> int:
    """The pool's generation once the API server holds exactly `wanted` above `above`; 0 before."""
    held = [s.spec for s in api.list_resource_slices(DRIVER, NODE)]
    generations = {s.generation for s in held}
    complete = len(held) == len(wanted) and len(generations) == 1 and min(generations) > above
    devices = [d for s in held for d in s.devices]
    expected = {d.name: d for s in wanted for d in s.devices}
    if complete and len(devices) == len(expected) and {d.name: d for d in devices} == expected:
        return held[0].generation
    return 0


async def _changes(api: ApiClient, reader: ApiClient, changes: int) -> list[float]:
    publisher = SlicePublisher(api, NODE, DRIVER)
    task = asyncio.create_task(publisher.run())
    samples: list[float] = []
    layouts = pools()
    generation = 0
    try:
        for n in range(changes + 1):
            wanted = layouts[n % 2]
            start = time.perf_counter()
            publisher.want(wanted)
            while not (seen := await asyncio.to_thread(_stored, reader, wanted, generation)):
                await asyncio.sleep(0.002)
            if n:  # the first creates the pool: not a change
                samples.append(time.perf_counter() - start)
            generation = seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return samples


def bench_resourceslices(tmp: Path, budget: Budget, results: Results) -> None:
    say(f"resourceslices: {budget.slice_runs} runs x {budget.slice_changes} pool changes of 72 devices")
    with lab.ControlPlane(base_dir=tmp) as cp:
        node = json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        cp.kubectl("create", "-f", "-", input=node, check=True)
        api, reader = ApiClient(str(cp.kubeconfig)), ApiClient(str(cp.kubeconfig))
        try:
            for _ in range(budget.slice_runs):
                samples = asyncio.run(_changes(api, reader, budget.slice_changes))
                results.add("resourceslice_publish_s_p50", percentile(samples, 50))
                results.add("resourceslice_publish_s_p95", percentile(samples, 95))
        finally:
            api.close()
            reader.close()
