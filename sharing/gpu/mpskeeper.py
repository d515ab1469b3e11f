"""The MPS keeper: it starts the MPS control daemons for the agent, from a pod of its own, so that
they outlive the agent's container and its pod.

A daemon the agent starts itself lives in the agent's container: when that container's first
process ends (a crash, an OOM kill, a restart after a failed liveness probe), "the kernel terminates
all of the processes in the namespace via a SIGKILL signal" (pid_namespaces(7),
https://man7.org/linux/man-pages/man7/pid_namespaces.7.html; a pod's containers have a PID namespace
each unless the pod sets `shareProcessNamespace`: https://kubernetes.io/docs/tasks/configure-pod-container/share-process-namespace/),
and every MPS client on the node loses its server. So the agent asks the keeper, the node's pod of a
DaemonSet of its own, to run `nvidia-cuda-mps-control -d`: the daemon then lives in the keeper's
container, which neither a restart of the agent's container nor a new agent pod (a rolling update,
whose DaemonSet surges while the keeper's updates only on delete) touches. Everything else (limits,
reads, `quit`) the agent still does over the daemon's pipe directory, which both pods mount.

The wire: a unix socket in a directory on the node that both pods mount; one request per connection, one
JSON line `{"gpu": "GPU-<uuid>"}` (or `"MIG-<uuid>"`) of at most `MAX_REQUEST` bytes, answered by one
JSON line `{"status": N, "output": "..."}` (the tool's exit status and its output, bounded) or
`{"error": "..."}` (the request refused, or the tool could not be run). The UUID is checked strictly:
it becomes a path under mpsRoot.

Reaping: the keeper is PID 1 of its container, so a daemon becomes its child once `-d` has forked it
and exited, and so do the servers of a daemon that was killed ("This process becomes the parent of
any child processes that are orphaned": pid_namespaces(7)); outside a container it makes itself a
child subreaper for the same effect (prctl(2) PR_SET_CHILD_SUBREAPER,
https://man7.org/linux/man-pages/man2/prctl.2.html). It waits for them (`waitpid(-1)`) when SIGCHLD
says one ended. That wait and the wait of a `-d` invocation for its own child take one lock: a
`waitpid(-1)` in between could take the exit status the invocation waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Protocol

import structlog

from sharing.errors import BackendError
from sharing.gpu.mpscontrol import control_env
from sharing.model import GpuUuid
from sharing.text import bounded

log = structlog.get_logger(__name__)

MAX_REQUEST = 1024
"""Bytes of one request, its newline included (a request for a GPU takes 55)."""
MAX_ANSWER = 16 * 1024
OUTPUT_LIMIT = 2000
"""Characters of the tool's output that an answer carries."""
READ_S = 5.0
"""How long a connection has to send its request."""
MAX_CONNECTIONS = 8
"""Connections served at once; one more is answered with an error at once."""
CONNECT_WAIT_S = 3.0
"""How long the agent waits for a keeper whose socket is not there yet (the two containers start together)."""
REAP_EVERY_S = 10.0
"""A look for ended children even without SIGCHLD (signals of one kind that arrive together merge)."""
PR_SET_CHILD_SUBREAPER = 36
"""From <linux/prctl.h>."""

_GPU_UUID = re.compile(
    r"(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)
"""A whole GPU's UUID as NVML gives it (`sharing.model.GpuUuid`), or a MIG device's in NVIDIA's R470+
form (an on-demand MIG device a claim shares with MPS; MIG user guide, "Device Enumeration")."""


class RequestError(ValueError):
    """A request the keeper refuses; the message, sent back, says why."""


# ---- the wire (pure) ------------------------------------------------------------------------


def encode_request(gpu: str) -> bytes:
    """The request that asks for `gpu`'s control daemon."""
    return json.dumps({"gpu": gpu}).encode() + b"\n"


def parse_request(data: bytes) -> GpuUuid:
    """The GPU a request names; RequestError says what is wrong with it."""
    if len(data) > MAX_REQUEST:
        raise RequestError(f"a request is at most {MAX_REQUEST} bytes, not {len(data)}")
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("a request is UTF-8 text") from None
    except RecursionError:
        raise RequestError("a request is one flat JSON object, not nested values") from None
    except ValueError as err:
        raise RequestError(f"a request is one JSON object: {bounded(str(err), 100)}") from None
    if not isinstance(value, dict) or set(value) != {"gpu"}:
        raise RequestError(f'a request is {{"gpu": "GPU-<uuid>"}}, not {bounded(json.dumps(value), 100)}')
    gpu = value["gpu"]
    if not isinstance(gpu, str) or not _GPU_UUID.fullmatch(gpu):
        raise RequestError(
            f"{bounded(json.dumps(gpu), 80)} is not a GPU or MIG UUID "
            "(GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or MIG-...)"
        )
    return GpuUuid(gpu)


def parse_answer(data: bytes, where: Path) -> tuple[int, str]:
    """(exit status, output) from the answer of the keeper at `where`; BackendError with its error, or
    when it sent something else."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError, ValueError):
        value = None
    if isinstance(value, dict) and isinstance(value.get("error"), str):
        raise BackendError(f"the MPS keeper at {where}: {bounded(value['error'], 300)}")
    if isinstance(value, dict) and type(value.get("status")) is int and isinstance(value.get("output"), str):
        return value["status"], value["output"]
    raise BackendError(f"the MPS keeper at {where} sent no answer but {bounded(repr(data), 100)}")


# ---- the agent's side -----------------------------------------------------------------------


async def ask_keeper(path: Path, gpu: GpuUuid, *, timeout_s: float) -> tuple[int, str]:
    """Have the keeper at `path` start `gpu`'s control daemon: the tool's (exit status, output).

    BackendError when the keeper does not answer within `timeout_s` (after up to CONNECT_WAIT_S for
    its socket to appear), or refuses."""
    reader, writer = await _connect(path)
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(encode_request(gpu))
            await writer.drain()
            line = await reader.readuntil(b"\n")
    except TimeoutError:
        raise BackendError(f"the MPS keeper at {path} did not answer in {timeout_s:g} s") from None
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as err:
        raise BackendError(f"the MPS keeper at {path} did not answer: {bounded(str(err), 200)}") from err
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return parse_answer(line, path)


async def _connect(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_WAIT_S
    delay = 0.05
    while True:
        try:
            return await asyncio.open_unix_connection(str(path), limit=MAX_ANSWER)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            if loop.time() >= deadline:
                raise BackendError(
                    f"the MPS keeper does not answer at {path} ({err.strerror}): it is the node's pod of "
                    "the DaemonSet <release>-mps-keeper"
                ) from None
        except OSError as err:
            raise BackendError(f"the MPS keeper at {path} cannot be reached: {err}") from err
        await asyncio.sleep(delay)  # its pod starts beside the agent's, with a deadline
        delay = min(delay * 2, 0.5)


# ---- the keeper -----------------------------------------------------------------------------


class Starter(Protocol):
    """What the server needs: start one GPU's daemon (blocking), the tool's (exit status, output)."""

    def start(self, gpu: GpuUuid) -> tuple[int, str]: ...


class Keeper:
    """Runs `nvidia-cuda-mps-control -d` for one GPU at a time, and waits for the children left to it."""

    def __init__(self, root: Path, control: Path, *, timeout_s: float = 10.0) -> None:
        self.root = root
        self.control = control
        self._timeout_s = timeout_s
        self._children = threading.Lock()
        """Held while `-d` runs and while ended children are waited for (the module says why)."""

    def start(self, gpu: GpuUuid) -> tuple[int, str]:
        """Start the GPU's daemon; BackendError when the tool cannot run or does not finish in time."""
        env = control_env(self.root, self.control, gpu, visible=True)
        with self._children:
            try:
                proc = subprocess.Popen(
                    [str(self.control), "-d"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            except OSError as err:
                raise BackendError(f"{self.control} cannot be run: {err}") from err
            try:
                out, _ = proc.communicate(timeout=self._timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise BackendError(f"{self.control} -d did not finish in {self._timeout_s:g} s") from None
        return proc.returncode, out.decode("utf-8", "replace")

    def reap(self) -> list[tuple[int, int]]:
        """Wait for every child that has ended: (PID, exit code; minus the signal that ended it)."""
        reaped = []
        with self._children:
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                reaped.append((pid, os.waitstatus_to_exitcode(status)))
        return reaped


def become_subreaper() -> bool:
    """Make orphaned descendants children of this process, also when it is not PID 1."""
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


async def run_keeper(path: Path, keeper: Keeper, stop: asyncio.Event) -> None:
    """Serve requests on `path` and wait for ended children until `stop` is set."""
    log.info("mps_keeper_starting", socket=str(path), control=str(keeper.control), mps_root=str(keeper.root))
    if os.getpid() != 1 and not become_subreaper():
        log.warning("mps_keeper_not_subreaper", error=os.strerror(ctypes.get_errno()))
    wake = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGCHLD, wake.set)
    reaper = asyncio.create_task(_reap(keeper, wake))
    try:
        await serve_keeper(path, keeper, stop)
    finally:
        reaper.cancel()
        loop.remove_signal_handler(signal.SIGCHLD)
    log.info("mps_keeper_stopped", note="the daemons it started end with its container")


async def _reap(keeper: Keeper, wake: asyncio.Event) -> None:
    while True:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REAP_EVERY_S):
                await wake.wait()
        wake.clear()  # before the look: a SIGCHLD during it wakes the next one
        for pid, code in await asyncio.to_thread(keeper.reap):
            log.info("mps_keeper_reaped", pid=pid, exit_code=code)


async def serve_keeper(path: Path, keeper: Starter, stop: asyncio.Event) -> None:
    """Answer start requests on the unix socket `path` until `stop` is set."""
    if path.is_socket():
        path.unlink()  # left by a keeper that was killed
    busy = 0

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal busy
        busy += 1
        try:
            if busy > MAX_CONNECTIONS:
                answer: dict[str, Any] = {"error": f"busy: {MAX_CONNECTIONS} requests are being served"}
            else:
                answer = await _answer(reader, keeper)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except OSError:
            pass  # the caller went away: nobody to answer
        finally:
            busy -= 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        server = await asyncio.start_unix_server(one, str(path), limit=MAX_REQUEST)
        path.chmod(0o600)
    except OSError as err:
        raise BackendError(f"the MPS keeper cannot serve on {path}: {err}") from err
    log.info("mps_keeper_serving", socket=str(path))
    async with server:
        await stop.wait()
    path.unlink(missing_ok=True)


async def _answer(reader: asyncio.StreamReader, keeper: Starter) -> dict[str, Any]:
    try:
        async with asyncio.timeout(READ_S):
            line = await reader.readuntil(b"\n")
        gpu = parse_request(line)
    except asyncio.LimitOverrunError:
        error = f"a request is one line of at most {MAX_REQUEST} bytes"
    except asyncio.IncompleteReadError:
        error = "the request ended before its newline"
    except TimeoutError:
        error = f"no request came within {READ_S:g} s"
    except RequestError as err:
        error = str(err)
    else:
        try:
            status, out = await asyncio.to_thread(keeper.start, gpu)
        except BackendError as err:
            log.error("mps_keeper_start_failed", gpu=gpu, error=str(err))
            return {"error": str(err)}
        log.info("mps_keeper_started", gpu=gpu, status=status, output=bounded(out.strip(), 300) or None)
        return {"status": status, "output": bounded(out, OUTPUT_LIMIT)}
    log.warning("mps_keeper_refused", error=error)
    return {"error": error}
