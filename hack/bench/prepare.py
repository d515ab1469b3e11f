"""The agent's own share of a DRA prepare: seven claims prepared at once on one A100 (fake driver).

Each round, seven claims, each allocated an on-demand 1g.5gb at its own placement of one
A100-SXM4-40GB (the slots 0 to 6: the GPU full), are prepared at once through the real `Preparer`
(seven NodePrepareResources calls together, as for seven pods starting), over the real NVML backend,
pynvml and the fake driver; then unprepared (the instances destroyed). Every NVML call is timed where
pynvml is called. A claim's share is its prepare time (what `gpu_sharing_dra_prepare_duration_seconds`
records) less the time NVML calls ran during it: the agent's own work (claim checks, checkpoint,
CDI spec, journal), whatever the hardware takes.

- dra_prepare_agent_share_s_p99: that share, p99 over the claims of every round.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
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
    """pynvml with the (start, end) of every call recorded (the backend calls it on one thread)."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self.calls: list[tuple[float, float]] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._nvml, name)
        if not name.startswith("nvml") or not callable(found):
            return found

        @functools.wraps(found)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return found(*args, **kwargs)
            finally:
                self.calls.append((started, time.monotonic()))

        return timed

    def inside(self, start: float, end: float) -> float:
        """Seconds of NVML calls within [start, end]."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.calls)


class Claims:
    """The claims as the API server would give them (the `ClaimReader`)."""

    def __init__(self) -> None:
        self.claims: dict[str, ResourceClaimObject] = {}

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject:
        return self.claims[name]


class Windows:
    """The agent's metrics, and each prepare's (end, seconds) as the Preparer reports it."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.prepares: list[tuple[float, float]] = []

    def prepared_claims(self, count: int) -> None:
        self.metrics.prepared_claims(count)

    def prepare_seconds(self, seconds: float, profile: str, ondemand: bool) -> None:
        self.prepares.append((time.monotonic(), seconds))  # the loop's clock is time.monotonic
        self.metrics.prepare_seconds(seconds, profile, ondemand)


def bench_prepare(tmp: Path, budget: Budget, results: Results) -> None:
    """dra_prepare_agent_share_s_p99 over `budget.prepare_rounds` rounds of seven claims."""
    shares, prepares = asyncio.run(_rounds(tmp / "prepare", budget.prepare_rounds))
    results.add("dra_prepare_agent_share_s_p99", percentile(shares, 99))
    results.note(
        f"prepare: {CLAIMS} on-demand 1g.5gb claims at once on one A100, {len(prepares)} prepares; "
        "prepare p50/p99, agent share p50/p99",
        f"{percentile(prepares, 50) * 1000:.1f}/{percentile(prepares, 99) * 1000:.1f} ms, "
        f"{percentile(shares, 50) * 1000:.1f}/{percentile(shares, 99) * 1000:.1f} ms",
    )


async def _rounds(tmp: Path, rounds: int, metrics: Metrics | None = None) -> tuple[list[float], list[float]]:
    """(agent share, prepare time) of every claim of `rounds` rounds."""
    catalog = default_catalog()
    root, state = in_process_driver(tmp.parent)
    simstate.init_state(state, [simstate.resolve_product(catalog, "A100-SXM4-40GB")])
    nvml = TimedNvml(load_pynvml(root))
    metrics = metrics or Metrics("bench")
    backend = NvmlBackend(cast(Nvml, nvml), catalog, mig_seconds=metrics.mig_operation)
    windows = Windows(metrics)
    claims = Claims()
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
            cdi_dir=tmp / "cdi",
            checkpoint=ClaimCheckpoint(tmp / "claims.json"),
            recorder=windows,
            ondemand=OnDemand(backend, Journal(tmp / "journal.jsonl")),
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
    shares = [seconds - nvml.inside(end - seconds, end) for end, seconds in windows.prepares]
    return shares, [seconds for _, seconds in windows.prepares]


def _check(answers: list[dict[str, Any]], error: Callable[[Any], str]) -> None:
    failed = [error(a) for answer in answers for a in answer.values() if error(a)]
    if failed:
        raise RuntimeError(f"{len(failed)} claims failed: {failed[0]}")
