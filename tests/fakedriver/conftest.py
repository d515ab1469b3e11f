"""Fixtures for the fake NVIDIA driver's own tests: the built driver, its state, a pynvml worker.

The driver is built once per session by hack/fakedriver/build.sh (never skipped: a build failure
fails the tests). Each test makes its GPUs with `sharing sim init` (the command line the state
contract belongs to) and talks to the library through nvidia-ml-py in a worker subprocess of its
own (pynvml loads libnvidia-ml.so.1 once per process), so every test starts from a fresh library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.conftest import fleet, kubelet, plugin_dir  # noqa: F401  (the unit tests' fake kubelet, fleet, dir)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


class NvmlError(Exception):
    """An NVML return code raised by a pynvml wrapper in the worker."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"NVML error {code}: {text}")
        self.code = code


@pytest.fixture(scope="session")
def driver_root() -> Path:
    """The fake driver's root (usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1, usr/bin/nvidia-smi)."""
    built = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh")], capture_output=True, text=True, check=False
    )
    if built.returncode != 0:
        pytest.fail(f"hack/fakedriver/build.sh failed:\n{built.stderr}")
    return Path(built.stdout.strip())


def driver_env(root: Path, state: Path) -> dict[str, str]:
    """The environment of a process that loads the fake driver over `state`."""
    return {
        **os.environ,
        "LD_LIBRARY_PATH": str(root / "usr/lib/x86_64-linux-gnu"),
        "FAKE_NVML_STATE": str(state),
        "PYTHONPATH": str(REPO),
    }


def sim(state: Path, *args: str) -> str:
    """Run `sharing sim ARGS --sim-state STATE`; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "sharing", "sim", args[0], "--sim-state", str(state), *args[1:]],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


PERSONALITIES = ("r580", "r535")
"""The driver branches the fake driver plays (hack/fakedriver/README.md, "Personalities")."""


class State:
    """One fake machine: its state file (under a driver-root layout) and its files."""

    def __init__(self, root: Path, personality: str) -> None:
        self.root = root
        self.path = root / "var/lib/fake-nvidia/gpus.json"
        self.personality = personality

    def init(self, gpus: str, *flags: str, **fields: Any) -> list[str]:
        """`sharing sim init --gpus GPUS FLAGS`, then set top-level FIELDS; the GPU UUIDs.

        The personality is the test's parameter unless FIELDS name one.
        """
        out = sim(self.path, "init", "--gpus", gpus, *flags)
        changes = {"personality": self.personality, **fields}
        self.edit(lambda state: state.update(changes))
        return [line.split()[-1] for line in out.splitlines()]

    def read(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.path.read_text())
        return data

    def edit(self, change: Callable[[dict[str, Any]], object]) -> None:
        """Change the state as a writer does: a new file renamed over the old one."""
        state = self.read()
        change(state)
        tmp = self.path.with_name(".edit.tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.path)

    def sim(self, *args: str) -> str:
        return sim(self.path, *args)


@pytest.fixture(params=PERSONALITIES)
def machine(tmp_path: Path, request: pytest.FixtureRequest) -> State:
    """A fake machine; every test runs on each personality (those about one branch name it)."""
    return State(tmp_path / "node", request.param)


class Nvml:
    """pynvml in a worker process over the fake driver: `call(NAME, *args)` as pynvml.NAME(*args)."""

    def __init__(self, root: Path, state: State, env: dict[str, str] | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env or driver_env(root, state.path),
        )
        self.out: list[Any] = []

    def send(self, name: str, *args: Any) -> None:
        """Start pynvml.NAME(*args) in the worker; `receive()` waits for its result."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"call": name, "args": list(args)}) + "\n")
        self._proc.stdin.flush()

    def call(self, name: str, *args: Any) -> Any:
        """The wrapper's result; NvmlError for an NVML error. Output arrays/counters: `.out`."""
        self.send(name, *args)
        return self.receive()

    def receive(self) -> Any:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        assert line, f"the pynvml worker died (exit {self._proc.wait()})"
        reply = json.loads(line)
        self.out = reply["out"]
        if "error" in reply:
            raise NvmlError(reply["error"], reply["text"])
        return reply["value"]

    def code(self, name: str, *args: Any) -> int:
        """The NVML error code the call raises (0 when it succeeds)."""
        try:
            self.call(name, *args)
        except NvmlError as err:
            return err.code
        return 0

    def close(self) -> None:
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
        self._proc.stdout.close()


@pytest.fixture
def nvml_for(driver_root: Path) -> Iterator[Callable[[State], Nvml]]:
    """Start pynvml workers over a machine's state (already initialised with nvmlInit)."""
    workers: list[Nvml] = []

    def start(state: State) -> Nvml:
        worker = Nvml(driver_root, state)
        workers.append(worker)
        worker.call("nvmlInit")
        return worker

    yield start
    for worker in workers:
        worker.close()


# ---- in this process: the agent's own backend over the real pynvml ---------------------------


@pytest.fixture(scope="session")
def node_root(driver_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test process's node: a driver root with the fake driver installed (`build.sh --install`).

    pynvml loads one libnvidia-ml.so.1 per process, and the library finds its state next to itself
    (dladdr), so every in-process test shares this root; each one makes its GPUs afresh (`state`)."""
    root = tmp_path_factory.mktemp("node")
    done = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh"), "--install", str(root)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"hack/fakedriver/build.sh --install failed:\n{done.stderr}")
    return root


@pytest.fixture
def state(node_root: Path) -> Path:
    """Where this test writes its GPUs (`simstate.init_state`), replacing the last test's."""
    return node_root / "var/lib/fake-nvidia/gpus.json"


@pytest.fixture
def nvml(node_root: Path) -> Any:
    """The real pynvml, bound to this process's fake driver the way the agent binds it."""
    from sharing.gpu.nvml import load_pynvml  # noqa: PLC0415

    return load_pynvml(node_root)


def make_gpu_instance(nvml: Any, gpu: int, profile_id: int, start: int, size: int) -> None:
    """A GPU instance without its compute instance: what an agent killed half-way leaves behind."""
    import ctypes  # noqa: PLC0415

    nvml.nvmlInit()  # another NVML user (reference counted)
    try:
        placement = nvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, ctypes.byref(placement))
    finally:
        nvml.nvmlShutdown()
