"""Helpers the commands share: usage errors, product lookup, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TypeAlias

from sharing.catalog import Product, default_catalog
from sharing.errors import CatalogError

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(Exception):
    """Bad arguments: exit code 2 with a one-line message."""


def product_arg(name: str) -> Product:
    """The catalog product for a --gpu argument; an unknown name is a usage error."""
    try:
        return default_catalog().product(name)
    except CatalogError as err:
        raise UsageError(str(err)) from err


def print_json(value: Any) -> None:
    """Write one JSON document to stdout."""
    json.dump(value, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
