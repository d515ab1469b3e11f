"""The flake hunt: the tiers that start processes, run N times in fresh random orders, and per test
how many runs it failed, with the order's seed and the log of each failure.

    hack/test.sh --repeat N [--under-load[=M]] [PATHS or pytest arguments]

`hack/test.sh` builds what the tiers need, starts the load (`--under-load`) and calls this with its
venv. A test that fails one run in ten passes two or three runs nine times in ten: only repeats show
it. Each run is a whole `pytest` process over the tiers (fakedriver, integration, e2e, node, cluster,
skew; or the paths given) on the usual workers, in an order drawn from a new `--randomly-seed`, with the soak
(tests/e2e/test_soak.py) walking new seeds (`SHARING_SOAK_SEED`). Every failure's report, with what
the test printed and logged, is written under the run's folder (by the pytest plugin
hack/flakereport.py); the summary names the test, the run, the seeds that replay its order
(`hack/test.sh --randomly-seed=S`, and the soak's) and that file. Exit status: 0 when every run
passed, 1 when any test failed or any run did not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIERS = ("tests/fakedriver", "tests/integration", "tests/e2e", "tests/node", "tests/cluster", "tests/skew")
"""The tiers that start processes: agents on the fake driver, control planes, kubelets, real nodes."""
SOAK_SEEDS_PER_RUN = 2


@dataclass(frozen=True)
class Seeds:
    """What one run draws: its order (`--randomly-seed`) and the soak's walks (`SHARING_SOAK_SEED`)."""

    run: int
    order: int
    soak: str

    def replay(self) -> str:
        return f"--randomly-seed={self.order}, SHARING_SOAK_SEED={self.soak}"


@dataclass(frozen=True)
class Failure:
    """One test that failed (or errored in a fixture) in one run."""

    test: str
    seeds: Seeds
    message: str
    log: str


@dataclass(frozen=True)
class Run:
    """One pytest process over the tiers."""

    seeds: Seeds
    exit_code: int
    seconds: float
    tests: int
    failures: tuple[Failure, ...]
    log: str


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--runs", type=int, required=True, help="how many runs (hack/test.sh --repeat N)")
    parser.add_argument("--out", type=Path, required=True, help="where each run's logs and failures go")
    parser.add_argument("--workers", type=int, default=(os.cpu_count() or 2) + 1)
    parser.add_argument("pytest_args", nargs="*", help="test paths (default: the tiers) and pytest options")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--repeat N: N must be at least 1")
    paths = [a for a in args.pytest_args if not a.startswith("-") and (REPO / a.split("::")[0]).exists()]
    spread = ["-n", str(args.workers)] if args.workers > 0 else []
    command = [
        sys.executable, "-m", "pytest", *(paths or TIERS), *spread, "-p", "flakereport",
        "--durations=10", *(a for a in args.pytest_args if a not in paths),
    ]  # fmt: skip
    chooser = random.SystemRandom()
    started = time.monotonic()
    runs: list[Run] = []
    for index in range(1, args.runs + 1):
        soak = ",".join(str(chooser.randrange(1, 10**6)) for _ in range(SOAK_SEEDS_PER_RUN))
        seeds = Seeds(index, chooser.randrange(1, 2**31), soak)
        print(f"==> run {index}/{args.runs}: {seeds.replay()}", flush=True)
        run = run_once(seeds, command, args.out / f"run-{index}")
        runs.append(run)
        verdict = "passed" if run.exit_code == 0 else f"{len(run.failures)} failed (exit {run.exit_code})"
        print(f"<== run {index}: {run.tests} tests, {verdict}, {run.seconds:.0f} s ({run.log})", flush=True)
    report = summary(runs, time.monotonic() - started)
    print(report)
    (args.out / "summary.txt").write_text(report + "\n")
    (args.out / "summary.json").write_text(json.dumps([asdict(r) for r in runs], indent=2) + "\n")
    return 0 if all(r.exit_code == 0 for r in runs) else 1


def run_once(seeds: Seeds, command: list[str], folder: Path) -> Run:
    """One pytest process; its failures read back from what hack/flakereport.py wrote."""
    folder.mkdir(parents=True, exist_ok=True)
    reports, log = folder / "reports.jsonl", folder / "pytest.log"
    command = [*command, f"--randomly-seed={seeds.order}"]
    path = os.pathsep.join(p for p in (str(REPO / "hack"), os.environ.get("PYTHONPATH", "")) if p)
    began = time.monotonic()
    with log.open("w") as sink:
        sink.write(" ".join(command) + "\n")
        sink.flush()
        done = subprocess.run(
            command,
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "SHARING_SOAK_SEED": seeds.soak,
                "SHARING_FLAKES_REPORT": str(reports),
                "PYTHONPATH": path,
            },
            check=False,
        )
    tests, failures = read_reports(reports, seeds, folder)
    if done.returncode != 0 and not failures:  # a run that ended without a test to blame
        why = f"pytest exited with {done.returncode} and no test failed: see the log"
        failures = [Failure("(the run itself)", seeds, why, str(log))]
    return Run(seeds, done.returncode, time.monotonic() - began, tests, tuple(failures), str(log))


def read_reports(path: Path, seeds: Seeds, folder: Path) -> tuple[int, list[Failure]]:
    """(tests run, the failures); each failure's report written to a file of its own."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return 0, []
    tests = len({line["test"] for line in lines})
    failures = []
    for line in lines:
        if line["outcome"] != "failed":
            continue
        test, when = line["test"], line["when"]
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test)[:180] + ("" if when == "call" else f".{when}")
        file = folder / "failures" / f"{name}.txt"
        file.parent.mkdir(exist_ok=True)
        file.write_text(line.get("text", ""))
        label = test if when == "call" else f"{test} ({when})"
        failures.append(Failure(label, seeds, line.get("message", "")[:300], str(file)))
    return tests, failures


def summary(runs: list[Run], seconds: float) -> str:
    """Per test that failed: in how many runs, and each failure's seeds, message and log."""
    by_test: dict[str, list[Failure]] = {}
    for run in runs:
        for failure in run.failures:
            by_test.setdefault(failure.test, []).append(failure)
    each = ", ".join(
        f"run {r.seeds.run} {'passed' if r.exit_code == 0 else 'FAILED'} ({r.seconds / 60:.1f} min)"
        for r in runs
    )
    lines = [f"==> {len(runs)} runs in {seconds / 60:.1f} min: {each}"]
    if not by_test:
        lines.append(f"no test failed in {len(runs)} runs")
        return "\n".join(lines)
    lines.append(f"{len(by_test)} tests failed at least once:")
    for test, failures in sorted(by_test.items(), key=lambda item: (-len(item[1]), item[0])):
        lines.append(f"  {len(failures)}/{len(runs)}  {test}")
        for f in failures:
            lines += [f"      run {f.seeds.run} ({f.seeds.replay()}):", f"        {f.message}"]
            lines.append(f"        {f.log}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
