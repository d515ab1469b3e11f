"""`sharing status`: the node's GPUs, every slice, who holds it, and the config selected and in effect;
with `--usage`, what each GPU draws and uses and what each slice's pod uses of it (docs/metrics.md).

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
from sharing.text import duration

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
    parser.add_argument(
        "--usage", action="store_true",
        help="per GPU its power, temperature, memory and utilization; per slice the memory its pod uses of "
        "its size, SM where known, idle for, peak and SM p95 over the window (the agent's usage sampler)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object (usage included)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Fetch (or build) the status and print it."""
    document = agent_status(args.port)
    if document is None:
        document = asyncio.run(_observed(args))
    if args.json:
        print_json(document)
    else:
        print(describe(document, usage=args.usage))
    return 0


def agent_status(port: int | None = None) -> dict[str, Any] | None:
    """The status the agent on this node serves (`port` None: SHARING_HTTP_PORT, else 9402); None
    when none answers (or the port is 0)."""
    if port is None:
        port = int(os.environ.get("SHARING_HTTP_PORT") or DEFAULT_PORT)
    if not port:
        return None
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


USAGE_COLUMNS = ("MEMORY USED", "SM", "IDLE FOR", "PEAK", "SM P95", "RIGHT SIZE")


def _usage_header(summary: dict[str, Any]) -> list[str]:
    if not summary.get("enabled"):
        return ["usage: not sampled (the agent's usage.enabled is false, or no agent answered)"]
    if not summary.get("sampledAt"):
        return ["usage: no sample yet"]
    idle = summary.get("idleAfterSeconds")
    lines = [
        f"usage sampled {summary['sampledAt']}, every {summary['intervalSeconds']:g} s; peak and SM p95 over "
        f"{duration(summary['windowSeconds'])}"
        + (f"; idle after {duration(idle)}" if idle else "")
        + "; right size: the smallest MIG profile holding the peak memory + 10 % (and the SM p95 if known)"
    ]
    if not summary.get("holdersKnown", True):
        lines.append("  who holds which slice could not be read at the sample: no slice shows its use")
    lines += [f"  {p}" for p in summary.get("problems") or ()]
    return lines


def _gpu_usage(use: dict[str, Any]) -> list[str]:
    parts = [
        f"{use['powerWatts']:.0f} W" if use["powerWatts"] is not None else "power -",
        f"{use['temperatureCelsius']:.0f} °C" if use["temperatureCelsius"] is not None else "temperature -",
        f"memory {_of(use['memoryUsedBytes'], use['memoryTotalBytes'])}",
        f"utilization {_ratio(use['utilization'])}" if use["utilization"] is not None else "",
        "" if use["gpm"] else "no GPM (SM of MIG devices unknown)" if use["devices"] else "",
    ]
    lines = ["  " + ", ".join(p for p in parts if p)]
    for u in use["unattributed"]:
        pids = ", ".join(map(str, u["pids"]))
        lines.append(f"  unattributed: {_bytes(u['memoryUsedBytes'])} on {u['device']} (PID {pids})")
    return lines


def _slice_usage(entry: dict[str, Any]) -> tuple[str, ...]:
    use = entry.get("usage")
    if not use:
        return ("-",) * len(USAGE_COLUMNS)
    return (
        _of(use["memoryUsedBytes"], use["memoryTotalBytes"]),
        _ratio(use["smActive"]),
        (duration(use["idleSeconds"]) + (", idle" if use.get("idle") else ""))
        if use["idleSeconds"]
        else "in use",
        _bytes(use["peakMemoryBytes"]) if use["peakMemoryBytes"] is not None else "-",
        _ratio(use["smActiveP95"]),
        _right_size(use.get("rightSize")),
    )


def _right_size(size: dict[str, Any] | None) -> str:
    """`1g.5gb`, `1g.5gb (memory only)` where no SM figure is known, `none` (the reason below the table)."""
    if not size:
        return "-"
    if not size["profile"]:
        return "none"
    return str(size["profile"]) + (" (memory only)" if size["basis"] == "memory" else "")


def _no_right_size(slices: list[dict[str, Any]]) -> list[str]:
    """Why a held slice has no right size: no profile of its GPU holds it, or the GPU has no MIG."""
    return [
        f"  right size of {s['id']}: none, {size['why']}"
        for s in slices
        if (size := (s.get("usage") or {}).get("rightSize")) and not size["profile"]
    ]


def _of(used: int | None, total: int | None) -> str:
    if used is None:
        return "-"
    return _bytes(used) + (f" of {_bytes(total)}" if total else "")


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    mib = value / 2**20
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


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


def describe(status: dict[str, Any], *, usage: bool = False) -> str:
    """A table per GPU for people, under a header with the config and the last change (`usage`: the
    usage sampler's figures too)."""
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
    if usage:
        lines += _usage_header(status.get("usage") or {})
    for gpu in status.get("gpus", []):
        lines.append("")
        lines.append(
            f"GPU {gpu['index']}  {gpu['product']}  {gpu['uuid']}  MIG {gpu['mig']}  {gpu['health']}"
            + (f"  config {gpu['config']}" if gpu.get("config") else "")
        )
        if usage and gpu.get("usage"):
            lines += _gpu_usage(gpu["usage"])
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
        rows = [("RESOURCE", "DEVICE", "PROFILE", "HEALTH", "HELD BY", *(USAGE_COLUMNS if usage else ()))] + [
            (
                s["resource"],
                s["id"] + _made(s.get("onDemand")),
                s.get("profile") or "-",
                s["health"],
                _held_by(s),
                *(_slice_usage(s) if usage else ()),
            )
            for s in gpu["slices"]
        ]
        if len(rows) == 1:
            if dynamic != "onDemand":  # its devices are the DRA pool's placements, made per claim
                lines.append("  (nothing advertised)")
            continue
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        if usage:
            lines += _no_right_size(gpu["slices"])
    for lost in status.get("unreadable", []):
        lines.append(f"\nGPU {lost['index']}  cannot be read: {lost['error']}")
    return "\n".join(lines)
