"""Allocate and GetPreferredAllocation through the kubelet's device manager, against a peer.

The peer is the Go stub device plugin (hack/go/k8s/stubplugin, `--quiet`: no log line per call,
as a production plugin writes none), registered with the same harness at the same time, with the
same number of devices and preferred allocation on. Pods are admitted one at a time through the
harness (POST /pods: GetPreferredAllocation + Allocate over the plugin's socket, the kubelet's own
code), alternating ours and the stub's pod by pod, the order swapped every pair, so load from
anything else on the machine hits both alike; each pod is deleted untimed.

- allocate_ms_*, allocate_vs_stub_*: a pod asking for 1 of the node's time-sliced GPUs
  (4 GPUs x 2 or 3 replicas); the ratio is ours / the stub's at the same percentile, per run.
- preferred_vs_stub_p99: a pod asking for 4 of 512 (8 GPUs x 64 replicas), the case where
  GetPreferredAllocation has the most to choose from.
- preferred_ms_p99: direct GetPreferredAllocation (size 4 of 512) on our socket from a Python gRPC
  client; the same call on the stub's socket is shown beside it, and direct Allocate too.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import lab

from bench.clients import Harness
from bench.cluster import Cluster
from bench.expect import nothing_allocatable
from bench.report import Budget, Results, percentile, say
from sharing.kubelet.api import deviceplugin_v1beta1_pb2 as api
from sharing.kubelet.api import deviceplugin_v1beta1_pb2_grpc as api_grpc

STUB_RESOURCE = "bench.example.com/stub"
OURS = "nvidia.com/gpu"


def interleaved(harness: Harness, pods: int, size: int) -> tuple[list[float], list[float]]:
    """Admission milliseconds of `pods` pods each asking `size` devices: (ours, the stub's)."""
    ours, stubs = [], []
    for i in range(pods):
        first, second = (
            ((OURS, ours), (STUB_RESOURCE, stubs)) if i % 2 else ((STUB_RESOURCE, stubs), (OURS, ours))
        )
        for resource, samples in (first, second):
            samples.append(harness.admit(f"p{i}-{len(samples)}", {resource: str(size)}))
    return ours, stubs


def _with_stub(env: Cluster, devices: int) -> lab.StubDevicePlugin:
    stub = lab.StubDevicePlugin(
        env.kubelet.device_plugin_dir, STUB_RESOURCE, [f"Stub-{n:04d}" for n in range(devices)],
        preferred=True, quiet=True,
    ).start()  # fmt: skip
    env.wait_resources(lambda r: r.get(STUB_RESOURCE, {}).get("allocatable") == devices, 30)
    return stub


def bench_allocate(env: Cluster, budget: Budget, results: Results, replicas: int) -> None:
    devices = len(env.gpus) * replicas
    say(
        f"allocate: {budget.allocate_runs} runs x {budget.allocate_pods} pods each, ours and the Go stub's "
        f"interleaved ({devices} devices each, 1 per pod)"
    )
    stub = _with_stub(env, devices)
    harness = Harness(env.kubelet.control_socket)
    try:
        empty = [harness.admit(f"e{i}", {}) for i in range(budget.allocate_pods // 5)]
        results.note(
            "allocate: harness admission of a pod without devices p50/p99 (the harness's own cost)",
            f"{percentile(empty, 50):.3f}/{percentile(empty, 99):.3f} ms",
        )
        for _ in range(budget.allocate_runs):
            ours, stubs = interleaved(harness, budget.allocate_pods, 1)
            for q in (50, 99):
                results.add(f"allocate_ms_p{q}", percentile(ours, q))
                results.add(f"allocate_vs_stub_p{q}", percentile(ours, q) / percentile(stubs, q))
                results.add(f"_stub_allocate_p{q}", percentile(stubs, q))
        results.note(
            "allocate: the Go stub's admissions p50/p99 (median of runs)",
            f"{results.value('_stub_allocate_p50'):.3f}/{results.value('_stub_allocate_p99'):.3f} ms",
        )
        ids = env.kubelet.resources()["resources"][OURS]["healthy"]
        for what, sock, device in (
            ("our", plugin_socket(env.kubelet.device_plugin_dir, OUR_SOCKET), ids[0]),
            ("the stub's", plugin_socket(env.kubelet.device_plugin_dir, STUB_SOCKET), "Stub-0000"),
        ):
            direct = grpc_latency(sock, budget.allocate_pods, allocate=[device])
            results.note(
                f"allocate: direct gRPC Allocate on {what} socket p50/p99 (Python client)",
                f"{percentile(direct, 50):.3f}/{percentile(direct, 99):.3f} ms",
            )
    finally:
        harness.close()
        stub.stop()
    env.wait_resources(nothing_allocatable([STUB_RESOURCE]), 30)


def bench_preferred(env: Cluster, budget: Budget, results: Results) -> None:
    ids = env.kubelet.resources()["resources"][OURS]["healthy"]
    say(
        f"preferred: {budget.preferred_runs} runs x {budget.preferred_pods} pods each asking 4 of "
        f"{len(ids)}, ours and the Go stub's interleaved; direct calls"
    )
    stub = _with_stub(env, len(ids))
    harness = Harness(env.kubelet.control_socket)
    try:
        for _ in range(budget.preferred_runs):
            ours, stubs = interleaved(harness, budget.preferred_pods, 4)
            results.add("preferred_vs_stub_p99", percentile(ours, 99) / percentile(stubs, 99))
            results.add("_preferred_admit_p99", percentile(ours, 99))
            results.add("_preferred_stub_admit_p99", percentile(stubs, 99))
        results.note(
            "preferred: admissions asking 4 of 512, ours / the stub's p99 (median of runs)",
            f"{results.value('_preferred_admit_p99'):.3f} / "
            f"{results.value('_preferred_stub_admit_p99'):.3f} ms",
        )
        stub_ids = [f"Stub-{n:04d}" for n in range(len(ids))]
        ours_sock = plugin_socket(env.kubelet.device_plugin_dir, OUR_SOCKET)
        stub_sock = plugin_socket(env.kubelet.device_plugin_dir, STUB_SOCKET)
        for _ in range(budget.preferred_runs):
            samples = grpc_latency(ours_sock, budget.preferred_pods * 2, preferred=(ids, 4))
            results.add("preferred_ms_p99", percentile(samples, 99))
            results.add("_preferred_p50", percentile(samples, 50))
        theirs = grpc_latency(stub_sock, budget.preferred_pods * 2, preferred=(stub_ids, 4))
        results.note(
            "preferred: direct GetPreferredAllocation 4 of 512, ours p50 / the stub's p50/p99 (Python)",
            f"{results.value('_preferred_p50'):.3f} / "
            f"{percentile(theirs, 50):.3f}/{percentile(theirs, 99):.3f} ms",
        )
    finally:
        harness.close()
        stub.stop()


OUR_SOCKET = r"gpu-sharing-gpu-[0-9a-f]{8}\.sock"
STUB_SOCKET = r"stub-.*\.sock"


def plugin_socket(plugin_dir: Path, pattern: str) -> Path:
    """The newest socket in the plugin directory whose name matches `pattern`."""
    found = [p for p in plugin_dir.glob("*.sock") if re.fullmatch(pattern, p.name)]
    if not found:
        raise RuntimeError(f"no plugin socket {pattern} in {plugin_dir}")
    return max(found, key=lambda p: p.stat().st_mtime)


def grpc_latency(
    sock: Path,
    calls: int,
    *,
    allocate: list[str] | None = None,
    preferred: tuple[list[str], int] | None = None,
) -> list[float]:
    """Milliseconds per call of Allocate(`allocate`) or GetPreferredAllocation(available, size)."""
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        stub = api_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        call: Callable[..., Any]
        if allocate is not None:
            req: Any = api.AllocateRequest(
                container_requests=[api.ContainerAllocateRequest(devices_ids=allocate)]
            )
            call = stub.Allocate
        else:
            assert preferred is not None
            available, size = preferred
            req = api.PreferredAllocationRequest(
                container_requests=[
                    api.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available, allocation_size=size
                    )
                ]
            )
            call = stub.GetPreferredAllocation
        for _ in range(min(100, calls)):  # warm the channel
            call(req, timeout=10)
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            call(req, timeout=10)
            samples.append((time.perf_counter() - start) * 1e3)
    return samples
