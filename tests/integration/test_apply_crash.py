"""Crash safety of `sharing apply`: killed after every single NVML change, then run again.

For each transition, `python -m sharing apply` runs in a subprocess with SHARING_SIM_CRASH_AFTER=k
(the fake NVIDIA driver exits 137 right after its k-th hardware change) for every k from 1 to the
number of changes the transition makes, then once more without the crash. Each time the GPUs must
end exactly in the wanted layout, with no leaked or half-built instance, and the busy instance
must still be there. Needs no cluster: only the fake driver, one driver root per run (the apply
reaches it through --driver-root and the real pynvml; this process reads it in a subprocess, as
pynvml loads one library per process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sharing.gpu import simstate

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


STATE = "var/lib/fake-nvidia/gpus.json"


def install(root: Path) -> Path:
    """A driver root with the fake driver; its state file."""
    done = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh"), "--install", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return root / STATE


def root_of(state: Path) -> str:
    return str(state.parents[3])


def observe(state: Path) -> list[dict[str, Any]]:
    """The GPUs as `sharing export --json` reports them."""
    done = sharing("export", "--driver-root", root_of(state), "--json")
    assert done.returncode == 0, done.stderr
    gpus: list[dict[str, Any]] = json.loads(done.stdout)["gpus"]
    return gpus


def converged(state: Path, config: Path, name: str) -> bool:
    """A dry run finds nothing left to do."""
    done = sharing(
        "apply", "--config", str(config), "--name", name, "--driver-root", root_of(state),
        "--journal", str(state.with_suffix(".dry-run.journal")), "--no-kubelet", "--dry-run", "--json",
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    return all(g["outcome"] == "unchanged" for g in json.loads(done.stdout)["gpus"])


def apply(
    state: Path, config: Path, name: str, crash_after: int | None = None
) -> subprocess.CompletedProcess[str]:
    return sharing(
        "apply",
        "--config",
        str(config),
        "--name",
        name,
        "--driver-root",
        root_of(state),
        "--journal",
        str(state.with_suffix(".journal")),
        "--no-kubelet",
        crash_after=crash_after,
    )


def check_layout(gpus: list[dict[str, Any]], wanted: list[dict[str, int] | None], busy: str | None) -> None:
    for gpu, want in zip(gpus, wanted, strict=True):
        assert gpu["migEnabled"] == (want is not None), gpu
        assert Counter(row["profile"] for row in gpu["instances"]) == Counter(want or {}), gpu
        assert all(row["uuid"] for row in gpu["instances"]), f"half-built: {gpu}"
    if busy is not None:
        assert busy in {row["uuid"] for g in gpus for row in g["instances"]}, (
            "the busy instance was destroyed"
        )


@pytest.mark.parametrize(("name", "start", "target", "wanted"), TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_killed_after_every_hardware_change_then_recovered(
    tmp_path: Path, name: str, start: str | None, target: str, wanted: list[dict[str, int] | None]
) -> None:
    config = tmp_path / "configmap.yaml"
    config.write_text(CONFIGMAP)
    initial = install(tmp_path / "initial")
    done = sharing("sim", "init", "--sim-state", str(initial), "--gpus", "A100-SXM4-40GB:2,T4:1")
    assert done.returncode == 0, done.stderr
    busy = None
    if start is not None:
        assert apply(initial, config, start).returncode == 0
        # Work runs on the 2g: it must survive every crash and every recovery.
        busy = next(row["uuid"] for row in observe(initial)[0]["instances"] if row["profile"] == "2g.10gb")
        simstate.set_busy(initial, busy, True)

    def copy_of(name: str) -> Path:
        state = install(tmp_path / name)
        state.parent.mkdir(parents=True)
        shutil.copy(initial, state)
        return state

    state = copy_of("clean")
    first = simstate.counters(state).mutations
    clean = apply(state, config, target)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    changes = simstate.counters(state).mutations - first
    check_layout(observe(state), wanted, busy)
    assert changes > 0

    def crash_then_recover(k: int) -> CrashRun:
        copy = copy_of(f"crash-{k}")
        crashed = apply(copy, config, target, crash_after=k)
        changed = simstate.counters(copy).mutations - first
        journal_left = copy.with_suffix(".journal").exists()
        return CrashRun(copy, crashed, changed, journal_left, apply(copy, config, target))

    # Crash points are independent (one driver root each): run a few at once to keep this quick.
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
        assert converged(run.state, config, target), f"k={k}: a second apply would still change something"
