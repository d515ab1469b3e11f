"""`sharing recommend`: the config that holds what this node's pods use at their right size, and free room.

In the agent's pod it observes the GPUs (read-only, as `sharing export` does) and asks the agent for
its status (as `sharing status` does: who holds which slice, what each pod used, its right size);
offline, `--from FILE` reads both from a `sharing export --json` taken in the agent's pod. The
proposal (`sharing.usage.recommend`) is checked as the agent checks a ConfigMap's config, against
these GPUs, and printed as that config's YAML under comments that say, per GPU, what it frees and
which pods hold slices it changes; `--json` for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from sharing.cli.common import Subparsers, UsageError, print_json
from sharing.cli.gpuargs import add_backend_arguments, observe_from_args
from sharing.cli.status import DEFAULT_PORT, agent_status
from sharing.config import parse_configmap
from sharing.errors import SharingError
from sharing.mig import default_catalog
from sharing.model import NodeState
from sharing.ops.exported import read_export
from sharing.text import duration, listed
from sharing.usage.recommend import Recommendation, recommend
from sharing.usage.resize import GpuAdvice

MAX_EXPORT_BYTES = 64 << 20


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "recommend",
        help="propose the config that holds what the pods use at their right size, plus the free room",
        description="Size every held MIG device to what its pod used (the agent's usage window), fill the "
        "rest of each GPU with the largest profiles that fit, and print that as a config checked against "
        "this node's GPUs. Run it in the agent's pod, or on a `sharing export --json` taken there.",
    )
    parser.add_argument(
        "--from", dest="source", metavar="FILE",
        help="a `sharing export --json` file taken in the agent's pod ('-': stdin) instead of this node",
    )  # fmt: skip
    parser.add_argument("--name", default="recommended", help="the config's name (its key in the ConfigMap)")
    parser.add_argument(
        "--port", type=int, default=None, help=f"the agent's HTTP port [SHARING_HTTP_PORT; {DEFAULT_PORT}]"
    )
    add_backend_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Read the node (or the file), recommend, check and print."""
    node, status = _from_file(args.source) if args.source else _from_node(args)
    catalog = default_catalog()
    advice = recommend(node, status, catalog)
    text = yaml.safe_dump(advice.config, sort_keys=False, default_flow_style=None)
    checked = parse_configmap({args.name: text}, gpus=node.gpus, catalog=catalog)
    if checked.errors:  # a bug of ours: never print a config the agent would refuse
        raise SharingError(
            "the recommended config fails the checks a ConfigMap's config gets: "
            + listed(str(p) for p in checked.errors)
        )
    if args.json:
        print_json(_json(advice, args.name, text, status))
    else:
        print(_comments(advice, args.name, status) + text, end="")
    return 0


def _from_node(args: argparse.Namespace) -> tuple[NodeState, dict[str, Any]]:
    status = agent_status(args.port)
    if status is None:
        raise UsageError(
            "no agent answered on this node: run it in the agent's pod (kubectl -n gpu-sharing exec "
            "ds/gpu-sharing -- sharing recommend), or give --from a `sharing export --json` taken there"
        )
    return observe_from_args(args), status


def _from_file(source: str) -> tuple[NodeState, dict[str, Any]]:
    try:
        if source == "-":
            raw = sys.stdin.buffer.read(MAX_EXPORT_BYTES + 1)
        else:
            with Path(source).open("rb") as stream:
                raw = stream.read(MAX_EXPORT_BYTES + 1)
    except OSError as err:
        raise UsageError(f"cannot read {source}: {err.strerror or err}") from err
    if len(raw) > MAX_EXPORT_BYTES:
        raise UsageError(f"{source} is larger than {MAX_EXPORT_BYTES >> 20} MiB: not a `sharing export`")
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"{source} is not JSON (`sharing export --json` writes it): {err}") from None
    node, status = read_export(document)
    if status is None:
        raise UsageError(
            f"{source} has no usage: it was exported where no agent answered; export in the agent's pod "
            "(kubectl -n gpu-sharing exec ds/gpu-sharing -- sharing export --json)"
        )
    return node, status


def _comments(advice: Recommendation, name: str, status: dict[str, Any]) -> str:
    usage = status.get("usage") or {}
    lines = [
        f"sharing recommend: config {name!r} for node {status.get('node') or '(unknown)'}, from its usage "
        f"sampled {usage.get('sampledAt')} over {duration(usage.get('windowSeconds') or 0)}",
        "each held MIG device at its right size (the smallest profile holding its peak memory + 10 % and "
        "its SM p95 where known); free devices kept, and what the right sizes give back made into the "
        "largest profiles that fit; checked against this node's GPUs",
        "",
    ]
    for gpu in advice.gpus:
        lines += _gpu_lines(gpu)
    lines += [f"note: {n}" for n in advice.notes]
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def _gpu_lines(gpu: GpuAdvice) -> list[str]:
    head = f"GPU {gpu.index}  {gpu.product}: "
    if not gpu.resized:
        lines = [head + gpu.note]
        for h in gpu.fits:
            where = f"in MIG, {h.right} would hold it" if h.right else (h.why or "no right size yet")
            if h.right is not None and h.right == gpu.largest:
                where = f"only {h.right}, the whole GPU in MIG, would hold it: no smaller profile does"
            lines.append(f"  {h.holder}: {where}")
        return lines
    held = _counted(gpu.held) or "nothing"
    if gpu.changes:
        head += f"held {held} -> {_counted(gpu.right_sized)}"
    else:
        head += f"held {held}" + ("" if not gpu.held else ", at its right size" if len(gpu.held) == 1 else
                                  ", at their right sizes")  # fmt: skip
    if gpu.frees != (0, 0):
        head += f": frees {gpu.frees[0]} compute and {gpu.frees[1]} memory slices"
    stay = list((Counter(gpu.free_room) - Counter(gpu.made)).elements())
    parts = ([_counted(stay) + (" as it is" if len(stay) == 1 else " as they are")] if stay else []) + (
        [f"new {_counted(gpu.made)}"] if gpu.made else []
    )
    lines = [
        head,
        f"  free room {gpu.room[0]} compute and {gpu.room[1]} memory slices: " + ("; ".join(parts) or "none"),
    ]
    for c in gpu.changes:
        then = (
            "the rollout waits for it to end (or drain mode evicts it)"
            if c.waits
            else "it keeps its slice while it runs (the new layout has room around it), then it is free room"
        )
        lines.append(f"  {c.holder} holds {c.profile} {c.device}, right size {c.to}: {then}")
    if gpu.note:
        lines.append(f"  {gpu.note}")
    return lines


def _counted(profiles: Sequence[str]) -> str:
    """`3g.20gb, 2x 1g.5gb`, in the order given."""
    counts = Counter(profiles)
    return ", ".join(name if n == 1 else f"{n}x {name}" for name, n in counts.items())


def _json(advice: Recommendation, name: str, text: str, status: dict[str, Any]) -> dict[str, Any]:
    return {
        "node": status.get("node"),
        "name": name,
        "config": text,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "product": g.product,
                "resized": g.resized,
                "note": g.note,
                "held": list(g.held),
                "rightSized": list(g.right_sized),
                "freeRoom": list(g.free_room),
                "made": list(g.made),
                "frees": {"computeSlices": g.frees[0], "memorySlices": g.frees[1]},
                "room": {"computeSlices": g.room[0], "memorySlices": g.room[1]},
                "changes": [
                    {
                        "holder": c.holder,
                        "device": c.device,
                        "profile": c.profile,
                        "to": c.to,
                        "waits": c.waits,
                    }
                    for c in g.changes
                ],
                "waits": g.waits,
                "fits": [
                    {
                        "holder": h.holder,
                        "slice": h.id,
                        "profile": h.right,
                        "why": h.why,
                        "smaller": h.right is not None and h.right != g.largest,
                    }
                    for h in g.fits
                ],
            }
            for g in advice.gpus
        ],
        "notes": list(advice.notes),
    }
