"""`sharing status`: the node's GPUs, every slice, who holds it, and the config selected and in effect.

It asks the agent on this node (its /status on SHARING_HTTP_PORT, 9402 by default: inside the
agent's pod, `kubectl exec ds/gpu-sharing -- sharing status`); when no agent answers it observes the
GPUs and the kubelet's PodResources itself and says that the config side is unknown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sharing.cli.common import Subparsers, print_json
from sharing.cli.gpuargs import add_backend_arguments, open_from_args
from sharing.settings import DEFAULT_POD_RESOURCES_SOCKET

DEFAULT_PORT = 9402


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "status",
        help="show the GPUs, every slice, the pod holding it, and the config in effect",
        description="Ask the agent on this node (SHARING_HTTP_PORT, default 9402); without an agent, "
        "observe the GPUs and the kubelet's PodResources directly.",
    )
    parser.add_argument(
        "--port", type=int, default=None, help=f"the agent's HTTP port [SHARING_HTTP_PORT; {DEFAULT_PORT}]"
    )
    add_backend_arguments(parser)
    parser.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=None,
        help=f"without an agent: the kubelet's PodResources socket [SHARING_POD_RESOURCES_SOCKET; "
        f"{DEFAULT_POD_RESOURCES_SOCKET}]",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Fetch (or build) the status and print it."""
    port = args.port if args.port is not None else int(os.environ.get("SHARING_HTTP_PORT") or DEFAULT_PORT)
    document = _from_agent(port) if port else None
    if document is None:
        document = asyncio.run(_observed(args))
    if args.json:
        print_json(document)
    else:
        print(describe(document))
    return 0


def _from_agent(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as answer:
            value = json.loads(answer.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return value if isinstance(value, dict) else None


async def _observed(args: argparse.Namespace) -> dict[str, Any]:
    from sharing.devices import build_inventory
    from sharing.kubelet import PodResourcesClient, read_holders
    from sharing.ops import ConfigStatus, status_document

    backend = open_from_args(args)
    try:
        node = await backend.observe()
    finally:
        await backend.close()
    socket = args.pod_resources_socket or Path(
        os.environ.get("SHARING_POD_RESOURCES_SOCKET") or DEFAULT_POD_RESOURCES_SOCKET
    )
    holders = await read_holders(PodResourcesClient(socket, timeout=3))
    document = status_document(
        os.environ.get("SHARING_NODE_NAME", ""),
        node,
        build_inventory(node, None),
        None if holders.unknown else holders.pods,
        ConfigStatus(
            source="no agent answered: the GPUs as they are, advertised as they would be without a config"
        ),
        holders_error=holders.unknown,
    )
    document["agent"] = False
    return document


def _held_by(entry: dict[str, Any]) -> str:
    """The pod holding a slice (device plugins), or the claims allocated it with their pods (DRA)."""
    if entry.get("pod"):
        return f"{entry['pod']['namespace']}/{entry['pod']['pod']}/{entry['pod']['container']}"
    claims = [
        f"claim {c['namespace']}/{c['name']}" + (f" (pod {', '.join(c['pods'])})" if c["pods"] else "")
        for c in entry.get("claims") or ()
    ]
    return "; ".join(claims) or "-"


def _foreign(f: dict[str, Any]) -> str:
    """A MIG instance on a dynamic GPU that the agent did not make."""
    migs = (", ".join(f["uuids"]) or "no MIG device") + (", busy" if f["busy"] else "")
    return (
        f"  foreign MIG instance {f['profile']} at slot {f['start']} ({migs}): "
        + (f"offered as {f['device']}" if f["device"] else "not one whole MIG device, not offered")
        + (f", held by claim {f['claim']}" if f["claim"] else "")
        + ("; destroyed once idle and unclaimed" if f["reclaimedWhenIdle"] else "; never destroyed")
    )


def _daemon(what: str, daemon: dict[str, Any]) -> str:
    """An MPS control daemon: a GPU's, or that of an on-demand MIG device a claim shares."""
    enforced = daemon.get("enforced")
    answer = (
        "healthy" if daemon["healthy"] else
        "not answering" if enforced is None else
        f"answers {enforced['activeThreadPercentage']}% / {enforced['pinnedMemoryMiB']} MiB"
    )  # fmt: skip
    return (
        f"  {what} {answer}: {daemon['activeThreadPercentage']}% of the threads and"
        f" {daemon['pinnedMemoryMiB']} MiB per client, pipes {daemon['pipeDirectory']},"
        f" restarts {daemon['restarts']}" + (f"; {daemon['error']}" if daemon.get("error") else "")
    )


def _made(where: dict[str, Any] | None) -> str:
    """Where an instance made for a claim on a dynamic GPU sits, as the DRA pool names it."""
    if not where:
        return ""
    return f" ({where['device']}{'' if where['made'] else ', adopted'})"


def describe(status: dict[str, Any]) -> str:
    """A table per GPU for people, under a header with the config and the last change."""
    config = status.get("config", {})
    lines = [
        f"node {status.get('node') or '(unknown)'}: config {config.get('selected') or '(none)'}"
        + (f" ({config['source']})" if config.get("source") else "")
        + (f"; front-end {status['frontend']}" if status.get("frontend") else ""),
        f"state {config.get('state') or '(unknown)'}; "
        f"in effect: {', '.join(config.get('inEffect') or []) or '(none)'}",
    ]
    warnings = config.get("warnings") or []
    if warnings:
        lines.append(f"warnings of config {config.get('selected')}:")
        lines += [f"  {w['path']}: {w['message']}" if w["path"] else f"  {w['message']}" for w in warnings]
    others = {c: n for c, n in (config.get("warningsPerConfig") or {}).items() if c != config.get("selected")}
    if others:
        counted = ", ".join(f"{c} {n}" for c, n in others.items())
        lines.append(f"warnings of the other configs (in the agent's log, `config_warnings`): {counted}")
    change = status.get("lastChange") or {}
    if change:
        lines.append(
            f"last change {change.get('time', '')} {change.get('reason', '')}: {change.get('message', '')}"
        )
    holders = status.get("holders", {})
    if not holders.get("known", True):
        lines.append(f"who holds what is unknown: {holders.get('error', '')}")
    for gpu in status.get("gpus", []):
        lines.append("")
        lines.append(
            f"GPU {gpu['index']}  {gpu['product']}  {gpu['uuid']}  MIG {gpu['mig']}  {gpu['health']}"
            + (f"  config {gpu['config']}" if gpu.get("config") else "")
        )
        dynamic = gpu.get("dynamic")
        if dynamic:
            lines.append(
                "  mig: dynamic: MIG devices made per claim (DRA front-end)"
                if dynamic == "onDemand"
                else "  mig: dynamic, but this GPU has no MIG: offered as a whole GPU"
            )
        room = gpu.get("room")
        if room:
            largest = room["largestProfile"] or "none"
            lines.append(
                f"  room: largest profile still placeable {largest}; {room['freeComputeSlices']} compute"
                f" slices free, {room['strandedComputeSlices']} of them stranded (no placement can use them)"
            )
        if gpu.get("mps"):
            lines.append(_daemon("MPS daemon", gpu["mps"]))
        lines += [_foreign(f) for f in gpu.get("foreign") or ()]
        lines += [_daemon(f"MPS daemon of {s['id']}", s["mps"]) for s in gpu["slices"] if s.get("mps")]
        rows = [("RESOURCE", "DEVICE", "PROFILE", "HEALTH", "HELD BY")] + [
            (
                s["resource"],
                s["id"] + _made(s.get("onDemand")),
                s.get("profile") or "-",
                s["health"],
                _held_by(s),
            )
            for s in gpu["slices"]
        ]
        if len(rows) == 1:
            if dynamic != "onDemand":  # its devices are the DRA pool's placements, made per claim
                lines.append("  (nothing advertised)")
            continue
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for lost in status.get("unreadable", []):
        lines.append(f"\nGPU {lost['index']}  cannot be read: {lost['error']}")
    return "\n".join(lines)
