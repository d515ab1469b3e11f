"""Crash safety of `sharing apply`: killed after every single NVML change, then run again.

For each transition, `python -m sharing apply` runs in a subprocess with SHARING_SIM_CRASH_AFTER=k
(the simulated NVML exits 137 right after its k-th hardware change) for every k from 1 to the
number of changes the transition makes, then once more without the crash. Each time the GPUs must
end exactly in the wanted layout, with no leaked or half-built instance, and the busy instance
must still be there. Needs no cluster: only the simulated GPUs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from sharing.cli.apply import load_config
from sharing.config.spec import SharingConfig
from sharing.gpu import open_backend, simstate
from sharing.mig.catalog import default_catalog
from sharing.model import Gpu
from sharing.rollout.apply import apply_config
from sharing.store.journal import Journal

REPO = Path(__file__).resolve().parents[2]

CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata: {name: gpu-sharing-config}
data:
  balanced: |
    version: v1
    migStrategy: mixed
    gpus:
      - devices: [0]
        mig: {3g.20gb: 1, 2g.10gb: 1, 1g.5gb: 2}
      - devices: [1]
        mig: {3g.20gb: 2}
      - devices: all
        replicas: 2
  reshaped: |
    version: v1
    migStrategy: mixed
    gpus:
      - devices: [0]
        mig: {2g.10gb: 3, 1g.5gb: 1}
      - devices: all
        replicas: 2
  mixed: |
    version: v1
    migStrategy: mixed
    gpus:
      - devices: [0]
        mig: {3g.20gb: 1, 2g.10gb: 1, 1g.5gb: 2}
      - devices: [1]
        mig: {7g.40gb: 1}
      - devices: all
        replicas: 2
"""

# name, config to start from (None: fresh GPUs), config to apply, wanted layout per GPU (None: MIG off)
TRANSITIONS = [
    ("fresh-to-mixed", None, "mixed", [{"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}, {"7g.40gb": 1}, None]),
    ("reshape-keeping-busy-and-disable", "balanced", "reshaped", [{"2g.10gb": 3, "1g.5gb": 1}, None, None]),
]


@dataclass(frozen=True)
class CrashRun:
    """One crash point: the apply killed after its k-th NVML change, then the apply that recovers."""

    state: Path
    crashed: subprocess.CompletedProcess[str]
    changed: int
    """NVML changes made before the crash."""
    journal_left: bool
    recovered: subprocess.CompletedProcess[str]


def sharing(*args: str, crash_after: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARING_")}
    env["PYTHONPATH"] = str(REPO)
    if crash_after is not None:
        env["SHARING_SIM_CRASH_AFTER"] = str(crash_after)
    return subprocess.run(
        [sys.executable, "-m", "sharing", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def observe(state: Path) -> tuple[Gpu, ...]:
    async def run() -> tuple[Gpu, ...]:
        backend = open_backend("sim", default_catalog(), sim_state=state)
        try:
            return (await backend.observe()).gpus
        finally:
            await backend.close()

    return asyncio.run(run())


def converged(state: Path, config: SharingConfig, tmp_path: Path) -> bool:
    """A dry run finds nothing left to do."""

    async def run() -> bool:
        backend = open_backend("sim", default_catalog(), sim_state=state)
        try:
            report = await apply_config(
                backend,
                config,
                catalog=default_catalog(),
                journal=Journal(tmp_path / "unused.journal"),
                dry_run=True,
            )
        finally:
            await backend.close()
        return all(g.outcome.value == "unchanged" for g in report.gpus)

    return asyncio.run(run())


def apply(
    state: Path, config: Path, name: str, crash_after: int | None = None
) -> subprocess.CompletedProcess[str]:
    return sharing(
        "apply",
        "--config",
        str(config),
        "--name",
        name,
        "--backend",
        "sim",
        "--sim-state",
        str(state),
        "--journal",
        str(state.with_suffix(".journal")),
        "--no-kubelet",
        crash_after=crash_after,
    )


def check_layout(gpus: tuple[Gpu, ...], wanted: list[dict[str, int] | None], busy: str | None) -> None:
    for gpu, want in zip(gpus, wanted, strict=True):
        assert gpu.mig_enabled == (want is not None), gpu
        assert Counter(gi.profile for gi in gpu.instances) == Counter(want or {}), gpu
        assert all(len(gi.compute_instances) == 1 for gi in gpu.instances), f"half-built or leaked: {gpu}"
    if busy is not None:
        assert busy in {ci.uuid for g in gpus for _, ci in g.mig_devices}, "the busy instance was destroyed"


@pytest.mark.parametrize(("name", "start", "target", "wanted"), TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_killed_after_every_hardware_change_then_recovered(
    tmp_path: Path, name: str, start: str | None, target: str, wanted: list[dict[str, int] | None]
) -> None:
    config = tmp_path / "configmap.yaml"
    config.write_text(CONFIGMAP)
    wanted_config = load_config(config, target)
    initial = tmp_path / "initial.json"
    done = sharing("sim", "init", "--sim-state", str(initial), "--gpus", "A100-SXM4-40GB:2,T4:1")
    assert done.returncode == 0, done.stderr
    busy = None
    if start is not None:
        assert apply(initial, config, start).returncode == 0
        # Work runs on the 2g: it must survive every crash and every recovery.
        busy = next(ci.uuid for gi, ci in observe(initial)[0].mig_devices if gi.profile == "2g.10gb")
        simstate.set_busy(initial, busy, True)

    state = tmp_path / "gpus.json"
    shutil.copy(initial, state)
    first = simstate.counters(state).mutations
    clean = apply(state, config, target)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    changes = simstate.counters(state).mutations - first
    check_layout(observe(state), wanted, busy)
    assert changes > 0

    def crash_then_recover(k: int) -> CrashRun:
        copy = tmp_path / f"crash-{k}.json"
        shutil.copy(initial, copy)
        crashed = apply(copy, config, target, crash_after=k)
        changed = simstate.counters(copy).mutations - first
        journal_left = copy.with_suffix(".journal").exists()
        return CrashRun(copy, crashed, changed, journal_left, apply(copy, config, target))

    # Crash points are independent (one state file each): run a few at once to keep this quick.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        runs = list(pool.map(crash_then_recover, range(1, changes + 1)))
    for k, run in enumerate(runs, 1):
        crashed, recovered = run.crashed, run.recovered
        assert (crashed.returncode, run.changed, run.journal_left) == (137, k, True), (
            f"k={k}: {crashed.stderr}"
        )
        assert recovered.returncode == 0, f"k={k}: {recovered.stdout} {recovered.stderr}"
        assert "recovered an interrupted apply" in recovered.stdout, f"k={k}"
        assert not run.state.with_suffix(".journal").exists()
        check_layout(observe(run.state), wanted, busy)
        assert converged(run.state, wanted_config, tmp_path), (
            f"k={k}: a second apply would still change something"
        )
