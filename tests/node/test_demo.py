"""The README's first command, end to end: `hack/demo.sh` brings up its node, installs the chart,
runs a pod with a MIG slice, and Ctrl-C stops every process it started within 3 seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import lab
import pytest

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 3.0


def test_the_demo_shows_a_pod_with_a_mig_slice_and_ctrl_c_stops_everything(
    cluster_binaries: lab.Binaries,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the real node needs root")
    demo = subprocess.Popen(
        [str(REPO / "hack" / "demo.sh")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert demo.stdout is not None
    lines: list[str] = []
    try:
        for line in demo.stdout:  # ends when the demo exits (a failure) or says it runs
            lines.append(line)
            if line.startswith("The demo runs until Ctrl-C."):
                break
        output = "".join(lines)
        assert "The demo runs until Ctrl-C." in output, output[-3000:]
        assert "pod mig-demo sees NVIDIA_VISIBLE_DEVICES=MIG-" in output
        assert "MIG 1g.5gb at slice" in output
        assert "Running" in next(line for line in lines if line.startswith("default ") and "mig-demo" in line)
        records = lab.RealNode.load("demo").records
        assert records
        started = time.monotonic()
        demo.send_signal(signal.SIGINT)
        while any(r.alive() for r in records) and time.monotonic() - started < 30:
            time.sleep(0.05)
        stopped_in = time.monotonic() - started
        print(f"the demo's processes stopped {stopped_in:.2f}s after Ctrl-C")
        assert not any(r.alive() for r in records)
        assert stopped_in <= STOP_WITHIN_S, f"the demo's processes took {stopped_in:.1f}s to stop"
        assert 0 == demo.wait(30)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
        if Path(lab.RealNode("demo", "demo-gpu-node").state_file).exists():
            lab.RealNode.load("demo").down()
    down = subprocess.run(
        [str(REPO / "hack" / "demo.sh"), "--down"], capture_output=True, text=True, check=False
    )
    assert (0, "no demo is running\n") == (down.returncode, down.stdout)
