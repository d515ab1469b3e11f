"""ListAndWatch: how fast a health change reaches the kubelet's device manager, against a peer.

Our production Fleet runs in a child process (`python -m bench.listandwatch DIR`) serving 2,048
devices (8 GPUs x 256 replicas) to a harness without a Node; the Go stub device plugin (`--quiet`)
serves 2,048 devices of its own to the same harness at the same time. A flip makes one GPU's 256
devices unhealthy (or healthy again): for ours `Fleet.apply_health`, for the stub a rewritten device
file read at once on SIGUSR1. The clock starts just before this process sends the command (a line
on the child's stdin, or the signal) and stops when the harness's /resources long-poll shows the new
allocatable count (the harness samples its device manager every 10 ms). Flips alternate ours and
the stub's, the order swapped every pair. listandwatch_ms_p95 is ours; listandwatch_vs_stub_p95 is
ours / the stub's per run. A direct ListAndWatch client's receipt time on our socket is shown too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import lab
from lab.process import exec_prefix

from bench.allocate import plugin_socket
from bench.procs import REPO, stop_process
from bench.report import Budget, Results, percentile, say
from sharing.deviceplugin.fleet import Fleet, FleetSettings
from sharing.devices.inventory import Device, DeviceId, Health, inventory_from
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.kubelet.api import deviceplugin_v1beta1_pb2_grpc as api_grpc
from sharing.model import GpuUuid, HealthEvent

GPUS, REPLICAS = 8, 256
OURS, STUB = "bench.example.com/gpu", "bench.example.com/stub"
FIRST = GpuUuid("GPU-00000000-bench-0000-0000-000000000000")


def bench_listandwatch(tmp: Path, budget: Budget, results: Results) -> None:
    total = GPUS * REPLICAS
    say(
        f"listandwatch: {budget.listandwatch_runs} runs x {budget.listandwatch_flips} flips each of ours "
        f"and the stub's, {total} devices each"
    )
    with contextlib.ExitStack() as stack:
        kubelet = stack.enter_context(
            lab.KubeletHarness(tmp / "kubelet-lw", extra_args=["--poll-interval=10ms"])
        )
        child = subprocess.Popen(
            [*exec_prefix(), sys.executable, "-m", "bench.listandwatch", str(kubelet.device_plugin_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=REPO,
            env={**os.environ, "PYTHONPATH": f"{REPO / 'hack'}:{REPO}"},
        )  # fmt: skip
        stack.callback(stop_process, child)
        healthy = [f"Stub-{g}-{n:03d}" for g in range(GPUS) for n in range(REPLICAS)]
        sick = [f"{d} Unhealthy" if d.startswith("Stub-0-") else d for d in healthy]
        stub = stack.enter_context(lab.StubDevicePlugin(kubelet.device_plugin_dir, STUB, healthy, quiet=True))

        def ask(command: str) -> float:
            assert child.stdin is not None
            assert child.stdout is not None
            start = time.monotonic()
            child.stdin.write(command + "\n")
            child.stdin.flush()
            if not child.stdout.readline():
                raise RuntimeError("the fleet child exited")
            return start

        def poke(unhealthy: bool) -> float:
            stub.set_devices(sick if unhealthy else healthy)
            start = time.monotonic()
            stub.poke()
            return start

        def allocatable(resource: str, n: int) -> Callable[[dict[str, Any]], bool]:
            return lambda r: r.get(resource, {}).get("allocatable") == n

        ask(f"init {GPUS} {REPLICAS}")
        kubelet.wait_resources(lambda r: allocatable(OURS, total)(r) and allocatable(STUB, total)(r), 60)
        unhealthy = False
        for _ in range(budget.listandwatch_runs):
            ours, stubs = [], []
            for i in range(budget.listandwatch_flips):
                unhealthy = not unhealthy
                want = total - REPLICAS if unhealthy else total
                order = [(OURS, ours), (STUB, stubs)] if i % 2 else [(STUB, stubs), (OURS, ours)]
                for resource, samples in order:
                    at = ask("sick" if unhealthy else "well") if resource == OURS else poke(unhealthy)
                    kubelet.wait_resources(allocatable(resource, want), 30)
                    samples.append((time.monotonic() - at) * 1e3)
            results.add("listandwatch_ms_p95", percentile(ours, 95))
            results.add("listandwatch_vs_stub_p95", percentile(ours, 95) / percentile(stubs, 95))
            results.add("_lw_p50", percentile(ours, 50))
            results.add("_lw_stub_p50", percentile(stubs, 50))
            results.add("_lw_stub_p95", percentile(stubs, 95))
        direct = _direct(
            plugin_socket(kubelet.device_plugin_dir, r"bench-gpu-[0-9a-f]{8}\.sock"),
            ask,
            budget.listandwatch_flips,
            unhealthy,
        )
    results.note(
        "listandwatch: harness p50 ours / the stub's p50/p95 (median of runs)",
        f"{results.value('_lw_p50'):.1f} / "
        f"{results.value('_lw_stub_p50'):.1f}/{results.value('_lw_stub_p95'):.1f} ms",
    )
    results.note(
        "listandwatch: direct ListAndWatch client receipt on our socket p50/p95 (second stream)",
        f"{percentile(direct, 50):.1f}/{percentile(direct, 95):.1f} ms",
    )


def _direct(sock: Path, ask: Callable[[str], float], flips: int, unhealthy: bool) -> list[float]:
    received: list[tuple[float, int]] = []
    cond = threading.Condition()
    channel = grpc.insecure_channel(f"unix://{sock}")
    stream = api_grpc.DevicePluginStub(channel).ListAndWatch(api.Empty())  # type: ignore[no-untyped-call]

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            for response in stream:
                now = time.monotonic()
                sick = sum(d.health != "Healthy" for d in response.devices)
                with cond:
                    received.append((now, sick))
                    cond.notify_all()

    threading.Thread(target=read, daemon=True).start()
    samples = []
    try:
        with cond:
            cond.wait_for(lambda: received, 10)
        for _ in range(flips):
            unhealthy = not unhealthy
            with cond:
                mark = len(received)
            at = ask("sick" if unhealthy else "well")
            want = REPLICAS if unhealthy else 0
            with cond:
                seen = lambda mark=mark, want=want: any(u == want for _, u in received[mark:])  # noqa: E731
                if not cond.wait_for(seen, 10):
                    raise TimeoutError("the direct ListAndWatch stream did not see the change")
                got = next(t for t, u in received[mark:] if u == want)
            samples.append((got - at) * 1e3)
    finally:
        stream.cancel()
        channel.close()
    return samples


async def _serve(plugin_dir: Path) -> None:
    """Serve a Fleet; stdin: `init G R`, `sick`, `well`; one line back per command once applied."""
    fleet = Fleet(FleetSettings(plugin_dir=plugin_dir, socket_prefix="bench"))
    await fleet.start()
    try:
        while True:
            line = (await asyncio.to_thread(sys.stdin.readline)).split()
            if not line:
                return
            if line[0] == "init":
                gpus, replicas = int(line[1]), int(line[2])
                devices = [
                    Device(DeviceId(f"{uuid}::{n}"), Health.HEALTHY, g % 2, uuid, replica=n)
                    for g in range(gpus)
                    for uuid in [FIRST if g == 0 else GpuUuid(f"GPU-{g:08d}-bench-0000-0000-000000000000")]
                    for n in range(replicas)
                ]
                fleet.update(inventory_from({OURS: devices}))
            else:
                fleet.apply_health(HealthEvent(FIRST, healthy=line[0] == "well", xid=79))
            print("ok", flush=True)
    finally:
        await fleet.stop()


if __name__ == "__main__":
    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    asyncio.run(_serve(Path(sys.argv[1])))
