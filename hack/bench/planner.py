"""The planner alone, in process: how long `plan_gpu` takes per call.

On the catalog product with the most memory: every profile multiset within the max counts (from
an empty GPU) and 1,000 seeded transitions (a valid layout with a random busy subset, to a random
multiset that fits an empty GPU); one timed call per case (perf_counter_ns). plan_ms_p50/p99 per
run; the slowest single call and the p99 of the transitions alone are shown too.
"""

from __future__ import annotations

import itertools
import random
import time

from bench.report import Budget, Results, percentile, say
from sharing.mig.catalog import default_catalog
from sharing.mig.plan import Existing, plan_gpu
from sharing.mig.plan import Plan as GpuPlan

TRANSITIONS = 1000
SEED = 20240607


def bench_plan(budget: Budget, results: Results) -> None:
    catalog = default_catalog()
    product = max(catalog.products, key=lambda p: (p.memory_slices, p.memory_mib, p.name))
    names = [p.name for p in product.profiles]
    multisets = [
        dict(zip(names, counts, strict=True))
        for counts in itertools.product(*(range(p.max_count + 1) for p in product.profiles))
    ]
    feasible = [m for m in multisets if isinstance(plan_gpu(product, (), m), GpuPlan)]
    rng = random.Random(SEED)
    transitions = []
    for _ in range(TRANSITIONS):
        layout = plan_gpu(product, (), rng.choice(feasible))
        assert isinstance(layout, GpuPlan)
        existing = tuple(Existing(p.profile, p.start, busy=rng.random() < 0.3) for p in layout.layout)
        transitions.append((existing, rng.choice(feasible)))
    planned = sum(isinstance(plan_gpu(product, e, w), GpuPlan) for e, w in transitions)
    say(
        f"planner: {product.name}, {len(multisets)} multisets ({len(feasible)} feasible) + "
        f"{len(transitions)} transitions ({planned} feasible), {budget.plan_runs} runs"
    )
    cases = [((), m) for m in multisets] + transitions
    worst = transition_p99 = 0.0
    for _ in range(budget.plan_runs):
        samples = []
        for existing, want in cases:
            start = time.perf_counter_ns()
            plan_gpu(product, existing, want)
            samples.append((time.perf_counter_ns() - start) / 1e6)
        results.add("plan_ms_p50", percentile(samples, 50))
        results.add("plan_ms_p99", percentile(samples, 99))
        worst = max(worst, *samples)
        transition_p99 = percentile(samples[len(multisets) :], 99)
    results.note(
        "plan: max single call / p99 of transitions only (last run)",
        f"{worst:.3f} ms / {transition_p99:.3f} ms",
    )
