"""``python hack/bench``: run the benchmarks, print the table, optionally write the figures as JSON.

    $(hack/venv.sh)/bin/python hack/bench [--quick | --smoke] [--json PATH] [--fleet N] [--only PART,...]
                                          [--seed N] [--mix-shift] [--trace FILE.csv] [--time-scale X]
                                          [--gpus PRODUCT:N[,PRODUCT:N]]

Parts, in order: planner, hostile (parsing hostile ConfigMap keys), mutations, prepare (the agent's
own share of seven on-demand MIG prepares at once on one fake-driver A100), usage (the usage
sampler's CPU on 8 fake-driver GPUs with 56 MIG devices and 64 replicas), listandwatch, cluster
(startup, reconcile, configmap, allocate, idle, preferred, restart: the API server's), agentrestart
(the agent's: how long the kubelet refuses pods), realcluster (three real nodes: a ConfigMap edit, a
rolling upgrade with work on every node), realnode, dra (the DRA front-end), ondemand (on-demand MIG
against pre-made slices, and at the fake driver's assumed MIG latencies; these three take turns on
one real node, taken down after the last of them), fleet, fleetdra (the fleet on DRA: a storm of
claims every agent watches), probes (the HTTP port under a flood), resourceslices (the DRA
publisher: a changed pool until the API server holds it), trace (MIG workloads, drawn with a steady
or a shifting mix or read from a CSV file, on four A100s or the `--gpus` given: the best shipped
preset and the best static layout in hindsight vs on-demand, through the real kube-scheduler). A
part that fails is reported and the others still run; the exit code is 1 when any failed. Ctrl-C or
SIGTERM stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python hack/bench`: import `bench`, `lab` and `sharing` by name
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

import structlog

from bench import (
    agentrestart,
    allocate,
    dra,
    fleet,
    fleetdra,
    hostile,
    idle,
    listandwatch,
    mutations,
    ondemand,
    planner,
    prepare,
    probes,
    realcluster,
    realnode,
    reconcile,
    resourceslices,
    restart,
    trace,
    tracesim,
    usage,
)
from bench.cluster import Cluster, running_cluster
from bench.labnode import SharedNode
from bench.report import FULL, QUICK, SMOKE, Budget, Results, as_json, machine, print_table, say

ON_NODE = {"realnode", "dra", "ondemand"}
"""Parts that take turns on one real node (`bench.labnode.SharedNode`)."""
NOT_IN_SMOKE = {"realcluster"}
"""Parts `--smoke` leaves out unless named in --only: three more real nodes beside the suite's would
take the whole suite past its time on 2 cores, and tests/cluster runs the same steps (lab.cluster's
bring-up, retag, install, the MPS and MIG reads) in every run."""
PARTS = (
    "planner",
    "hostile",
    "mutations",
    "prepare",
    "usage",
    "listandwatch",
    "cluster",
    "agentrestart",
    "realcluster",
    "realnode",
    "dra",
    "ondemand",
    "fleet",
    "fleetdra",
    "probes",
    "resourceslices",
    "trace",
)


def quiet_logs() -> None:
    """Warnings and errors of the in-process code to stderr (stdout is the table)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def cluster_parts(tmp: Path, budget: Budget, results: Results) -> None:
    """The single-node parts on one control plane and harness, each reported on its own."""
    with running_cluster(tmp) as env:
        replicas = 2

        def configmap_and_allocate(env: Cluster) -> None:
            nonlocal replicas
            replicas = reconcile.bench_configmap(env, budget, results)
            allocate.bench_allocate(env, budget, results, replicas)

        steps: list[tuple[str, Callable[[Cluster], None]]] = [
            ("startup/reconcile", lambda env: reconcile.bench_startup_and_reconcile(env, budget, results)),
            ("configmap/allocate", configmap_and_allocate),
            ("idle", lambda env: idle.bench_idle(env, budget, results)),
            ("preferred", lambda env: allocate.bench_preferred(env, budget, results)),
            ("restart", lambda env: restart.bench_restart(env, budget, results)),
        ]
        for name, step in steps:
            run(name, lambda step=step: step(env), results)  # type: ignore[misc]


def agentrestart_part(tmp: Path, budget: Budget, results: Results) -> None:
    """The agent restarted under a stream of pods, on a cluster of its own (`--only agentrestart`)."""
    with running_cluster(tmp) as env:
        agentrestart.bench_restart(env, budget, results)


def run(name: str, part: Callable[[], None], results: Results) -> None:
    started = time.monotonic()
    try:
        part()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # report it, go on with the other parts
        results.errors.append(f"{name}: {type(err).__name__}: {err}"[:2000])
        say(f"{name} failed: {err}"[:2000])
    finally:
        results.parts[name] = time.monotonic() - started
        say(f"{name}: {results.parts[name]:.0f} s")


def run_parts(parts: Sequence[tuple[str, Callable[[], None]]], shared: SharedNode, results: Results) -> None:
    """Each part in turn; the shared real node down (timed) right after the last part on it, so
    that it idles beside no other part, and in any case before this returns."""
    last = [name for name, _ in parts if name in ON_NODE][-1:]
    try:
        for name, part in parts:
            run(name, part, results)
            if [name] == last:
                run("realnode down", lambda: shared.down(results), results)
    finally:
        shared.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures as one JSON object")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer runs and samples, a fleet of 10")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="every part with a sample or two and a short trace: that nothing is broken (CI), no figures",
    )
    parser.add_argument(
        "--fleet", type=int, metavar="N", help="nodes in the fleet (default 100, --quick 10; 0: none)"
    )
    parser.add_argument("--only", metavar="PARTS", help=f"comma list of parts to run: {', '.join(PARTS)}")
    parser.add_argument(
        "--seed", type=int, action="append", metavar="N",
        help=f"trace: run this seed (repeatable; default {', '.join(map(str, trace.DEFAULT_SEEDS))}; "
        "--quick: the first)",
    )  # fmt: skip
    parser.add_argument(
        "--mix-shift", action="store_true",
        help="trace: only the drawn traces whose mix shifts between phases (default: steady and shifting)",
    )  # fmt: skip
    parser.add_argument(
        "--trace", type=Path, metavar="FILE.csv",
        help="trace: replay this CSV file (header arrival,lifetime,profile[,patience]; seconds; profile "
        "a MIG profile name or gpu); with --seed or --mix-shift, the drawn traces too",
    )  # fmt: skip
    parser.add_argument(
        "--time-scale", type=float, metavar="X",
        help=f"trace: replay X trace seconds per real second (default {1 / trace.UNIT_S:g}; --smoke 10)",
    )  # fmt: skip
    parser.add_argument(
        "--gpus", default=trace.DEFAULT_GPUS, metavar="PRODUCT:N[,PRODUCT:N]",
        help=f"trace: the GPUs of each way's node (default {trace.DEFAULT_GPUS})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    seeds = tuple(args.seed) if args.seed else trace.DEFAULT_SEEDS[: 1 if args.quick or args.smoke else None]
    budget = SMOKE if args.smoke else QUICK if args.quick else FULL
    only = set(args.only.split(",")) if args.only else set(PARTS) - (NOT_IN_SMOKE if args.smoke else set())
    if only - set(PARTS):
        parser.error(
            f"unknown parts {', '.join(sorted(only - set(PARTS)))}; the parts are {', '.join(PARTS)}"
        )
    try:
        gpus = tracesim.parse_gpus(args.gpus, trace.CATALOG)
        drawn = not args.trace or args.seed or args.mix_shift  # a file alone, unless asked for more
        kinds = ("shift",) if args.mix_shift else ("steady", "shift") if drawn else ()
        plays = trace.traces(gpus, kinds, seeds, budget.trace_pods, args.trace) if "trace" in only else []
    except ValueError as err:  # a TraceFileError names the file, line and column
        parser.error(str(err))
    if args.time_scale is not None and not (math.isfinite(args.time_scale) and args.time_scale > 0):
        parser.error(f"--time-scale: {args.time_scale} is not a number above 0")
    unit_s = 1 / args.time_scale if args.time_scale else budget.trace_unit_s
    quiet_logs()

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    nodes = budget.fleet_nodes if args.fleet is None else args.fleet
    results = Results()
    started, load_start = time.monotonic(), os.getloadavg()
    say(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on {os.cpu_count()} cores")
    shared = SharedNode()
    with tempfile.TemporaryDirectory(prefix="gs-bench-") as tmp_name:
        tmp = Path(tmp_name)
        parts: list[tuple[str, Callable[[], None]]] = [
            ("planner", lambda: planner.bench_plan(budget, results)),
            ("hostile", lambda: hostile.bench_hostile(results)),
            ("mutations", lambda: mutations.bench_mutations(tmp, results)),
            ("prepare", lambda: prepare.bench_prepare(tmp, budget, results)),
            ("usage", lambda: usage.bench_usage(tmp, budget, results)),
            ("listandwatch", lambda: listandwatch.bench_listandwatch(tmp, budget, results)),
            ("cluster", lambda: cluster_parts(tmp / "cluster", budget, results)),
            ("agentrestart", lambda: agentrestart_part(tmp / "agentrestart", budget, results)),
            ("realcluster", lambda: realcluster.bench_real_cluster(budget, results)),
            ("realnode", lambda: realnode.bench_real_node(shared, budget, results)),
            ("dra", lambda: dra.bench_dra(shared, budget, results)),
            ("ondemand", lambda: ondemand.bench_ondemand(shared, budget, results)),
            ("fleet", lambda: fleet.bench_fleet(nodes, budget, results) if nodes else None),
            ("fleetdra", lambda: fleetdra.bench_fleet_dra(nodes, budget, results) if nodes else None),
            ("probes", lambda: probes.bench_probes(tmp / "probes", budget, results)),
            ("resourceslices", lambda: resourceslices.bench_resourceslices(tmp / "slices", budget, results)),
            (
                "trace",
                lambda: trace.bench_trace(
                    tmp / "trace", results, plays, gpus, unit_s=unit_s, offline_pods=budget.trace_pods
                ),
            ),
        ]
        try:
            run_parts([(name, part) for name, part in parts if name in only], shared, results)
        except KeyboardInterrupt:
            say("interrupted: stopping everything")
            return 130
    info = machine(args.quick or args.smoke, results, started, load_start)
    print_table(results, info)
    if args.json:
        args.json.write_text(json.dumps(as_json(results, info), indent=2) + "\n")
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
