"""Per-call cost of NVML in one observe() of 8 A100s with 7 MIG instances each, on the fake driver.

    $(hack/venv.sh)/bin/python hack/fakedriver/bench.py [--rounds N] [--json PATH]

Runs the agent's own NvmlBackend.observe() over the real pynvml (nvidia-ml-py, ctypes) over the
fake libnvidia-ml.so.1, bound the way the agent binds it (a driver root made with `build.sh
--install`, nothing in the environment). A counting proxy between the backend and pynvml counts
the calls one observe makes. Prints NVML calls per observe, ms per observe, µs per call (the
median of N rounds, after one warm-up round), and the cost of one call that reads no state and of
one that reads it. --json also writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def prepare(root: Path) -> None:
    """8 idle A100s with MIG on and seven 1g.5gb instances each, made through the fake driver."""
    from sharing.gpu import simstate  # noqa: PLC0415  (after sys.path is set)
    from sharing.gpu.nvml import open_nvml  # noqa: PLC0415
    from sharing.mig import default_catalog  # noqa: PLC0415

    catalog = default_catalog()
    a100 = simstate.resolve_product(catalog, "A100-SXM4-40GB")
    simstate.init_state(root / "var/lib/fake-nvidia/gpus.json", [a100] * GPUS)
    backend = open_nvml(catalog, root)
    for gpu in (await backend.observe()).gpus:
        await backend.set_mig_mode(gpu.uuid, True)
        for start in range(INSTANCES):
            await backend.create_instance(gpu.uuid, "1g.5gb", start)
    await backend.close()


async def measure(root: Path, rounds: int) -> dict[str, float]:
    """Median cost of NvmlBackend.observe() and of one NVML call in it."""
    from sharing.gpu.nvml import NvmlBackend, load_pynvml  # noqa: PLC0415
    from sharing.mig import default_catalog  # noqa: PLC0415

    counting = Counting(load_pynvml(root))
    backend = NvmlBackend(counting, default_catalog())  # type: ignore[arg-type]
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


def floor(root: Path) -> dict[str, float]:
    """µs per call of one call that reads no state and one that reads it (a stat() and lookups)."""
    from sharing.gpu.nvml import load_pynvml  # noqa: PLC0415

    pynvml: Any = load_pynvml(root)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run([str(REPO / "hack/fakedriver/build.sh"), "--install", tmp], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        asyncio.run(prepare(root))
        figures = {**asyncio.run(measure(root, args.rounds)), **floor(root)}
    calls, ms, us = figures["calls_per_observe"], figures["observe_ms"], figures["us_per_call"]
    print(f"fake driver  {calls:6.0f} NVML calls/observe  {ms:8.2f} ms/observe  {us:7.2f} µs/call")
    print(f"one call through pynvml: {figures['us_no_state']:.2f} µs reading no state, "
          f"{figures['us_state_read']:.2f} µs reading it (stat, lookups)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
