"""The hardware catalog: GPUs the agent knows offline, their MIG profiles and where each fact comes from.

The driver is the authority at run time (the NVML backend reads every GPU's profiles into the same
`Product` shape). This catalog, shipped inside the package as `catalog.yaml`, serves the offline
tools, the simulated GPUs and a check that says where a driver disagrees with it. Products are found
by PCI device id first (exact, as mig-parted matches them), then by NVML or catalog name. Pure.
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
NVIDIA_VENDOR = 0x10DE
INFERRED = "inferred"
"""Sources that start with this word were not seen in a published output."""


@dataclass(frozen=True, slots=True)
class Engines:
    """Engines of a GPU instance, as NVML's profile info counts them."""

    copy: int = 0
    decoder: int = 0
    encoder: int = 0
    jpeg: int = 0
    ofa: int = 0


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU-instance profile of one product (`3g.20gb` on an A100-SXM4-40GB)."""

    name: str
    enum: int
    id: int
    compute_slices: int
    """The <G> of `<G>g.<GB>gb`: compute slices (NVML's sliceCount)."""
    size: int
    """Placement size: the slots of the product's grid an instance occupies."""
    max_count: int
    memory_mib: int
    placements: tuple[int, ...]
    multiprocessors: int | None = None
    engines: Engines | None = None
    source: str = ""

    @property
    def memory_slices(self) -> int:
        """The placement size (kept for older callers; equals memory slices on 8-slot GPUs)."""
        return self.size

    @property
    def memory_verified(self) -> bool:
        """True when the memory size was seen in a published nvidia-smi output."""
        return not self.source.startswith(INFERRED)


@dataclass(frozen=True, slots=True)
class Product:
    """The MIG geometry of a GPU: from the catalog, or read from a GPU's driver (`origin`)."""

    name: str
    nvml_names: tuple[str, ...]
    pci_device_ids: tuple[int, ...]
    """16-bit PCI device ids (vendor NVIDIA)."""
    memory_mib: int
    slots: int
    """Width of the placement grid: 8 on A100/H100, 4 on A30, 12 on RTX PRO 6000."""
    compute_slices: int
    profiles: tuple[Profile, ...]
    compute_capability: tuple[int, int] | None = None
    origin: str = "catalog"
    """`catalog`, or `driver` for a table read from NVML."""
    source: str = ""
    placements_source: str = ""

    @property
    def memory_slices(self) -> int:
        """The grid width (kept for older callers)."""
        return self.slots

    @property
    def placements_verified(self) -> bool:
        """True when the placements were seen (a driver's always are)."""
        return not self.placements_source.startswith(INFERRED)

    @property
    def memory_verified(self) -> bool:
        """True when every profile's memory size was seen in a published output."""
        return all(p.memory_verified for p in self.profiles)

    def profile(self, name: str) -> Profile | None:
        """The profile called `name` on this product, or None."""
        return next((p for p in self.profiles if p.name == name), None)

    def require_profile(self, name: str) -> Profile:
        """The profile called `name`, or a CatalogError listing the valid names."""
        profile = self.profile(name)
        if profile is None:
            known = ", ".join(p.name for p in self.profiles) or "none known"
            raise CatalogError(f"unknown MIG profile {name!r} on {self.name} (valid: {known})")
        return profile


@dataclass(frozen=True, slots=True)
class PlainProduct:
    """A GPU without MIG (time-slicing only)."""

    name: str
    nvml_names: tuple[str, ...]
    pci_device_ids: tuple[int, ...]
    memory_mib: int
    compute_capability: tuple[int, int] | None = None
    source: str = ""


AnyProduct = Product | PlainProduct


@dataclass(frozen=True, slots=True)
class Catalog:
    """All known products: MIG ones (`products`) and GPUs without MIG (`plain`)."""

    products: tuple[Product, ...]
    plain: tuple[PlainProduct, ...] = ()
    _by_key: dict[str, AnyProduct] = field(default_factory=dict, init=False, repr=False, compare=False)
    _by_pci: dict[int, AnyProduct] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        everything: tuple[AnyProduct, ...] = (*self.products, *self.plain)
        for product in everything:
            for name in (product.name, *product.nvml_names):
                self._by_key.setdefault(product_key(name), product)
            for device_id in product.pci_device_ids:
                self._by_pci.setdefault(device_id, product)

    def describe(self, text: str) -> AnyProduct | None:
        """A product by catalog name, NVML name (`NVIDIA ` optional) or PCI id (`0x2335`, `0x233510DE`)."""
        device = parse_pci_id(text)
        if device is not None:
            return self._by_pci.get(device)
        return self._by_key.get(product_key(text))

    def find(self, name: str) -> Product | None:
        """The MIG product with this catalog name, NVML name or PCI id, or None."""
        found = self.describe(name)
        return found if isinstance(found, Product) else None

    def product(self, name: str) -> Product:
        """Like find(), but an unknown name is a CatalogError listing the known ones."""
        product = self.find(name)
        if product is None:
            known = ", ".join(p.name for p in self.products)
            raise CatalogError(f"unknown GPU product {name!r} (known: {known})")
        return product

    def by_pci_device_id(self, device_id: int) -> Product | None:
        """The MIG product with this 16-bit PCI device id (e.g. 0x20B0)."""
        found = self._by_pci.get(device_id)
        return found if isinstance(found, Product) else None

    def for_gpu(self, name: str, pci_device_id: int | None = None) -> AnyProduct | None:
        """What an observed GPU is: by its packed PCI id (`0x20B010DE`) first, then by NVML name."""
        if pci_device_id is not None:
            device, vendor = split_pci(pci_device_id)
            found = self._by_pci.get(device) if vendor == NVIDIA_VENDOR else None
            if found is not None:
                return found
        return self._by_key.get(product_key(name))


def product_key(name: str) -> str:
    """Normalise a product name: case-insensitive, `NVIDIA ` optional, spaces/dashes/underscores alike."""
    key = re.sub(r"[\s_-]+", "-", name.strip().lower())
    return key.removeprefix("nvidia-")


_PCI = re.compile(r"^0x(?P<device>[0-9a-fA-F]{4})(?P<vendor>[0-9a-fA-F]{4})?$")


def parse_pci_id(text: str) -> int | None:
    """The 16-bit device id of `0x2335` or `0x233510DE` (NVIDIA vendor only), else None."""
    match = _PCI.match(text.strip())
    if match is None or (match["vendor"] and int(match["vendor"], 16) != NVIDIA_VENDOR):
        return None
    return int(match["device"], 16)


def split_pci(packed: int) -> tuple[int, int]:
    """(device, vendor) of NVML's 32-bit pciDeviceId (device in the high half)."""
    return packed >> 16, packed & 0xFFFF


def mig_memory_gb(memory_mib: int, total_memory_mib: int) -> int:
    """The `<GB>` of a profile name, derived as go-nvlib does (round half away from zero)."""
    fraction = math.ceil(memory_mib * MIB / (total_memory_mib * MIB) * 8) / 8
    total_gb = math.ceil(total_memory_mib * MIB / GIB)
    return math.floor(fraction * total_gb + 0.5)


# GPU-instance profile enum (nvml.h) -> name suffix (go-nvlib); enums not listed have none.
_SUFFIX = {0x7: "+me", 0x8: "+me", 0xA: "+gfx", 0xB: "+gfx", 0xC: "+gfx", 0x11: "+gfx",
           0xD: "-me", 0xE: "-me", 0xF: "+me.all", 0x10: "+me.all"}  # fmt: skip


def profile_name(enum: int, compute_slices: int, memory_mib: int, total_memory_mib: int) -> str:
    """`<G>g.<GB>gb[suffix]` for a GPU-instance profile as NVML describes it (go-nvlib's rule)."""
    gb = mig_memory_gb(memory_mib, total_memory_mib)
    return f"{compute_slices}g.{gb}gb{_SUFFIX.get(enum, '')}"


def differences(driver: Product, catalog: Product) -> tuple[str, ...]:
    """Where a GPU's driver and the catalog disagree, one sentence each (empty when they agree)."""
    found: list[str] = []
    known = {p.id: p for p in catalog.profiles}
    for profile in driver.profiles:
        ours = known.pop(profile.id, None)
        if ours is None:
            found.append(f"the driver has {profile.name} (id {profile.id}), the catalog does not")
            continue
        for what, theirs, mine in (
            ("name", profile.name, ours.name),
            ("memory MiB", profile.memory_mib, ours.memory_mib),
            ("max count", profile.max_count, ours.max_count),
            ("placements", profile.placements, ours.placements),
            ("placement size", profile.size, ours.size),
        ):
            if theirs != mine:
                found.append(
                    f"{profile.name} (id {profile.id}): {what} is {theirs} on the driver, {mine} here"
                )
    found += [f"the catalog has {p.name} (id {p.id}), the driver does not" for p in known.values()]
    return tuple(found)


# libyaml's loader when PyYAML was built with it: the catalog loads in ~10 ms instead of ~100 ms
# at every start of the agent and the CLI.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_catalog(text: str) -> Catalog:
    """Parse catalog YAML text into a Catalog (pure; raises CatalogError on a broken file)."""
    try:
        data = yaml.load(text, Loader=_SAFE_LOADER)
        sources: Mapping[str, str] = data.get("sources") or {}
        layouts: Mapping[str, Any] = data["layouts"]
        products = tuple(
            _product(name, spec, layouts[spec["layout"]], sources) for name, spec in data["products"].items()
        )
        plain = tuple(_plain(name, spec, sources) for name, spec in (data.get("withoutMig") or {}).items())
    except (yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise CatalogError(f"the hardware catalog is broken: {err!r}") from err
    return Catalog(products, plain)


def _source(text: object, sources: Mapping[str, str]) -> str:
    """Expand `@name` references to the URLs of the `sources` list."""
    return re.sub(r"@([a-z0-9-]+)", lambda m: sources.get(m[1], m[0]), str(text or ""))


def _capability(value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    major, _, minor = str(value).partition(".")
    return int(major), int(minor or 0)


def _product(
    name: str, spec: Mapping[str, Any], layout: Mapping[str, Any], sources: Mapping[str, str]
) -> Product:
    named = spec.get("profiles") or {}
    profiles = []
    for kind in layout["profiles"]:
        entry = named.get(kind["kind"])
        if entry is None:
            continue
        engines = entry.get("engines")
        profiles.append(
            Profile(
                name=entry["name"],
                enum=int(kind["enum"]),
                id=int(kind["id"]),
                compute_slices=int(kind["slices"]),
                size=int(kind["size"]),
                max_count=int(kind["maxCount"]),
                memory_mib=int(entry["memoryMiB"]),
                placements=tuple(int(s) for s in kind["placements"]),
                multiprocessors=None if entry.get("sm") is None else int(entry["sm"]),
                engines=None if engines is None else Engines(*(int(e) for e in engines)),
                source=_source(entry["source"], sources),
            )
        )
    if set(named) - {k["kind"] for k in layout["profiles"]}:
        raise ValueError(f"{name}: profile kinds not in its layout: {sorted(set(named))}")
    return Product(
        name=name,
        nvml_names=tuple(spec["nvmlNames"]),
        pci_device_ids=tuple(int(i, 16) for i in spec["pciDeviceIds"]),
        memory_mib=int(spec["memoryMiB"]),
        slots=int(layout["slots"]),
        compute_slices=int(layout["computeSlices"]),
        profiles=tuple(profiles),
        compute_capability=_capability(spec.get("computeCapability")),
        source=_source(spec["idsSource"], sources),
        placements_source=_source(spec.get("placementsSource", layout["placementsSource"]), sources),
    )


def _plain(name: str, spec: Mapping[str, Any], sources: Mapping[str, str]) -> PlainProduct:
    return PlainProduct(
        name=name,
        nvml_names=tuple(spec["nvmlNames"]),
        pci_device_ids=tuple(int(i, 16) for i in spec["pciDeviceIds"]),
        memory_mib=int(spec["memoryMiB"]),
        compute_capability=_capability(spec.get("computeCapability")),
        source=_source(spec["idsSource"], sources),
    )


@functools.cache
def default_catalog() -> Catalog:
    """The catalog shipped in the package (read once)."""
    return load_catalog(resources.files("sharing.mig").joinpath("catalog.yaml").read_text("utf-8"))
