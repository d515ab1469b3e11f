"""Every part of `python hack/bench` runs, in its smoke form (a sample or two each), so that no part
rots unseen (but `realcluster`, whose steps tests/cluster runs: `bench.__main__.NOT_IN_SMOKE`): a
part that raises is an error the bench reports and exits 1 for. Its figures are not judged here;
performance is judged from full runs of the bench, never from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench.__main__ import NOT_IN_SMOKE, PARTS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)
def test_every_part_of_the_bench_runs(tmp_path: Path, cluster_binaries: object) -> None:
    if os.geteuid() != 0:
        pytest.skip("the bench starts real nodes and kubelet harnesses (root)")
    figures = tmp_path / "bench.json"
    trace = tmp_path / "trace.csv"  # the trace part replays a file beside the drawn traces
    trace.write_text(
        "arrival,lifetime,profile,patience\n0,5,1g.5gb,10\n0.5,4,gpu,\n1,6,3g.20gb,10\n2,3,7g.40gb,5\n3,5,2g.10gb,10\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "hack" / "bench"),
            "--smoke",
            "--json",
            str(figures),
            "--trace",
            str(trace),
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert 0 == done.returncode, f"the bench failed:\n{done.stderr[-6000:]}"
    report = json.loads(figures.read_text())
    assert [] == report["errors"]
    assert set(PARTS) - NOT_IN_SMOKE <= set(report["parts_s"]), (
        f"parts that did not run: {set(PARTS) - NOT_IN_SMOKE - set(report['parts_s'])}"
    )
    # The drawn traces, steady and shifting, and the file were each played on every way.
    for prefix in ("trace", "trace_shift", "trace_file"):
        for way in ("hindsight", "preset", "policy", "plain"):
            assert report.get(f"{prefix}_{way}_served") is not None, f"{prefix} {way}"
    # The prepare part's share, the on-demand starts at zero and at the realistic latencies, the
    # usage sampler's CPU, and the stop of the real node the parts took turns on.
    for figure in (
        "node_stop_s",
        "usage_sampler_cpu_pct",
        "dra_prepare_agent_share_s_p99",
        "ondemand_pod_start_s_p50",
        "ondemand_pod_start_s_p50_realistic",
    ):
        assert report[figure] is not None, figure
