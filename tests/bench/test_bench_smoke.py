"""Every part of `python hack/bench` runs, in its smoke form (a sample or two each), so that no part
rots unseen: a part that raises is an error the bench reports and exits 1 for. Its figures are not
judged here; performance is judged from full runs of the bench, never from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench.__main__ import PARTS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)
def test_every_part_of_the_bench_runs(tmp_path: Path, cluster_binaries: object) -> None:
    if os.geteuid() != 0:
        pytest.skip("the bench starts real nodes and kubelet harnesses (root)")
    figures = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "hack" / "bench"), "--smoke", "--json", str(figures)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert 0 == done.returncode, f"the bench failed:\n{done.stderr[-6000:]}"
    report = json.loads(figures.read_text())
    assert [] == report["errors"]
    assert set(PARTS) <= set(report["parts_s"]), (
        f"parts that did not run: {set(PARTS) - set(report['parts_s'])}"
    )
