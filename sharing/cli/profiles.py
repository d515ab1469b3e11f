"""`sharing profiles --gpu GPU`: the catalog entry of one GPU, as a table or JSON, with its sources.

GPU is a catalog name, an NVML name or a PCI device id. At run time the agent uses the profiles the
driver reports; this is what the catalog knows offline (and what the simulator plays).
"""

from __future__ import annotations

import argparse

from sharing.cli.common import Subparsers, gpu_arg, print_json
from sharing.mig import PlainProduct, Product


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser("profiles", help="list the MIG profiles and placements of a GPU")
    parser.add_argument(
        "--gpu",
        required=True,
        metavar="GPU",
        help="catalog name, NVML name or PCI device id, e.g. A100-SXM4-40GB, 'NVIDIA H100 80GB HBM3', 0x2335",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the GPU's profiles (or say it has none)."""
    found = gpu_arg(args.gpu)
    if isinstance(found, PlainProduct):
        if args.json:
            print_json({"name": found.name, "mig": False, "timeSlicing": True, "profiles": []})
        else:
            print(
                f"{found.name} has no MIG: it cannot be partitioned, but it can be time-sliced "
                "or shared with MPS (a rule with `replicas`, e.g. the all-replicas-4 preset, or `mps`)"
            )
        return 0
    product = found
    if args.json:
        print_json(profiles_json(product))
        return 0
    print(
        f"{product.name}: {product.slots} placement slots, {product.compute_slices} compute slices, "
        f"{product.memory_mib} MiB"
    )
    header = ("PROFILE", "ID", "SLICES", "MAX", "MiB", "SMS", "PLACEMENTS", "MEMORY SOURCE")
    rows = [
        (
            p.name,
            str(p.id),
            str(p.compute_slices),
            str(p.max_count),
            str(p.memory_mib),
            "-" if p.multiprocessors is None else str(p.multiprocessors),
            ",".join(map(str, p.placements)) + f" (size {p.size})",
            p.source,
        )
        for p in product.profiles
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not product.profiles:
        print("no profiles are known to the catalog: the agent uses what the driver reports")
    print(f"placements: {product.placements_source}")
    if not product.placements_verified:
        print("note: placements are inferred for this product; compare with `nvidia-smi mig -lgipp`")
    return 0


def profiles_json(product: Product) -> list[dict[str, object]]:
    """The JSON shape of `sharing profiles --json` for a MIG GPU."""
    return [
        {
            "name": p.name,
            "id": p.id,
            "enum": p.enum,
            "computeSlices": p.compute_slices,
            "maxCount": p.max_count,
            "memoryMiB": p.memory_mib,
            "memorySource": p.source,
            "multiprocessors": p.multiprocessors,
            "placements": list(p.placements),
            "placementSize": p.size,
            "placementSlots": product.slots,
            "placementsVerified": product.placements_verified,
        }
        for p in product.profiles
    ]
