"""`sharing plan`: what the planner would do on one GPU, as a picture of the slices or JSON."""

from __future__ import annotations

import argparse
import re
from collections import Counter

from sharing.cli.common import Subparsers, UsageError, print_json, product_arg
from sharing.mig import Existing, Infeasible, Placement, Plan, Product, plan_gpu

_WANT = re.compile(r"^(?P<profile>[^=\s,]+)=(?P<count>\d+)$")
_HAVE = re.compile(r"^(?P<profile>[^@\s,]+)@(?P<start>\d+)(?P<busy>:busy)?$")


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "plan",
        help="plan the smallest MIG change on one GPU",
        description="Plan the change from the instances a GPU has to the wanted profiles. "
        "Exit 0 feasible, 1 infeasible, 2 bad arguments.",
    )
    parser.add_argument(
        "--gpu", required=True, metavar="GPU", help="catalog name, NVML name or PCI id, e.g. A100-SXM4-40GB"
    )
    parser.add_argument(
        "--want", required=True, metavar="LIST", help="wanted profiles, e.g. 3g.20gb=1,1g.5gb=2"
    )
    parser.add_argument(
        "--have",
        default="",
        metavar="LIST",
        help="existing instances as PROFILE@START, ':busy' when in use, e.g. 3g.20gb@0,1g.5gb@6:busy",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Plan and print."""
    product = product_arg(args.gpu)
    want = parse_want(product, args.want)
    have = parse_have(product, args.have)
    result = plan_gpu(product, have, want)
    if args.json:
        print_json(plan_json(result))
    else:
        print(describe(product, have, result))
    return 0 if isinstance(result, Plan) else 1


def parse_want(product: Product, text: str) -> Counter[str]:
    """`3g.20gb=1,1g.5gb=2` -> Counter; malformed items and unknown profiles are usage errors."""
    want: Counter[str] = Counter()
    for item in _items(text):
        match = _WANT.match(item)
        if match is None:
            raise UsageError(f"--want: {item!r} is not PROFILE=COUNT")
        want[_profile(product, match["profile"], "--want")] += int(match["count"])
    return want


def parse_have(product: Product, text: str) -> list[Existing]:
    """`3g.20gb@0,1g.5gb@6:busy` -> existing instances; malformed items are usage errors."""
    have: list[Existing] = []
    for item in _items(text):
        match = _HAVE.match(item)
        if match is None:
            raise UsageError(f"--have: {item!r} is not PROFILE@START or PROFILE@START:busy")
        profile = product.require_profile(_profile(product, match["profile"], "--have"))
        start = int(match["start"])
        if start not in profile.placements:
            raise UsageError(
                f"--have: {item!r}: {profile.name} cannot start at {start} on {product.name} "
                f"(valid starts: {','.join(map(str, profile.placements))})"
            )
        for other in have:
            other_size = product.require_profile(other.profile).size
            if start < other.start + other_size and other.start < start + profile.size:
                raise UsageError(f"--have: {item!r} overlaps {other.profile}@{other.start}")
        have.append(Existing(profile.name, start, busy=match["busy"] is not None))
    return have


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _profile(product: Product, name: str, flag: str) -> str:
    if product.profile(name) is None:
        valid = ", ".join(p.name for p in product.profiles)
        raise UsageError(f"{flag}: unknown MIG profile {name!r} on {product.name} (valid: {valid})")
    return name


def plan_json(result: Plan | Infeasible) -> dict[str, object]:
    """The JSON shape of `sharing plan --json`."""
    if isinstance(result, Infeasible):
        return {"feasible": False, "reason": result.reason, "kind": result.kind.value}

    def items(placements: tuple[Placement, ...]) -> list[dict[str, object]]:
        return [{"profile": p.profile, "start": p.start, "size": p.size} for p in placements]

    return {
        "feasible": True,
        "layout": items(result.layout),
        "keep": items(result.keep),
        "destroy": items(result.destroy),
        "create": items(result.create),
    }


def describe(product: Product, have: list[Existing], result: Plan | Infeasible) -> str:
    """A picture of the placement slots now and after, then the steps."""
    lines = [f"{product.name}: {product.slots} placement slots"]
    busy = {(e.profile, e.start) for e in have if e.busy}
    now = [Placement(e.profile, e.start, product.require_profile(e.profile).size) for e in have]
    target = list(result.layout) if isinstance(result, Plan) else []
    labels = _labels(now + target)
    lines.append("slot    " + "".join(f"{i:<3}" for i in range(product.slots)).rstrip())
    lines.append("now     " + _row(product, now, labels))
    if isinstance(result, Infeasible):
        lines.append(f"infeasible: {result.reason}")
        return "\n".join(lines)
    lines.append("target  " + _row(product, target, labels))
    lines.append("")
    for p in sorted(set(now + target), key=lambda p: labels[p]):
        state = "busy" if (p.profile, p.start) in busy else ""
        lines.append(
            f"  {labels[p]}  {p.profile}@{p.start} (slots {p.start}-{p.start + p.size - 1}) {state}".rstrip()
        )
    lines.append("")
    steps = [f"destroy {p}" for p in result.destroy] + [f"create  {p}" for p in result.create]
    lines.append(
        f"steps ({len(steps)}; keeping {len(result.keep)}):"
        if steps
        else "nothing to do: the GPU already matches"
    )
    lines.extend(f"  {i}. {step}" for i, step in enumerate(steps, 1))
    return "\n".join(lines)


def _labels(placements: list[Placement]) -> dict[Placement, str]:
    labels: dict[Placement, str] = {}
    for p in placements:
        labels.setdefault(p, chr(ord("A") + len(labels)))
    return labels


def _row(product: Product, placements: list[Placement], labels: dict[Placement, str]) -> str:
    cells = ["." for _ in range(product.slots)]
    for p in placements:
        for i in range(p.start, p.start + p.size):
            cells[i] = labels[p]
    return "".join(f"{c:<3}" for c in cells).rstrip()
