"""`sharing apply`: make this node's GPUs match one named config (or, with --dry-run, show the plan)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from sharing import logs
from sharing.cli.common import Subparsers, UsageError, print_json
from sharing.cli.gpuargs import add_backend_arguments, open_from_args
from sharing.config import InvalidConfigError, SharingConfig, load_yaml, parse_configmap, parse_file
from sharing.mig import default_catalog
from sharing.rollout import ApplyReport, apply_config
from sharing.settings import DEFAULT_POD_RESOURCES_SOCKET
from sharing.store import DEFAULT_JOURNAL, Journal


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "apply",
        help="partition the GPUs as a named config says",
        description="Apply the smallest change that makes the GPUs match config NAME of FILE (one config "
        "document, a mig-parted file, or a ConfigMap manifest). Busy instances are kept (processes, and "
        "devices pods hold per the kubelet's PodResources: when it cannot be read, no device is "
        "destroyed); MIG mode only changes on idle GPUs and no GPU is ever reset. Exit 0 applied or "
        "nothing to do, 1 could not apply (the reason per GPU), 2 bad arguments.",
    )
    parser.add_argument("--config", required=True, type=Path, metavar="FILE", help="config file")
    parser.add_argument("--name", required=True, metavar="CONFIG", help="name of the config to apply")
    add_backend_arguments(parser)
    parser.add_argument(
        "--journal",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"journal of hardware steps for crash recovery [SHARING_JOURNAL; default: {DEFAULT_JOURNAL}]",
    )
    parser.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=None,
        metavar="PATH",
        help="the kubelet's PodResources socket "
        f"[SHARING_POD_RESOURCES_SOCKET; default {DEFAULT_POD_RESOURCES_SOCKET}]",
    )
    parser.add_argument(
        "--no-kubelet",
        action="store_true",
        help="this node runs no kubelet: only processes count as users of a device",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan per GPU and change nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Load the config, apply it, print the per-GPU result."""
    config = load_config(args.config, args.name)
    journal = Journal(journal_path(args))
    if not args.dry_run:
        journal.refuse_agent()
    logs.configure()
    report = asyncio.run(_apply(args, config, journal))
    if args.json:
        print_json(report_json(report))
    else:
        print(describe(report, dry_run=args.dry_run))
    return 0 if report.ok else 1


async def _apply(args: argparse.Namespace, config: SharingConfig, journal: Journal) -> ApplyReport:
    from sharing.kubelet import PodResourcesClient, read_holders

    backend = open_from_args(args)
    try:
        observed = await backend.observe()
        holders = await read_holders(
            None if args.no_kubelet else PodResourcesClient(pod_resources_socket(args))
        )
        if holders.unknown:
            print(
                f"sharing: warning: {holders.unknown}; every device counts as in use, so none is destroyed "
                "(pass --no-kubelet if this node runs no kubelet)",
                file=sys.stderr,
            )
        return await apply_config(
            backend,
            config,
            catalog=default_catalog(),
            journal=journal,
            dry_run=args.dry_run,
            busy_uuids=holders.busy_uuids(observed),
            observed=observed,
        )
    finally:
        await backend.close()


def pod_resources_socket(args: argparse.Namespace) -> Path:
    """--pod-resources-socket > SHARING_POD_RESOURCES_SOCKET > the kubelet's default."""
    if args.pod_resources_socket is not None:
        return Path(args.pod_resources_socket)
    return Path(os.environ.get("SHARING_POD_RESOURCES_SOCKET") or DEFAULT_POD_RESOURCES_SOCKET)


def load_config(path: Path, name: str) -> SharingConfig:
    """Config `name` from a file: a config document, a mig-parted file, or a ConfigMap manifest."""
    try:
        text = path.read_text("utf-8")
    except OSError as err:
        raise UsageError(f"--config: cannot read {path}: {err.strerror}") from err
    document = load_yaml(text, name)
    # Like the agent: a broken config elsewhere in the ConfigMap or mig-parted file does not block this one.
    if isinstance(document, dict) and document.get("kind") == "ConfigMap":
        parsed = parse_configmap(document.get("data") or {})
    else:
        parsed = parse_file(name, text)
    problems = parsed.errors_for(name) or (parsed.errors if not parsed.configs else ())
    if problems:
        raise InvalidConfigError(problems)
    configs = parsed.configs
    chosen = next((c for c in configs if c.name == name), None)
    if chosen is None:
        raise UsageError(
            f"--name: {path} has no config {name!r} (it has: {', '.join(c.name for c in configs)})"
        )
    return chosen


def journal_path(args: argparse.Namespace) -> Path:
    """--journal > SHARING_JOURNAL > the agent's default."""
    if args.journal is not None:
        return Path(args.journal)
    if os.environ.get("SHARING_JOURNAL"):
        return Path(os.environ["SHARING_JOURNAL"])
    return DEFAULT_JOURNAL


def report_json(report: ApplyReport) -> dict[str, object]:
    """The JSON shape of `sharing apply --json`."""
    return {
        "ok": report.ok,
        "resumed": report.resumed,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "product": g.product,
                "outcome": g.outcome.value,
                "steps": [str(s) for s in g.steps],
                "reason": g.reason,
                "blockers": list(g.blockers),
            }
            for g in report.gpus
        ],
    }


def describe(report: ApplyReport, *, dry_run: bool) -> str:
    """One line per GPU, its steps indented below."""
    lines = ["recovered an interrupted apply from the journal"] if report.resumed else []
    for g in report.gpus:
        lines.append(
            f"GPU {g.index}  {g.product}  {g.uuid}  {g.outcome.value}" + (f": {g.reason}" if g.reason else "")
        )
        lines.extend(f"  {i}. {step}" for i, step in enumerate(g.steps, 1))
    if not report.gpus:
        lines.append("no GPUs")
    if dry_run:
        lines.append("dry run: nothing was changed")
    return "\n".join(lines)
