"""Server processes: start with output in a log file, wait for readiness, stop by recorded PID.

A process the lab leaves running (a detached demo) is stopped later from its record alone: the PID
plus the kernel's start time of that PID, so a recycled PID is never signalled by mistake.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lab.deadlines import scaled
from lab.errors import ClusterError

STOP_TIMEOUT = 20.0
LOG_TAIL_LINES = 30


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, or why it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot); None when it does not exist or
    has exited (a zombie waiting for its parent, which may be init, to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields after the last ')' do not.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


@dataclass(frozen=True)
class PidRecord:
    """A started process as a state file keeps it: name, PID and the PID's start time."""

    name: str
    pid: int
    start: int

    def alive(self) -> bool:
        """True while this very process runs (a recycled PID has another start time)."""
        return start_time(self.pid) == self.start

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """SIGTERM, then SIGKILL after ``timeout``; True when it was running."""
        if not self.alive():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            _reap(self.pid)
            time.sleep(0.05)
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            while self.alive():
                _reap(self.pid)
                time.sleep(0.02)
        return True

    def signal(self, sig: int) -> None:
        """Send ``sig`` if this very process still runs."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> PidRecord:
        return cls(str(data["name"]), int(str(data["pid"])), int(str(data["start"])))


def stop_all(records: Sequence[PidRecord], timeout: float = 5.0) -> list[str]:
    """SIGTERM all at once (a fast teardown), SIGKILL what is left after ``timeout``; return the
    names of those that were running."""
    alive = [r for r in records if r.alive()]
    for r in alive:
        r.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(r.alive() for r in alive) and time.monotonic() < deadline:
        for r in alive:
            _reap(r.pid)
        time.sleep(0.05)
    for r in alive:
        if r.alive():
            r.stop(timeout=0)
    return [r.name for r in alive]


def _reap(pid: int) -> None:
    # A child of this process stays a zombie (and "alive") until waited for.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def exec_prefix(*, die_with_parent: bool = True, cgroup_procs: Sequence[Path] = ()) -> list[str]:
    """What to put before a command so that, without Python code between fork and exec, it joins
    `cgroup_procs` and gets SIGTERM when the thread that started it exits (PR_SET_PDEATHSIG, kept
    across exec): if the test process dies (even by SIGKILL), its servers do not linger.

    Not `preexec_fn`: that makes subprocess fork() rather than vfork(), so grpc's fork handlers run in
    the child, and with grpc threads busy in the parent a child aborted there ("Epoll1Poller
    encountered epoll_wait error: Bad file descriptor", SIGABRT) before it ran what it was for."""
    prefix: list[str] = []
    if cgroup_procs:
        into = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1"; shift; n=$((n - 1)); done; exec "$@"'
        prefix += ["sh", "-c", into, "sh", str(len(cgroup_procs)), *map(str, cgroup_procs)]
    if die_with_parent:
        prefix += ["setpriv", "--pdeathsig", "TERM", "--"]
    return prefix


class Process:
    """A server process with its output in a log file.

    ``launcher`` is put before ``args`` (e.g. ``nsenter`` into the node's namespaces; it execs, so
    the PID stays the server's). ``cgroup_procs`` are ``cgroup.procs`` files the child joins before
    it execs, so everything it forks can be found and killed later. Detached processes get their
    own session and outlive the caller; the others die with it.
    """

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log: Path,
        *,
        detached: bool = False,
        launcher: Sequence[str] = (),
        cgroup_procs: Sequence[Path] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log = log
        self.detached = detached
        self.launcher = list(launcher)
        self.cgroup_procs = list(cgroup_procs)
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # The kernel signals when the *thread* that started the child exits: asked for only from the
        # main thread (a worker thread, e.g. asyncio.to_thread, may exit early).
        die_with_us = not self.detached and threading.current_thread() is threading.main_thread()
        prefix = exec_prefix(die_with_parent=die_with_us, cgroup_procs=self.cgroup_procs)
        with open(self.log, "ab") as out:
            out.write(f"\n==== {time.strftime('%H:%M:%S')} starting {' '.join(self.args)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [*prefix, *self.launcher, *self.args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=self.detached,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def record(self) -> PidRecord:
        """What a state file keeps to stop this process later."""
        start = start_time(self.pid)
        if start is None:
            raise self.fail(f"{self.name} is not running")
        return PidRecord(self.name, self.pid, start)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def fail(self, what: str) -> ClusterError:
        status = ""
        if self.proc is not None and self.proc.poll() is not None:
            status = f" ({self.name} exited with code {self.proc.returncode})"
        return ClusterError(
            f"{what}{status}\n--- last {LOG_TAIL_LINES} lines of {self.log} ---\n{tail(self.log)}"
        )

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def forget(self) -> None:
        """Leave the process running and drop the handle (a detached demo outlives this Python);
        it is stopped later through its ``record()``."""
        if self.proc is not None:
            # Not waited for here, by design: keep Popen from warning that it still runs.
            self.proc.returncode = 0
        self.proc = None


def wait_until(
    check: Callable[[], bool], proc: Process, what: str, timeout: float, deadline: float | None = None
) -> None:
    """Poll ``check`` with backoff until it is true; fail early if ``proc`` exits. ``timeout`` is
    for an idle machine (`lab.deadlines`); an absolute ``deadline`` is taken as it is."""
    timeout = scaled(timeout)
    end = deadline if deadline is not None else time.monotonic() + timeout
    delay = 0.05
    while True:
        if not proc.running():
            raise proc.fail(f"{proc.name} exited while waiting for {what}")
        with contextlib.suppress(OSError, http.client.HTTPException, ssl.SSLError):
            if check():
                return
        if time.monotonic() >= end:
            raise proc.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
