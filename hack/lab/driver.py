"""The lab node's NVIDIA driver: the fake one (hack/fakedriver), installed as a driver installer would.

A GPU node has its driver before any agent runs: the library and tools under the driver root and,
for the fake driver, its GPUs in the state file under the same root. The lab's node mounts the root
at /run/nvidia/driver (where NVIDIA's driver container puts a driver); the chart's `driverRoot`
names it. The GPUs outlive the agent's pod, as real GPUs do; a fresh node gets fresh ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lab.errors import ClusterError
from lab.paths import REPO

NODE_DRIVER_ROOT = "/run/nvidia/driver"
"""Where the node sees its driver root (the GPU Operator's path for a containerised driver)."""
GPUS = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"
STATE = "var/lib/fake-nvidia/gpus.json"


def install(root: Path, gpus: str = GPUS, seed: str = "sim") -> Path:
    """`hack/fakedriver/build.sh --install ROOT`, then `sharing sim init` there unless GPUs exist;
    ``seed`` seeds their UUIDs (each node its own, as no two real GPUs share one)."""
    done = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh"), "--install", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise ClusterError(f"installing the fake NVIDIA driver under {root} failed:\n{done.stderr}")
    state = root / STATE
    if not state.exists():
        init = [sys.executable, "-m", "sharing", "sim", "init", "--sim-state", str(state), "--gpus", gpus]
        init += ["--seed", seed]
        made = subprocess.run(
            init, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(REPO)}
        )
        if made.returncode != 0:
            raise ClusterError(f"`sharing sim init` under {root} failed:\n{made.stderr}")
    return root
