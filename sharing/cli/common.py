"""Helpers the commands share: usage errors, product lookup, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TypeAlias

from sharing.mig import AnyProduct, PlainProduct, Product, default_catalog

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(Exception):
    """Bad arguments: exit code 2 with a one-line message."""


def gpu_arg(name: str) -> AnyProduct:
    """The catalog entry for a --gpu argument: catalog name, NVML name or PCI id (`0x2335`)."""
    catalog = default_catalog()
    found = catalog.describe(name)
    if found is None:
        known = ", ".join([p.name for p in catalog.products] + [p.name for p in catalog.plain])
        raise UsageError(
            f"unknown GPU {name!r}: give a catalog name, an NVML name or a PCI device id like 0x2335 "
            f"(known: {known})"
        )
    return found


def product_arg(name: str) -> Product:
    """The MIG product for a --gpu argument; an unknown GPU or one without MIG is a usage error."""
    found = gpu_arg(name)
    if isinstance(found, PlainProduct):
        raise UsageError(
            f"{found.name} has no MIG: it can only be time-sliced or shared with MPS "
            "(a rule with `replicas` or `mps`)"
        )
    return found


def print_json(value: Any) -> None:
    """Write one JSON document to stdout."""
    json.dump(value, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
