"""The flake hunt (hack/flakes.py, `hack/test.sh --repeat N`) on a test that fails in one run of three:
it names the test, the run and the seeds that replay it, and keeps the failure's report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FLAKY = """
import os
from pathlib import Path

def test_steady():
    pass

def test_second_run_fails():
    runs = Path(os.environ["FLAKES_COUNTER"])
    count = int(runs.read_text() or "0") + 1 if runs.exists() else 1
    runs.write_text(str(count))
    print("the test's own output")
    assert count != 2, f"run {count} fails"
"""


def test_a_test_that_fails_one_run_in_three_is_named_with_its_seeds_and_report(tmp_path: Path) -> None:
    # The tiny suite is its own rootdir: else pytest takes the common ancestor of the checkout and
    # tmp_path (/tmp for a clone under /tmp) and the test IDs name the path from there.
    tests = tmp_path / "tiny"
    tests.mkdir()
    (tests / "test_tiny.py").write_text(FLAKY)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(REPO / "hack" / "flakes.py"), "--runs", "3", "--out", str(out), "--workers", "0",
         "--", str(tests / "test_tiny.py"), "-p", "no:cacheprovider", f"--rootdir={tests}"],
        capture_output=True, text=True, check=False, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "FLAKES_COUNTER": str(tmp_path / "count"), "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert 1 == done.returncode, done.stdout + done.stderr
    runs = json.loads((out / "summary.json").read_text())
    assert [(0, 2), (1, 2), (0, 2)] == [(int(r["exit_code"] != 0), r["tests"]) for r in runs]
    (failure,) = runs[1]["failures"]
    assert "test_tiny.py::test_second_run_fails" == failure["test"]
    assert "run 2 fails" in failure["message"]
    report = Path(failure["log"]).read_text()
    assert "the test's own output" in report
    order, soak = runs[1]["seeds"]["order"], runs[1]["seeds"]["soak"]
    assert f"1/3  {failure['test']}" in done.stdout
    assert f"run 2 (--randomly-seed={order}, SHARING_SOAK_SEED={soak}):" in done.stdout
    assert failure["log"] in done.stdout
