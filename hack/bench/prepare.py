"""The agent's own share of a DRA prepare: seven claims prepared at once on one A100 (fake driver).

Each round, seven claims, each allocated an on-demand 1g.5gb at its own placement of one
A100-SXM4-40GB (the slots 0 to 6: the GPU full), are prepared at once through the real `Preparer`
(seven NodePrepareResources calls together, as for seven pods starting), over the real NVML backend,
pynvml and the fake driver; then unprepared (the instances destroyed). Every NVML call is timed where
pynvml is called. A claim's share is its prepare time (what `gpu_sharing_dra_prepare_duration_seconds`
records) less the time NVML calls ran during it: the agent's own work (claim checks, checkpoint,
CDI spec, journal), whatever the hardware takes.

- dra_prepare_agent_share_s_p99: that share, p99 over the claims of every round, the checkpoint, CDI
  specs and journal in the bench's temporary directory (on disk: each on-demand prepare fsyncs its
  checkpoint twice, its journal step and its CDI spec, and on a disk others write to, an fsync can
  wait hundreds of milliseconds).
- dra_prepare_agent_share_tmpfs_s_p99: the same with those files on tmpfs (/dev/shm), where an fsync
  costs nothing: the agent's own work without the disk's waits.

Both are wall-clock times, so on a machine whose cores others keep busy they include the time the
agent waited for a core. So:

- dra_prepare_agent_cpu_s_p99: the agent's CPU time in each prepare (files on disk): the process's
  CPU time from the claim's read to the prepare's end, less that of the NVML calls.
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bench.procs import in_process_driver
from bench.report import Budget, Results, percentile
from sharing.devices import Inventory
from sharing.dra import ClaimKey, OnDemand, Preparer
from sharing.gpu import simstate
from sharing.gpu.nvml import NvmlBackend, load_pynvml
from sharing.gpu.nvmlapi import Nvml
from sharing.kube.api import AllocatedDevice, ResourceClaimObject
from sharing.mig.catalog import default_catalog
from sharing.ops import Metrics
from sharing.store import ClaimCheckpoint, Journal

CLAIMS = 7
POOL = "bench-node"


class TimedNvml:
    """pynvml with the (start, end) of every call recorded, and the CPU time of them all (the backend
    calls it on one thread)."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self.calls: list[tuple[float, float]] = []
        self.cpu = 0.0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._nvml, name)
        if not name.startswith("nvml") or not callable(found):
            return found

        @functools.wraps(found)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.monotonic(), time.thread_time()
            try:
                return found(*args, **kwargs)
            finally:
                self.calls.append((started, time.monotonic()))
                self.cpu += time.thread_time() - cpu

        return timed

    def inside(self, start: float, end: float) -> float:
        """Seconds of NVML calls within [start, end]."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.calls)


def cpu_now(nvml: TimedNvml) -> float:
    """CPU seconds of the process so far, less its NVML calls'."""
    return time.process_time() - nvml.cpu


class Claims:
    """The claims as the API server would give them (the `ClaimReader`); when each prepare read its
    claim (its first step), in the agent's CPU time."""

    def __init__(self, nvml: TimedNvml) -> None:
        self.claims: dict[str, ResourceClaimObject] = {}
        self.read_at: list[float] = []
        self._nvml = nvml

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject:
        self.read_at.append(cpu_now(self._nvml))  # the prepares run one at a time: in their order
        return self.claims[name]


class Windows:
    """The agent's metrics, and each prepare's (end, seconds, agent CPU at the end) as the Preparer
    reports it."""

    def __init__(self, metrics: Metrics, nvml: TimedNvml) -> None:
        self.metrics = metrics
        self.prepares: list[tuple[float, float, float]] = []
        self._nvml = nvml

    def prepared_claims(self, count: int) -> None:
        self.metrics.prepared_claims(count)

    def prepare_seconds(self, seconds: float, profile: str, ondemand: bool) -> None:
        # the loop's clock is time.monotonic
        self.prepares.append((time.monotonic(), seconds, cpu_now(self._nvml)))
        self.metrics.prepare_seconds(seconds, profile, ondemand)


def bench_prepare(tmp: Path, budget: Budget, results: Results) -> None:
    """dra_prepare_agent_share_s_p99 (and on tmpfs) over `budget.prepare_rounds` rounds of seven claims."""
    disk = asyncio.run(_rounds(tmp, tmp / "prepare", budget.prepare_rounds))
    results.add("dra_prepare_agent_share_s_p99", percentile(disk.shares, 99))
    results.add("dra_prepare_agent_cpu_s_p99", percentile(disk.cpu, 99))
    _note(results, "on disk", disk)
    if Path("/dev/shm").is_dir():
        with tempfile.TemporaryDirectory(prefix="gs-bench-prepare-", dir="/dev/shm") as files:
            tmpfs = asyncio.run(_rounds(tmp, Path(files), budget.prepare_rounds))
        results.add("dra_prepare_agent_share_tmpfs_s_p99", percentile(tmpfs.shares, 99))
        _note(results, "on tmpfs", tmpfs)


@dataclass(frozen=True)
class Figures:
    """Per prepared claim: its prepare time, the agent's share of it, and the agent's CPU time in it."""

    prepares: list[float]
    shares: list[float]
    cpu: list[float]


def _note(results: Results, where: str, f: Figures) -> None:
    def ms(samples: list[float]) -> str:
        return f"{percentile(samples, 50) * 1000:.1f}/{percentile(samples, 99) * 1000:.1f}"

    results.note(
        f"prepare: {CLAIMS} on-demand 1g.5gb claims at once on one A100, {len(f.prepares)} prepares, "
        f"files {where}; p50/p99 of the prepare, the agent's share of it, the agent's CPU time in it",
        f"{ms(f.prepares)} ms, {ms(f.shares)} ms, {ms(f.cpu)} ms",
    )


async def _rounds(tmp: Path, files: Path, rounds: int, metrics: Metrics | None = None) -> Figures:
    """The figures of every claim of `rounds` rounds, the agent's files under `files`."""
    catalog = default_catalog()
    root, state = in_process_driver(tmp)
    simstate.init_state(state, [simstate.resolve_product(catalog, "A100-SXM4-40GB")])
    nvml = TimedNvml(load_pynvml(root))
    metrics = metrics or Metrics("bench")
    backend = NvmlBackend(cast(Nvml, nvml), catalog, mig_seconds=metrics.mig_operation)
    windows = Windows(metrics, nvml)
    claims = Claims(nvml)
    try:
        node = await backend.observe()
        await backend.set_mig_mode(node.gpus[0].uuid, True)
        node = await backend.observe()
        preparer = Preparer(
            pool=POOL,
            claims=claims,
            inventory=Inventory,
            node=lambda: node,
            files=backend.device_files,
            cdi_dir=files / "cdi",
            checkpoint=ClaimCheckpoint(files / "claims.json"),
            recorder=windows,
            ondemand=OnDemand(backend, Journal(files / "journal.jsonl")),
        )
        await preparer.load()
        for r in range(rounds):
            keys = [ClaimKey("bench", f"c{r}-{i}", f"uid-{r}-{i}") for i in range(CLAIMS)]
            for i, key in enumerate(keys):
                device = AllocatedDevice("mig", "gpu.nvidia.com", POOL, f"gpu-0-mig-1g-5gb-at-{i}")
                claims.claims[key.name] = ResourceClaimObject(
                    key.namespace, key.name, key.uid, allocated=True, results=(device,)
                )
            answers = await asyncio.gather(*(preparer.prepare([k]) for k in keys))
            _check(answers, lambda a: a.error)
            _check([await preparer.unprepare(keys)], lambda error: error)
    finally:
        await backend.close()
    return Figures(
        prepares=[seconds for _, seconds, _ in windows.prepares],
        shares=[seconds - nvml.inside(end - seconds, end) for end, seconds, _ in windows.prepares],
        cpu=[cpu - read for (_, _, cpu), read in zip(windows.prepares, claims.read_at, strict=True)],
    )


def _check(answers: list[dict[str, Any]], error: Callable[[Any], str]) -> None:
    failed = [error(a) for answer in answers for a in answer.values() if error(a)]
    if failed:
        raise RuntimeError(f"{len(failed)} claims failed: {failed[0]}")
