"""The MPS keeper without a GPU: what it accepts on its socket, what it answers to anything else, and
that it waits for the children left to it without taking the exit status of the `-d` it runs.

The reaping tests run `sharing mps-keeper` as a process of its own (it makes itself a child
subreaper, which a test process must not) over a stand-in for `nvidia-cuda-mps-control`: a script
that leaves orphans behind and exits with a status of its own, as `-d` leaves its daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sharing.errors import BackendError
from sharing.gpu import mpskeeper
from sharing.gpu.mpscontrol import CONTROL
from sharing.gpu.mpskeeper import RequestError, ask_keeper, parse_answer, parse_request, serve_keeper
from sharing.model import GpuUuid
from tests.polling import live_parent, poll, process

REPO = Path(__file__).resolve().parents[2]
GPU = GpuUuid("GPU-5a0c1e2d-9b3f-4e6a-8d7c-0123456789ab")


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(b'{"gpu": "GPU-5a0c1e2d-9b3f-4e6a-8d7c-0123456789ab"}\n', id="lower-hex"),
        pytest.param(b'{"gpu":"GPU-5A0C1E2D-9B3F-4E6A-8D7C-0123456789AB"}\r\n', id="upper-hex-crlf"),
    ],
)
def test_a_request_names_one_gpu_by_its_uuid(request_: bytes) -> None:
    assert GPU.lower() == parse_request(request_).lower()


def test_a_request_names_an_on_demand_mig_device_by_its_uuid() -> None:
    mig = GPU.replace("GPU-", "MIG-")
    assert mig == parse_request(json.dumps({"gpu": mig}).encode() + b"\n")


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        pytest.param(b"", "a request is one JSON object: Expecting value", id="empty"),
        pytest.param(b"start GPU-0\n", "a request is one JSON object", id="not-json"),
        pytest.param(b'{"gpu": "\xff"}\n', "a request is UTF-8 text", id="not-utf8"),
        pytest.param(b'["GPU-0"]\n', 'a request is {"gpu": "GPU-<uuid>"}, not ["GPU-0"]', id="array"),
        pytest.param(b"{}\n", 'a request is {"gpu": "GPU-<uuid>"}, not {}', id="no-gpu"),
        pytest.param(
            b'{"gpu": "GPU-5a0c1e2d-9b3f-4e6a-8d7c-0123456789ab", "env": {"LD_PRELOAD": "/x"}}\n',
            'a request is {"gpu": "GPU-<uuid>"}, not {"gpu": ',
            id="extra-key",
        ),
        pytest.param(
            b'{"gpu": "' + b"a" * 2000 + b'"}\n', "a request is at most 1024 bytes, not 2012", id="long"
        ),
    ],
)
def test_anything_else_is_refused_with_a_bounded_reason(request_: bytes, message: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse_request(request_)
    assert message in str(refused.value)
    assert len(str(refused.value)) < 300


NOT_UUIDS = {
    "index": 0,
    "path": "../../etc",
    "path-after": f"{GPU}/../x",
    "old-mig-form": f"MIG-{GPU}/1/0",  # MIG-GPU-<uuid>/<gi>/<ci> before R470: a path
    "newline": f"{GPU}\n",
    "nested": [[[[[[[[[[]]]]]]]]]] * 20,
}


@pytest.mark.parametrize("gpu", NOT_UUIDS.values(), ids=NOT_UUIDS.keys())
def test_the_gpu_is_named_by_its_uuid_and_nothing_else(gpu: object) -> None:
    with pytest.raises(RequestError) as refused:
        parse_request(json.dumps({"gpu": gpu}).encode() + b"\n")
    assert f"{json.dumps(gpu)[:80]}" in str(refused.value)
    assert str(refused.value).endswith(
        "is not a GPU or MIG UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx or MIG-...)"
    )


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        pytest.param(b'{"status": 0, "output": ""}\n', (0, ""), id="started"),
        pytest.param(
            b'{"status": 1, "output": "An instance of this daemon is already running\\n"}\n',
            (1, "An instance of this daemon is already running\n"),
            id="tool-failed",
        ),
        pytest.param(b'{"error": "busy"}\n', "the MPS keeper at /k: busy", id="refused"),
        pytest.param(b'{"status": true, "output": ""}\n', "sent no answer but", id="bool-status"),
        pytest.param(b"<html>\n", "sent no answer but", id="garbage"),
    ],
)
def test_the_agent_reads_an_answer_or_says_what_it_got(answer: bytes, expected: object) -> None:
    if isinstance(expected, tuple):
        assert expected == parse_answer(answer, Path("/k"))
        return
    with pytest.raises(BackendError) as failed:
        parse_answer(answer, Path("/k"))
    assert str(expected) in str(failed.value)


# ---- the server, in this process, over a stand-in for the tool -------------------------------


class Started:
    """A keeper that records what it was asked to start and answers as `-d` would."""

    def __init__(self) -> None:
        self.gpus: list[GpuUuid] = []

    def start(self, gpu: GpuUuid) -> tuple[int, str]:
        self.gpus.append(gpu)
        return 0, ""


@pytest.fixture
def short_path() -> Iterator[Path]:
    """A socket path short enough for AF_UNIX (tmp_path may not be)."""
    with tempfile.TemporaryDirectory(prefix="gs-k-", dir="/tmp") as where:
        yield Path(where) / "keeper.sock"


@pytest.fixture
async def served(short_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Path, Started]]:
    monkeypatch.setattr(mpskeeper, "READ_S", 0.3)
    started = Started()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_keeper(short_path, started, stop))
    for _ in range(100):
        if short_path.is_socket():
            break
        await asyncio.sleep(0.01)
    yield short_path, started
    stop.set()
    await task
    assert not short_path.exists()


def exchange(path: Path, data: bytes, *, close: bool = True) -> dict[str, object]:
    """Send `data` (then end the connection's sending side, unless not `close`); the answer."""
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(10)
        client.connect(str(path))
        with contextlib.suppress(OSError):  # the keeper stops reading a request that is too long
            client.sendall(data)
            if close:
                client.shutdown(socket.SHUT_WR)
        with client.makefile("rb") as answer:
            parsed: dict[str, object] = json.loads(answer.readline())
    return parsed


async def test_hostile_connections_are_answered_and_the_next_request_is_served(
    served: tuple[Path, Started],
) -> None:
    path, started = served
    hostile = (
        (b"x" * 100_000, True, "a request is one line of at most 1024 bytes"),
        (b'{"gpu": ', True, "the request ended before its newline"),
        (b"", False, "no request came within 0.3 s"),
    )
    for data, close, error in hostile:
        assert {"error": error} == await asyncio.to_thread(exchange, path, data, close=close)
    refused = await asyncio.to_thread(exchange, path, b'{"gpu": "GPU-../../../dev/nvidia0"}\n')
    assert '"GPU-../../../dev/nvidia0" is not a GPU or MIG UUID' in str(refused["error"])
    assert [] == started.gpus
    assert (0, "") == await ask_keeper(path, GPU, timeout_s=5)
    assert [GPU] == started.gpus


async def test_a_keeper_whose_socket_is_not_there_fails_the_start_with_a_reason(
    short_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mpskeeper, "CONNECT_WAIT_S", 0.2)
    with pytest.raises(BackendError) as failed:
        await ask_keeper(short_path, GPU, timeout_s=1)
    assert f"the MPS keeper does not answer at {short_path} (No such file or directory)" in str(failed.value)
    assert "the node's pod of the DaemonSet <release>-mps-keeper" in str(failed.value)


async def test_a_keeper_that_waits_longer_than_the_agent_fails_the_start(short_path: Path) -> None:
    gone = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers: the agent gives up and closes first
        writer.close()
        gone.set()

    server = await asyncio.start_unix_server(silent, str(short_path))
    async with server:
        with pytest.raises(BackendError) as failed:
            await ask_keeper(short_path, GPU, timeout_s=0.2)
        await gone.wait()
    assert f"the MPS keeper at {short_path} did not answer in 0.2 s" == str(failed.value)


# ---- reaping: `sharing mps-keeper` as its own process ----------------------------------------

TOOL = """#!/bin/sh
# nvidia-cuda-mps-control -d, as far as the keeper can tell: it leaves processes behind (one that
# lives until killed, as a daemon does, and short ones that end about when it does), then exits 7.
(exec sleep 300) </dev/null >/dev/null 2>&1 &
echo "daemon $!"
echo $! >>"$(dirname "$0")/daemons"
for i in 1 2 3 4 5 6; do (exec sleep 0.0$i) </dev/null >/dev/null 2>&1 & echo "orphan $!"; done
echo "visible=$CUDA_VISIBLE_DEVICES pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY"
exit 7
"""


@pytest.fixture
def keeper(short_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """`sharing mps-keeper` over the stand-in; (its process, its socket, its MPS root)."""
    root = short_path.parent
    tool = root / "driver" / CONTROL
    tool.parent.mkdir(parents=True)
    tool.write_text(TOOL)
    tool.chmod(0o755)
    with open(root / "keeper.log", "wb") as logs:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sharing", "mps-keeper", "--driver-root", str(root / "driver"),
             "--mps-root", str(root / "mps"), "--log-format", "json"],
            env={**os.environ, "PYTHONPATH": str(REPO), "SHARING_MPS_KEEPER_SOCKET": str(short_path)},
            stdout=logs,
            stderr=logs,
        )  # fmt: skip
    try:
        poll("the keeper's socket", short_path.is_socket, bool, 30)
        yield proc, short_path, root / "mps"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        started = tool.with_name("daemons")
        for pid in started.read_text().split() if started.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_the_exit_status_of_d_is_answered_while_the_orphans_are_reaped(
    keeper: tuple[subprocess.Popen[bytes], Path, Path],
) -> None:
    proc, path, mps = keeper
    daemons, orphans = [], []
    for _ in range(15):
        answer = exchange(path, json.dumps({"gpu": GPU}).encode() + b"\n")
        assert 7 == answer["status"]  # a waitpid(-1) that took it would have made it 0
        lines = str(answer["output"]).splitlines()
        assert f"visible={GPU} pipe={mps}/{GPU}/pipe log={mps}/{GPU}/log" == lines[-1]
        daemons += [int(line.split()[1]) for line in lines if line.startswith("daemon ")]
        orphans += [int(line.split()[1]) for line in lines if line.startswith("orphan ")]
    # The daemons are the keeper's children once -d has exited (it is their subreaper) ...
    assert {proc.pid} == {live_parent(pid) for pid in daemons}
    for pid in daemons:
        os.kill(pid, signal.SIGKILL)
    # ... and nothing it was left stays a zombie.
    poll(
        "every orphan waited for",
        lambda: [process(p) for p in orphans + daemons],
        lambda s: not any(s),
        30,
    )


def test_sigterm_stops_the_keeper_and_removes_its_socket(
    keeper: tuple[subprocess.Popen[bytes], Path, Path],
) -> None:
    proc, path, _ = keeper
    proc.send_signal(signal.SIGTERM)
    assert 0 == proc.wait(timeout=30)
    assert not path.exists()
    events = [json.loads(line)["event"] for line in (path.parent / "keeper.log").read_text().splitlines()]
    assert ["mps_keeper_starting", "mps_keeper_serving", "mps_keeper_stopped"] == events
