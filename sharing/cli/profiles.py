"""`sharing profiles --gpu PRODUCT`: the catalog entry of one product, as a table or JSON."""

from __future__ import annotations

import argparse

from sharing.catalog import Product
from sharing.cli.common import Subparsers, print_json, product_arg


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser("profiles", help="list the MIG profiles and placements of a GPU product")
    parser.add_argument(
        "--gpu", required=True, metavar="PRODUCT", help="e.g. A100-SXM4-40GB or 'NVIDIA H100 80GB HBM3'"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the product's profiles."""
    product = product_arg(args.gpu)
    if args.json:
        print_json(profiles_json(product))
        return 0
    print(
        f"{product.name}: {product.memory_slices} memory slices, {product.compute_slices} compute slices, "
        f"{product.memory_mib} MiB"
    )
    header = ("PROFILE", "ID", "MEMORY", "COMPUTE", "MAX", "MiB", "PLACEMENTS")
    rows = [
        (
            p.name,
            str(p.id),
            str(p.memory_slices),
            str(p.compute_slices),
            str(p.max_count),
            str(p.memory_mib),
            ",".join(map(str, p.placements)) + f" (size {p.size})",
        )
        for p in product.profiles
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not product.placements_verified:
        print("note: placements are inferred for this product; compare with `nvidia-smi mig -lgipp`")
    return 0


def profiles_json(product: Product) -> list[dict[str, object]]:
    """The JSON shape of `sharing profiles --json`."""
    return [
        {
            "name": p.name,
            "id": p.id,
            "enum": p.enum,
            "memorySlices": p.memory_slices,
            "computeSlices": p.compute_slices,
            "maxCount": p.max_count,
            "memoryMiB": p.memory_mib,
            "placements": list(p.placements),
            "placementSize": p.size,
            "placementsVerified": product.placements_verified,
        }
        for p in product.profiles
    ]
