"""What the usage sampler costs: its CPU per sample on a full node, as a share of one core.

The node: 8 GPUs of the fake driver (4x A100-SXM4-40GB, 4x H100 80GB HBM3), each in MIG mode with
seven 1g devices, made through the real NVML backend (56 MIG devices); the first MIG device of each
GPU time-sliced 8 ways (64 replicas), the other 48 held whole: 112 held slices, each by a pod of its
own with one GPU process (a host PID whose `/proc/<pid>/cgroup`, in a /proc of the bench's own, names
its pod and container as a cgroup v1 node's does), and the 112 pods listed as the API server lists
them. The sampler is the agent's (`sharing.usage.UsageSampler` over the backend's usage reader, the
real pynvml and the fake driver); each sample reads every GPU and MIG device, the 112 processes,
GPM of the 28 H100 GPU instances (the A100s have none), maps the PIDs, attributes, updates the
windows, and builds the slices it is given from the advertised devices and PodResources' holdings
(which the agent does on its loop), samples 0.2 s apart so that GPM has its two samples.

- usage_sampler_cpu_pct: the sampler thread's CPU time per sample (time.thread_time, as the agent
  counts it) over the default interval, 10 s, in percent of one core: everything it runs, the NVML
  calls through pynvml and the fake driver included (a real driver's calls cost their ioctls
  instead of the fake's JSON work).
- usage_sample_nvml_share: the share of that CPU time spent in NVML calls (pynvml and the fake
  driver), and the number of NVML calls per sample (noted).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import cast

from bench.prepare import TimedNvml
from bench.procs import in_process_driver
from bench.report import Budget, Results, percentile, say
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend, load_pynvml
from sharing.gpu.nvmlapi import Nvml
from sharing.mig.catalog import default_catalog
from sharing.model import BoundPod, Gpu, Holding, MigUuid
from sharing.usage import UsageSampler, held_slices

GPUS = ("A100-SXM4-40GB",) * 4 + ("H100-80GB-HBM3",) * 4
REPLICAS = 8
INTERVAL_S = 10.0
SPACING_S = 0.2
"""Between two samples of the bench: more than GPM's 100 ms."""
FIRST_PID = 400_000
CGROUP_V1 = (
    "pids", "memory", "devices", "cpu,cpuacct", "blkio", "cpuset", "freezer", "net_cls,net_prio",
    "hugetlb", "perf_event", "rdma", "misc",
)  # fmt: skip


def bench_usage(tmp: Path, budget: Budget, results: Results) -> None:
    """usage_sampler_cpu_pct over `budget.usage_samples` samples (the in-process fake driver under `tmp`)."""
    cpu, wall, nvml_share, calls, slices = asyncio.run(_measure(tmp, budget.usage_samples))
    per_sample = percentile(cpu, 50)
    results.add("usage_sampler_cpu_pct", 100 * per_sample / INTERVAL_S)
    results.add("usage_sample_nvml_share", nvml_share)
    results.note(
        f"usage: one sample of 8 GPUs, 56 MIG devices, {slices} held slices (64 replicas), "
        f"{len(cpu)} samples; CPU p50/max, wall p50, NVML calls",
        f"{per_sample * 1000:.1f}/{max(cpu) * 1000:.1f} ms, {percentile(wall, 50) * 1000:.1f} ms, "
        f"{calls:.0f} calls",
    )


async def _measure(tmp: Path, samples: int) -> tuple[list[float], list[float], float, float, int]:
    catalog = default_catalog()
    root, state = in_process_driver(tmp)
    simstate.init_state(state, [simstate.resolve_product(catalog, p) for p in GPUS], seed="bench-usage")
    nvml = TimedNvml(load_pynvml(root))
    backend = NvmlBackend(cast(Nvml, nvml), catalog)
    try:
        say("usage: 8 GPUs into 7 MIG devices each")
        node = await backend.observe()
        for gpu in node.gpus:
            await backend.set_mig_mode(gpu.uuid, True)
            for start in range(7):
                await backend.create_instance(
                    gpu.uuid, "1g.5gb" if "A100" in gpu.product else "1g.10gb", start
                )
        node = await backend.observe()
        files = tmp / "usage"
        inventory, holdings, pods = _node(files / "proc", state, node.gpus)
        sampler = UsageSampler(
            backend.usage_reader(),
            held=lambda: held_slices(inventory, holdings),
            pods=lambda: pods,
            proc=files / "proc",
            state=files / "usage.json",
            interval_s=INTERVAL_S,
            window_s=24 * 3600,
        )
        sampler.sample()  # the first: pods listed, GPM seeded, windows made
        cpu, wall = [], []
        nvml.cpu, nvml.calls = 0.0, []
        for _ in range(samples):
            time.sleep(SPACING_S)
            before, started = sampler.cpu_seconds, time.perf_counter()
            report = sampler.sample()
            cpu.append(sampler.cpu_seconds - before)
            wall.append(time.perf_counter() - started)
        attributed = sum(1 for s in report.slices if s.use.processes)
        if attributed != len(holdings) or report.unattributed:
            raise RuntimeError(f"{attributed} of {len(holdings)} slices attributed, {report.unattributed}")
        sampler.reader.close()
        return cpu, wall, nvml.cpu / sum(cpu), len(nvml.calls) / samples, len(report.slices)
    finally:
        await backend.close()


def _node(proc: Path, state: Path, gpus: tuple[Gpu, ...]) -> tuple[Inventory, list[Holding], list[BoundPod]]:
    """The advertised slices, the pods holding them with one process each, and their /proc entries."""
    (proc / "self").mkdir(parents=True, exist_ok=True)
    shared: list[Device] = []
    whole: list[Device] = []
    for gpu in gpus:
        first, *rest = [ci.uuid for _, ci in gpu.mig_devices]
        shared += [
            Device(DeviceId(f"{first}::{i}"), Health.HEALTHY, None, gpu.uuid, MigUuid(first), i)
            for i in range(REPLICAS)
        ]
        whole += [Device(DeviceId(uuid), Health.HEALTHY, None, gpu.uuid, MigUuid(uuid)) for uuid in rest]
    inventory = Inventory(
        (
            (ResourceName("nvidia.com/mig-1g.shared"), tuple(shared)),
            (ResourceName("nvidia.com/mig-1g"), tuple(whole)),
        )
    )
    holdings, pods = [], []
    with simstate.editing(state) as raw:
        devices = {
            ci["uuid"]: ci for g in raw["gpus"] for gi in g["gpuInstances"] for ci in gi["computeInstances"]
        }
        for n, (resource, device) in enumerate((r, d) for r, ds in inventory.resources for d in ds):
            pid, uid, container = FIRST_PID + n, f"{n:08x}-0000-4000-8000-{n:012x}", f"{n:064x}"
            name = f"pod-{n}"
            holdings.append(Holding("bench", name, "main", resource, frozenset({device.id})))
            ids = ((container, "main"),)
            pods.append(BoundPod("bench", name, frozenset({resource}), uid=uid, containers=ids))
            devices[device.uuid]["processes"].append(simstate.SimProcess(pid, 256 + n, n % 100).state())
            (proc / str(pid)).mkdir()
            path = f"/gpu-sharing-bench/kubepods/besteffort/pod{uid}/{container}"
            lines = [f"{i}:{c}:{path}" for i, c in enumerate(CGROUP_V1, start=1)] + [f"0::{path}"]
            (proc / str(pid) / "cgroup").write_text("\n".join(lines) + "\n")
    return inventory, holdings, pods
