"""The applier on the fake driver's GPUs: NVML mutations per transition versus destroy-all-and-recreate.

20 fixed MIG transitions on one fake-driver A100 and one H100 through `apply_config`: mutating NVML
calls (the simulator's counters) / what mig-parted's way would need (destroy every instance and
create every one: 2 calls per destroyed and per created instance, 1 per mode change; 0 for a GPU
that matches). The transitions mix small edits with reshapes that keep nothing (any layout <-> 7g).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from bench.procs import in_process_driver
from bench.report import Results
from sharing.config.spec import MigMode, MigStrategy, Rule, Selector, SharingConfig
from sharing.gpu import open_backend, simstate
from sharing.mig.catalog import Product, default_catalog
from sharing.rollout.apply import apply_config
from sharing.store.journal import Journal

# 19 layouts of the 8-slice geometry, by profile kind; the H100 walks them from another offset.
_KINDS = {0: "1g", 7: "1g+me", 9: "1g-double", 1: "2g", 2: "3g", 3: "4g", 4: "7g"}
_LAYOUTS: tuple[dict[str, int], ...] = (
    {"1g": 7},
    {"1g": 3, "3g": 1},
    {"3g": 2},
    {"3g": 1, "2g": 2},
    {"1g": 2, "2g": 1, "3g": 1},
    {"7g": 1},
    {"4g": 1, "3g": 1},
    {"4g": 1, "1g": 3},
    {"2g": 3},
    {"2g": 2, "1g": 3},
    {"1g-double": 4},
    {"1g-double": 2, "3g": 1},
    {"1g+me": 1, "1g": 6},
    {"3g": 1, "1g": 4},
    {"2g": 1, "1g": 5},
    {"1g": 7},
    {"3g": 2},
    {"1g": 2, "2g": 1, "3g": 1},
    {"7g": 1},
)


def _named(product: Product, layout: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    by_kind = {_KINDS[p.enum]: p.name for p in product.profiles}
    return tuple(sorted((by_kind[kind], n) for kind, n in layout.items()))


def bench_mutations(tmp: Path, results: Results) -> None:
    """mutations_vs_recreate: one run (the transitions are fixed, the counts exact)."""
    asyncio.run(_mutations(tmp, results))


async def _mutations(tmp: Path, results: Results) -> None:
    catalog = default_catalog()
    root, sim = in_process_driver(tmp)
    simstate.init_state(
        sim,
        [
            simstate.resolve_product(catalog, "A100-SXM4-40GB"),
            simstate.resolve_product(catalog, "H100-80GB-HBM3"),
        ],
    )
    products = [catalog.product("A100-SXM4-40GB"), catalog.product("H100-80GB-HBM3")]
    offsets = (0, 7)
    # Per GPU: 19 MIG layouts, then MIG off again: 20 transitions starting from MIG off.
    sequences = [
        [_named(p, _LAYOUTS[(i + off) % len(_LAYOUTS)]) for i in range(len(_LAYOUTS))] + [None]
        for p, off in zip(products, offsets, strict=True)
    ]
    backend = open_backend("nvml", catalog, driver_root=root)
    journal = Journal(tmp / "mutations-journal.jsonl")
    recreate_calls = agent_calls = nothing_kept = 0
    try:
        current: list[tuple[tuple[str, int], ...] | None] = [None, None]
        for step in range(20):
            rules = []
            step_recreate = 0
            for index, seq in enumerate(sequences):
                want = seq[step]
                rules.append(
                    Rule(Selector(indices=(index,)), MigMode.DISABLED)
                    if want is None
                    else Rule(Selector(indices=(index,)), MigMode.ENABLED, instances=want)
                )
                step_recreate += _recreate_cost(current[index], want)
                current[index] = want
            config = SharingConfig(f"t{step}", MigStrategy.MIXED, rules=tuple(rules))
            before = simstate.counters(sim).mutating_calls
            report = await apply_config(backend, config, catalog=catalog, journal=journal)
            if not report.ok:
                raise RuntimeError(f"transition {step} failed: {report}")
            step_agent = simstate.counters(sim).mutating_calls - before
            agent_calls += step_agent
            recreate_calls += step_recreate
            nothing_kept += step_agent == step_recreate
    finally:
        await backend.close()
    results.add("mutations_vs_recreate", agent_calls / recreate_calls)
    results.note(
        "mutations: agent NVML mutating calls / destroy-all-and-recreate calls (20 transitions x 2 GPUs)",
        f"{agent_calls} / {recreate_calls}; in {nothing_kept} of 20 steps neither GPU could keep anything",
    )


def _recreate_cost(have: tuple[tuple[str, int], ...] | None, want: tuple[tuple[str, int], ...] | None) -> int:
    """What mig-parted does: nothing when it matches, else destroy every instance and create every one."""
    if have == want:
        return 0
    destroyed = sum(n for _, n in have or ())
    created = sum(n for _, n in want or ())
    mode = int((have is None) != (want is None))
    return 2 * destroyed + 2 * created + mode
