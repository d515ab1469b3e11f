"""Per-call cost of NVML in one observe() of 8 A100s with 7 MIG instances each: fake driver vs SimNvml.

    $(hack/venv.sh)/bin/python hack/fakedriver/bench.py [--rounds N] [--json PATH]

Both run the agent's own NvmlBackend.observe() over the same state file: once over the real pynvml
(nvidia-ml-py, ctypes) over the fake libnvidia-ml.so.1 (in a child process started with
LD_LIBRARY_PATH, as pynvml loads the library once per process), once over the Python SimNvml. A
counting proxy between the backend and the NVML module counts the calls one observe makes (the
same proxy on both sides). Prints, per side: NVML calls per observe, ms per observe, µs per call
(the median of N rounds, after one warm-up round), and for the fake driver the cost of one call
that reads no state and of one that reads it. --json also writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GPUS, INSTANCES = 8, 7


class Counting:
    """The NVML module with every function call counted."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if not callable(value) or isinstance(value, type) or not name.startswith("nvml"):
            return value

        def counted(*args: Any) -> Any:
            self.calls += 1
            return value(*args)

        return counted


def measure(nvml: Any, rounds: int) -> dict[str, float]:
    """Median cost of NvmlBackend(nvml).observe() and of one NVML call in it."""
    from sharing.catalog import default_catalog  # noqa: PLC0415  (after sys.path is set)
    from sharing.gpu.nvml import NvmlBackend  # noqa: PLC0415

    counting = Counting(nvml)
    backend = NvmlBackend(counting, default_catalog())

    async def run() -> dict[str, float]:
        state = await backend.observe()  # warm-up: nvmlInit, profile tables read and cached
        assert sum(len(g.instances) for g in state.gpus) == GPUS * INSTANCES, state
        times, calls = [], []
        for _ in range(rounds):
            before, start = counting.calls, time.perf_counter()
            await backend.observe()
            times.append(time.perf_counter() - start)
            calls.append(counting.calls - before)
        await backend.close()
        observe_s = statistics.median(times)
        per_observe = statistics.median(calls)
        return {"calls_per_observe": per_observe, "observe_ms": observe_s * 1e3,
                "us_per_call": observe_s / per_observe * 1e6}  # fmt: skip

    return asyncio.run(run())


def prepare(state: Path, root: Path) -> None:
    """8 idle A100s with MIG on and seven 1g.5gb instances each, made through the fake driver."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    init = ["sim", "init", "--sim-state", str(state), "--gpus", f"A100-SXM4-40GB:{GPUS}"]
    subprocess.run([sys.executable, "-m", "sharing", *init], check=True, env=env, stdout=subprocess.DEVNULL)
    script = f"""
import asyncio
from sharing.catalog import default_catalog
from sharing.gpu.nvml import open_nvml
async def main():
    backend = open_nvml(default_catalog())
    for gpu in (await backend.observe()).gpus:
        await backend.set_mig_mode(gpu.uuid, True)
        for start in range({INSTANCES}):
            await backend.create_instance(gpu.uuid, "1g.5gb", start)
    await backend.close()
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", script], check=True, env=driver_env(state, root))


def driver_env(state: Path, root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "FAKE_NVML_STATE": str(state),
            "LD_LIBRARY_PATH": str(root / "usr/lib/x86_64-linux-gnu")}  # fmt: skip


def floor(pynvml: Any) -> dict[str, float]:
    """µs per call of one call that reads no state and one that reads it (a stat() and lookups)."""
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    figures = {}
    for name, call in (
        ("us_no_state", lambda: pynvml.nvmlDeviceIsMigDeviceHandle(gpu)),
        ("us_state_read", lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)),
    ):
        start = time.perf_counter()
        for _ in range(20000):
            call()
        figures[name] = (time.perf_counter() - start) / 20000 * 1e6
    pynvml.nvmlShutdown()
    return figures


def child(kind: str, state: Path, rounds: int) -> dict[str, float]:
    if kind == "fake":
        import pynvml  # noqa: PLC0415

        return {**measure(pynvml, rounds), **floor(pynvml)}
    from sharing.gpu.simnvml import SimNvml  # noqa: PLC0415

    return measure(SimNvml(state), rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    parser.add_argument("--child", choices=("fake", "sim"), help=argparse.SUPPRESS)
    parser.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.child:
        print(json.dumps(child(args.child, args.state, args.rounds)))
        return 0
    root = Path(subprocess.run([str(REPO / "hack/fakedriver/build.sh")], check=True, capture_output=True,
                               text=True).stdout.strip())  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "var/lib/fake-nvidia/gpus.json"
        prepare(state, root)

        def run(kind: str) -> dict[str, float]:
            command = [sys.executable, __file__, "--child", kind, "--state", str(state)]
            done = subprocess.run(
                [*command, "--rounds", str(args.rounds)],
                check=True, capture_output=True, text=True, env=driver_env(state, root),
            )  # fmt: skip
            figures: dict[str, float] = json.loads(done.stdout)
            return figures

        figures = {"fake_driver": run("fake"), "simnvml": run("sim")}
    for name, f in figures.items():
        calls, ms, us = f["calls_per_observe"], f["observe_ms"], f["us_per_call"]
        print(f"{name:12} {calls:6.0f} NVML calls/observe  {ms:8.2f} ms/observe  {us:7.2f} µs/call")
    fake = figures["fake_driver"]
    print(f"fake driver, one call through pynvml: {fake['us_no_state']:.2f} µs reading no state, "
          f"{fake['us_state_read']:.2f} µs reading it (stat, lookups)")  # fmt: skip
    ratio = figures["simnvml"]["us_per_call"] / fake["us_per_call"]
    print(f"SimNvml costs {ratio:.1f}x the fake driver per call")
    if args.json:
        args.json.write_text(json.dumps({**figures, "simnvml_vs_fake_driver": ratio}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
