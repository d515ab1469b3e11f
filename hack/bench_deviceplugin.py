#!/usr/bin/env python3
"""Latency of Allocate and GetPreferredAllocation through a real gRPC unix socket.

Serves one resource with the production PluginServer (asyncio, grpc.aio) and calls it from a
blocking gRPC client in another thread, as the kubelet would from its own process. Prints p50/p99.

    PYTHONPATH=. python hack/bench_deviceplugin.py [--calls 3000] [--gpus 8] [--replicas 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from sharing.inventory import Device, DeviceId, Health
from sharing.kubeletapi import deviceplugin_v1beta1_pb2 as api
from sharing.kubeletapi import deviceplugin_v1beta1_pb2_grpc as api_grpc
from sharing.model import GpuUuid
from sharing.serve.plugin import PluginServer


def devices(gpus: int, replicas: int) -> tuple[Device, ...]:
    return tuple(
        Device(DeviceId(f"GPU-{g:04d}::{n}"), Health.HEALTHY, g % 2, GpuUuid(f"GPU-{g:04d}"), replica=n)
        for g in range(gpus)
        for n in range(replicas)
    )


def measure(calls: int, call: Callable[[], object]) -> dict[str, float]:
    for _ in range(min(100, calls)):  # warm up the channel and caches
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return {
        "p50_us": round(statistics.median(samples), 1),
        "p99_us": round(samples[int(len(samples) * 0.99) - 1], 1),
        "max_us": round(samples[-1], 1),
    }


def client(socket: Path, ids: list[str], calls: int) -> dict[str, dict[str, float]]:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = api_grpc.DevicePluginStub(channel)
        allocate = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=ids[:2])])
        preferred = api.PreferredAllocationRequest(
            container_requests=[
                api.ContainerPreferredAllocationRequest(
                    available_deviceIDs=ids, must_include_deviceIDs=ids[:1], allocation_size=4
                )
            ]
        )
        return {
            "Allocate": measure(calls, lambda: stub.Allocate(allocate)),
            "GetPreferredAllocation": measure(calls, lambda: stub.GetPreferredAllocation(preferred)),
        }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gs-bench-", dir="/tmp") as tmp:
        server = PluginServer("nvidia.com/gpu", Path(tmp))
        devs = devices(args.gpus, args.replicas)
        server.update(devs, fail_requests_greater_than_one=False)
        socket = await server.start()
        try:
            result = await asyncio.to_thread(client, socket, [d.id for d in devs], args.calls)
        finally:
            await server.stop()
    setup = {"calls": args.calls, "devices": len(devs), "available_in_preferred": len(devs), "size": 4}
    if args.json:
        print(json.dumps({"setup": setup, "latency": result}))
        return
    print(f"{args.calls} calls each, {len(devs)} devices ({args.gpus} GPUs x {args.replicas} replicas)")
    for rpc, stats in result.items():
        cols = "   ".join(f"{k.removesuffix('_us')} {v:>8.1f} us" for k, v in stats.items())
        print(f"  {rpc:<24} {cols}")


if __name__ == "__main__":
    asyncio.run(main())
