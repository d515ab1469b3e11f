"""Processes the bench starts and reads: the agent as the DaemonSet runs it, and /proc figures.

Every child gets SIGTERM when the bench dies (PR_SET_PDEATHSIG, `lab.process.exec_prefix`), so an
interrupted run leaves nothing behind; CPU and memory are read from /proc, the same numbers `top` shows.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lab.process import exec_prefix

REPO = Path(__file__).resolve().parents[2]
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def stop_process(proc: subprocess.Popen[Any] | None, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL after `timeout`."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_all(procs: Sequence[subprocess.Popen[Any]], timeout: float = 15) -> None:
    """SIGTERM every one at once, then wait (a fleet stops in seconds, not N times that)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        stop_process(proc, timeout)


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def thread_cpu_seconds(pid: int, name: str) -> float:
    """utime + stime so far of the process's threads called `name` (/proc/PID/task/TID/comm)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != name:
                continue
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        total += int(fields[11]) + int(fields[12])
    return total / _CLOCK_TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def install_driver(root: Path) -> Path:
    """The fake NVIDIA driver installed under `root` (a node's driver root); its state file's path."""
    subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh"), "--install", str(root)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return root / "var/lib/fake-nvidia/gpus.json"


def in_process_driver(tmp: Path) -> tuple[Path, Path]:
    """(root, state file) of the fake driver that parts calling NVML in this process share: pynvml
    binds one libnvidia-ml.so.1 per process (`sharing.gpu.nvmllib.preload`). Each part makes its GPUs."""
    root = tmp / "in-process-driver"
    return root, install_driver(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_agent(
    *,
    node: str,
    kubeconfig: Path,
    driver_root: Path,
    plugin_dir: Path,
    pod_resources: Path,
    log: Path,
    http_port: int,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """`sharing agent` on the fake driver under `driver_root`, as the DaemonSet runs it (its own
    journal, CDI dir and port beside the root; `http_port` 0 serves no HTTP); `env` is added to ours."""
    args = [
        "--node-name", node,
        "--kubeconfig", str(kubeconfig),
        "--driver-root", str(driver_root),
        "--device-plugin-dir", str(plugin_dir),
        "--pod-resources-socket", str(pod_resources),
        "--journal", str(driver_root.with_suffix(".journal")),
        "--cdi-spec-dir", str(driver_root.with_suffix(".cdi")),
        "--log-format", "json",
        "--http-port", str(http_port),
        *extra,
    ]  # fmt: skip
    environ = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        return subprocess.Popen(
            [*exec_prefix(), sys.executable, "-m", "sharing", "agent", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=REPO,
        )
