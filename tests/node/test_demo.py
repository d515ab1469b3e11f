"""The README's first command, end to end: `hack/demo.sh --dra` brings up its node, installs the
chart, runs a pod with a MIG slice, switches the node to DRA and runs a pod per way of asking (a claim
of a whole GPU, a claim of a MIG device, limits through the DeviceClass's extended resource), and
Ctrl-C stops every process it started (how fast: hack/bench's `node_stop_s`, the down of the node its
real-node parts share).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import lab
import pytest

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_shows_pods_with_their_slices_by_plugin_and_by_dra_and_ctrl_c_stops_everything(
    cluster_binaries: lab.Binaries,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the real node needs root")
    demo = subprocess.Popen(
        [str(REPO / "hack" / "demo.sh"), "--dra"],
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
        # Through DRA, each pod sees the device its claim was allocated (the whole GPU, a 1g.5gb).
        seen = {
            line.split()[1]: lines[i + 1].strip()
            for i, line in enumerate(lines)
            if line.startswith("pod ") and " sees " in line and i + 1 < len(lines)
        }
        pods = {"mig-demo", "gpu-claim-demo", "mig-claim-demo", "mig-limits-demo"}
        assert pods == set(seen), output[-3000:]
        assert seen["gpu-claim-demo"].endswith("the whole GPU"), seen
        assert "MIG 1g.5gb at slice" in seen["mig-claim-demo"], seen
        assert "MIG 1g.5gb at slice" in seen["mig-limits-demo"], seen
        records = lab.RealNode.load("demo").records
        assert records
        demo.send_signal(signal.SIGINT)
        # The demo exits once its `down` is done: by then every process it started has gone.
        assert 0 == demo.wait(60)
        assert [] == [r.name for r in records if r.alive()]
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
