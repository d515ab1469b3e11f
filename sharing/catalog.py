"""The hardware catalog: MIG products, their GPU-instance profiles and valid placements.

`catalog.yaml` (shipped inside the package) is the single source of truth for the planner,
`sharing validate` and the simulated GPUs. This module turns it into frozen values, looks products
up by the names NVML and people use, and derives profile names the way NVIDIA does.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from sharing.errors import CatalogError

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU-instance profile of one product (`3g.20gb` on an A100-SXM4-40GB)."""

    name: str
    enum: int
    id: int
    memory_slices: int
    compute_slices: int
    max_count: int
    memory_mib: int
    placements: tuple[int, ...]

    @property
    def size(self) -> int:
        """Placement size: the number of memory slices an instance occupies."""
        return self.memory_slices


@dataclass(frozen=True, slots=True)
class Product:
    """A MIG-capable GPU product and everything the planner needs to place instances on it."""

    name: str
    nvml_names: tuple[str, ...]
    pci_device_ids: tuple[int, ...]
    memory_mib: int
    memory_slices: int
    compute_slices: int
    profiles: tuple[Profile, ...]
    placements_verified: bool
    memory_verified: bool

    def profile(self, name: str) -> Profile | None:
        """The profile called `name` on this product, or None."""
        for profile in self.profiles:
            if profile.name == name:
                return profile
        return None

    def require_profile(self, name: str) -> Profile:
        """The profile called `name`, or a CatalogError listing the valid names."""
        profile = self.profile(name)
        if profile is None:
            known = ", ".join(p.name for p in self.profiles)
            raise CatalogError(f"unknown MIG profile {name!r} on {self.name} (valid: {known})")
        return profile


@dataclass(frozen=True, slots=True)
class Catalog:
    """All known products."""

    products: tuple[Product, ...]
    _by_key: dict[str, Product] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Lookups happen on every observation of every GPU: index the names once.
        for product in self.products:
            for name in (product.name, *product.nvml_names):
                self._by_key.setdefault(product_key(name), product)

    def find(self, name: str) -> Product | None:
        """Look a product up by catalog name or NVML name, with or without `NVIDIA `."""
        return self._by_key.get(product_key(name))

    def product(self, name: str) -> Product:
        """Like find(), but an unknown name is a CatalogError listing the known ones."""
        product = self.find(name)
        if product is None:
            known = ", ".join(p.name for p in self.products)
            raise CatalogError(f"unknown GPU product {name!r} (known: {known})")
        return product

    def by_pci_device_id(self, device_id: int) -> Product | None:
        """The product with this PCI device id (e.g. 0x20B0), as mig-parted device filters name them."""
        for product in self.products:
            if device_id in product.pci_device_ids:
                return product
        return None


def product_key(name: str) -> str:
    """Normalise a product name: case-insensitive, `NVIDIA ` optional, spaces/dashes/underscores alike."""
    key = re.sub(r"[\s_-]+", "-", name.strip().lower())
    return key.removeprefix("nvidia-")


def mig_memory_gb(memory_mib: int, total_memory_mib: int) -> int:
    """The `<GB>` of a profile name, derived as go-nvlib does (round half away from zero)."""
    fraction = math.ceil(memory_mib * MIB / (total_memory_mib * MIB) * 8) / 8
    total_gb = math.ceil(total_memory_mib * MIB / GIB)
    return math.floor(fraction * total_gb + 0.5)


def load_catalog(text: str) -> Catalog:
    """Parse catalog YAML text into a Catalog (pure; raises CatalogError on a broken file)."""
    try:
        data = yaml.safe_load(text)
        layouts: Mapping[str, Any] = data["layouts"]
        products = tuple(
            _product(name, spec, layouts[spec["layout"]]) for name, spec in data["products"].items()
        )
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise CatalogError(f"the hardware catalog is broken: {err!r}") from err
    return Catalog(products)


def _product(name: str, spec: Mapping[str, Any], layout: Mapping[str, Any]) -> Product:
    profiles = tuple(
        Profile(
            name=spec["profiles"][kind["kind"]]["name"],
            enum=int(kind["enum"]),
            id=int(kind["id"]),
            memory_slices=int(kind["memorySlices"]),
            compute_slices=int(kind["computeSlices"]),
            max_count=int(kind["maxCount"]),
            memory_mib=int(spec["profiles"][kind["kind"]]["memoryMiB"]),
            placements=tuple(int(s) for s in kind["placements"]),
        )
        for kind in layout["profiles"]
    )
    return Product(
        name=name,
        nvml_names=tuple(spec["nvmlNames"]),
        pci_device_ids=tuple(int(i, 16) for i in spec["pciDeviceIds"]),
        memory_mib=int(spec["memoryMiB"]),
        memory_slices=int(layout["memorySlices"]),
        compute_slices=int(layout["computeSlices"]),
        profiles=profiles,
        placements_verified=bool(spec["placementsVerified"]),
        memory_verified=bool(spec["memoryVerified"]),
    )


@functools.cache
def default_catalog() -> Catalog:
    """The catalog shipped in the package (read once)."""
    return load_catalog(resources.files("sharing").joinpath("catalog.yaml").read_text("utf-8"))
