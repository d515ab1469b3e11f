"""The lab's processes (hack/lab/process.py): started with no Python code between fork and exec, a
server joins its cgroup and ends with the thread that started it, as it did when a `preexec_fn` did
both (that made subprocess fork rather than vfork, and grpc's fork handlers then aborted a child
while the test process had grpc threads busy)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.polling import poll, process

pytestmark = pytest.mark.integration

HACK = Path(__file__).resolve().parents[2] / "hack"


def test_a_started_process_joins_its_cgroup_and_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    procs = tmp_path / "cgroup.procs"  # a plain file stands in for the cgroup's: the child writes its PID
    starter = (
        "import pathlib, subprocess, sys\n"
        f"sys.path.insert(0, {str(HACK)!r})\n"
        "from lab.process import exec_prefix\n"
        f"prefix = exec_prefix(cgroup_procs=[pathlib.Path({str(procs)!r})])\n"
        "child = subprocess.Popen([*prefix, 'sleep', '600'])\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", starter], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        poll(
            "the child's PID in its cgroup",
            lambda: procs.read_text().strip() if procs.exists() else "",
            str(pid).__eq__,
        )
        # The same process becomes the command itself (the wrappers exec it), not a parent of it.
        poll("the command running", lambda: Path(f"/proc/{pid}/comm").read_text().strip(), "sleep".__eq__)
        parent.kill()
    poll(
        "the child ended with its parent",
        lambda: process(pid),
        lambda state: state is None or state[0] == "Z",
    )
