"""`sharing export`: the GPUs as they are (MIG mode, instances, MIG UUIDs, busy).

As a table, as JSON, or as a mig-parted config (`--format mig-parted`) that `sharing apply` and
mig-parted both take back to the same layout: one entry per group of GPUs with the same PCI id and
MIG layout, each with its exact `device-filter`, GPU indices and profile counts. Each MIG device goes
by its own profile (`sharing.mig.device_profile`): a compute instance smaller than its GPU instance
is `1c.3g.20gb`, which mig-parted makes and `sharing apply` refuses (it makes whole GPU instances).
The JSON carries each GPU's MIG profiles as its driver reports them and, where the node's agent
answers (in its pod), the agent's status with what each held slice's pod used and its right size
(`sharing.ops.exported`): `sharing recommend --from FILE` reads it back.
"""

from __future__ import annotations

import argparse
from collections import Counter

import yaml

from sharing.cli.common import Subparsers, print_json
from sharing.cli.gpuargs import add_backend_arguments, observe_from_args
from sharing.cli.status import DEFAULT_PORT, agent_status
from sharing.mig import device_profile
from sharing.model import NodeState
from sharing.ops.exported import export_document


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "export",
        help="show the GPUs, their MIG mode and instances",
        description="Observe the node's GPUs (read-only) and print each one's MIG mode and instances.",
    )
    add_backend_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (same as --format json)")
    parser.add_argument(
        "--format",
        choices=("table", "json", "mig-parted"),
        default=None,
        help="table (default), json, or a mig-parted config of the current layout",
    )
    parser.add_argument(
        "--name", default="current", metavar="CONFIG", help="config name in the mig-parted output (current)"
    )
    parser.add_argument(
        "--port", type=int, default=None,
        help="JSON: the agent's HTTP port, whose status (usage included) the document carries "
        f"[SHARING_HTTP_PORT; {DEFAULT_PORT}; 0: none]",
    )  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Observe and print."""
    state = observe_from_args(args)
    form = args.format or ("json" if args.json else "table")
    if form == "json":
        print_json(export_document(state, agent_status(args.port)))
    elif form == "mig-parted":
        print(migparted_yaml(state, args.name), end="")
    else:
        print(describe(state))
    return 0


def migparted_yaml(state: NodeState, name: str = "current") -> str:
    """The node's current layout as a mig-parted config named `name`."""
    groups: dict[tuple[int | None, bool, tuple[tuple[str, int], ...]], list[int]] = {}
    for gpu in state.gpus:
        # Per MIG device, as mig-parted counts them: three 1-slice compute instances of one 3g.20gb GPU
        # instance are `1c.3g.20gb: 3` (mig-parted puts them in one GPU instance; `sharing apply` makes
        # no such layout and says so).
        counts = (
            Counter(device_profile(gi, ci) for gi in gpu.instances for ci in gi.compute_instances)
            if gpu.mig_enabled
            else Counter()
        )
        key = (gpu.pci_device_id or None, gpu.mig_enabled, tuple(sorted(counts.items())))
        groups.setdefault(key, []).append(gpu.index)
    entries: list[dict[str, object]] = []
    for (pci, enabled, profiles), indices in groups.items():
        entry: dict[str, object] = {}
        if pci is not None:
            entry["device-filter"] = f"0x{pci:08X}"
        entry["devices"] = indices
        entry["mig-enabled"] = enabled
        if enabled:
            entry["mig-devices"] = dict(profiles)
        entries.append(entry)
    return yaml.safe_dump({"version": "v1", "mig-configs": {name: entries}}, sort_keys=False)


def describe(state: NodeState) -> str:
    """One block per GPU, one line per MIG device."""
    if not state.gpus:
        return "no GPUs"
    lines = []
    for gpu in state.gpus:
        mode = "no MIG"
        if gpu.mig_capable:
            mode = f"MIG {'on' if gpu.mig_enabled else 'off'}"
            if gpu.mig_pending != gpu.mig_enabled:
                mode += f" ({'on' if gpu.mig_pending else 'off'} after reset)"
        lines.append(f"GPU {gpu.index}  {gpu.product}  {gpu.uuid}  {mode}{'  busy' if gpu.busy else ''}")
        for gi in gpu.instances:
            slices = f"slices {gi.start}-{gi.start + gi.size - 1}"
            for ci in gi.compute_instances:
                profile = device_profile(gi, ci)
                lines.append(f"  {profile:<12} {slices:<12} {ci.uuid}{'  busy' if ci.busy else ''}")
            if not gi.compute_instances:
                lines.append(f"  {gi.profile:<12} {slices:<12} (no compute instance)")
    return "\n".join(lines)
