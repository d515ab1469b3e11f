"""The agent's HTTP port under a flood: does the liveness probe still answer within 1 s?

A real `sharing agent` (the fake NVIDIA driver; no API server and no kubelet: it serves what it has after
its 5 s grace), and traffic to 127.0.0.1 only: from 127.0.0.2 (an attacker elsewhere on the pod
network), `flood_idle` connections kept open that never send a byte (each one the agent closes is
reopened within REOPEN_EVERY_S) and `flood_rps` requests a second of /metrics; from 127.0.0.1 (the
kubelet, in a thread of its own with blocking sockets, so the flood's event loop does not delay
it) a /healthz every 0.25 s, for `flood_window_s`. Figures: the slowest /healthz (healthz_flood_s_max:
connect to last byte; a failed or 5 s probe counts as 5 s), how many were answered, the /metrics
answered per second, and the most descriptors the agent held (from /proc, at each probe).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from bench.procs import free_port, install_driver, start_agent, stop_process
from bench.report import Budget, Results, percentile, say
from sharing.gpu import simstate
from sharing.mig.catalog import default_catalog

AGENT_NOFILE = 1024
PROBE_EVERY_S = 0.25
REOPEN_EVERY_S = 0.5
PROBE_TIMEOUT_S = 5.0
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
"""


def bench_probes(tmp: Path, budget: Budget, results: Results) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The agent gets Linux's default soft limit (INR_OPEN_CUR, include/uapi/linux/fs.h), as a
    # container does unless its runtime raises it; the flood needs more than that itself.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(AGENT_NOFILE, hard), hard))
    try:
        agent, port = _start(tmp)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(budget.flood_idle + 512, hard)), hard))
    try:
        _wait_healthy(port, agent.pid)
        say(
            f"probes: {budget.flood_idle} idle connections + {budget.flood_rps} /metrics a second for "
            f"{budget.flood_window_s:.0f} s; /healthz every {PROBE_EVERY_S} s; the agent may open "
            f"{AGENT_NOFILE} descriptors"
        )
        probes, fds, scrapes, reopened = asyncio.run(_flood(port, agent.pid, budget))
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited ({agent.returncode}); see {tmp / 'agent.log'}")
    finally:
        stop_process(agent)
    _report(results, budget, probes=probes, fds=fds, scrapes=scrapes, reopened=reopened)


def _start(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    tmp.mkdir(parents=True, exist_ok=True)
    driver = tmp / "driver"
    catalog = default_catalog()
    simstate.init_state(install_driver(driver), [simstate.resolve_product(catalog, "A100-SXM4-40GB")] * 8)
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    plugin_dir = tmp / "plugins"
    plugin_dir.mkdir()
    port = free_port()
    agent = start_agent(
        node="bench", kubeconfig=kubeconfig, driver_root=driver, plugin_dir=plugin_dir,
        pod_resources=tmp / "no-kubelet.sock", log=tmp / "agent.log", http_port=port,
    )  # fmt: skip
    return agent, port


def _report(
    results: Results, budget: Budget, *, probes: list[float], fds: list[int], scrapes: int, reopened: int
) -> None:
    answered = [p for p in probes if p < PROBE_TIMEOUT_S]
    results.add("healthz_flood_s_max", max(probes))
    results.add("healthz_flood_s_p50", percentile(probes, 50))
    results.add("flood_metrics_per_s", scrapes / budget.flood_window_s)
    results.add("flood_agent_fds_max", max(fds))
    results.note("probes: /healthz answered", f"{len(answered)} of {len(probes)}")
    results.note("probes: idle connections the agent closed (reopened)", str(reopened))
    say(
        f"   /healthz max {max(probes):.3f} s, p50 {percentile(probes, 50):.3f} s; "
        f"{scrapes / budget.flood_window_s:.0f} /metrics/s answered; agent fds at most {max(fds)}"
    )


def _wait_healthy(port: int, pid: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the agent (pid {pid}) did not answer /healthz within {timeout_s:.0f} s")


FLOOD_FROM = ("127.0.0.2", 0)


async def _get(port: int, path: str, source: tuple[str, int] | None = None) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=source)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()


def _probe(port: int, pid: int, end: float, probes: list[float], fds: list[int]) -> None:
    """The kubelet's liveness probe, until `end`: seconds per /healthz into `probes`, and the
    agent's open descriptors at each probe into `fds`."""
    while time.monotonic() < end:
        started = time.monotonic()
        took = PROBE_TIMEOUT_S
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 5) as conn:
            conn.settimeout(PROBE_TIMEOUT_S)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while chunk := conn.recv(4096):
                answer += chunk
            if answer.startswith(b"HTTP/1.1 200"):
                took = time.monotonic() - started
        probes.append(took)
        with contextlib.suppress(OSError):
            fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        time.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - started)))


async def _flood(port: int, pid: int, budget: Budget) -> tuple[list[float], list[int], int, int]:
    end = time.monotonic() + budget.flood_window_s
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    reopened = 0
    scrapes = 0
    probes: list[float] = []
    fds: list[int] = []

    async def scrape() -> None:
        nonlocal scrapes
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(10):
                if (await _get(port, "/metrics", FLOOD_FROM)).startswith(b"HTTP/1.1 200"):
                    scrapes += 1

    async def keep_idle() -> None:
        nonlocal reopened
        while time.monotonic() < end:
            for i, (reader, writer) in enumerate(idle):
                if reader.at_eof() or writer.is_closing():
                    writer.close()
                    with contextlib.suppress(OSError):
                        idle[i] = await asyncio.open_connection("127.0.0.1", port, local_addr=FLOOD_FROM)
                        reopened += 1
            await asyncio.sleep(REOPEN_EVERY_S)

    for _ in range(budget.flood_idle):
        idle.append(await asyncio.open_connection("127.0.0.1", port, local_addr=FLOOD_FROM))
        reader = idle[-1][0]
        if reader.at_eof():
            break
    prober = asyncio.create_task(asyncio.to_thread(_probe, port, pid, end, probes, fds))
    tasks = [asyncio.create_task(keep_idle())]
    pending: set[asyncio.Task[None]] = set()
    interval, sent = 1 / budget.flood_rps, 0
    started = time.monotonic()
    while time.monotonic() < end:
        task = asyncio.create_task(scrape())
        pending.add(task)
        task.add_done_callback(pending.discard)
        sent += 1
        await asyncio.sleep(max(0.0, started + sent * interval - time.monotonic()))
    await asyncio.gather(prober, *tasks, *pending)
    for _, writer in idle:
        writer.close()
    return probes, fds, scrapes, reopened
