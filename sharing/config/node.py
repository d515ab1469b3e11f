"""The GPUs a config is checked against: the node's (observed, or named by product) or the catalog's.

At run time the agent passes the observed GPUs, so layouts are checked on the profiles each GPU's
driver reports and mig-parted filters compare exact PCI ids. Offline (`sharing validate`) the GPUs
are named by catalog name, NVML name or PCI id, and the catalog supplies their profiles; with no GPU
named, a rule is checked on the catalog products it can match.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from sharing.config.spec import GpuIdentity, Selector, identity
from sharing.mig import (
    NVIDIA_VENDOR,
    Catalog,
    Infeasible,
    PlainProduct,
    Product,
    geometry,
    parse_pci_id,
    plan_gpu,
)
from sharing.model import Gpu


@dataclass(frozen=True, slots=True)
class NodeGpu:
    """One GPU of the node as the checks see it."""

    name: str
    """Catalog name when known, else the name given (messages)."""
    identity: GpuIdentity
    geometry: Product | None
    """Its MIG profiles (the driver's or the catalog's); None for a GPU without MIG or an unknown one."""
    known: bool = True
    """False for a GPU the catalog does not know and no driver described: its MIG is unknown."""
    compute_capability: tuple[int, int] | None = None
    """(major, minor) as NVML reports it or the catalog lists it; None when unknown (MPS client cap)."""
    memory_mib: int | None = None
    """Its memory (the MPS pinned-memory limit must fit); None when unknown."""
    mig_enabled: bool = False
    """MIG mode is on now (observed GPUs only): MPS cannot share it."""


def node_from_gpus(gpus: Sequence[Gpu], catalog: Catalog) -> tuple[NodeGpu, ...]:
    """The observed GPUs (the driver's profiles win over the catalog's)."""
    found = []
    for gpu in gpus:
        ident = identity(gpu, catalog)
        table = geometry(gpu, catalog)
        known = table is not None or not gpu.mig_capable
        found.append(
            NodeGpu(ident.product or gpu.product, ident, table, known, gpu.compute_capability,
                    gpu.memory_mib or None, gpu.mig_enabled)
        )  # fmt: skip
    return tuple(found)


def node_from_names(names: Sequence[str], catalog: Catalog) -> tuple[NodeGpu, ...]:
    """GPUs named by catalog name, NVML name or PCI id, the n-th name being GPU n (so index rules
    match as on a node): one entry per PCI id the product may have."""
    found: list[NodeGpu] = []
    for index, name in enumerate(names):
        product = catalog.describe(name)
        if product is None:
            found.append(
                NodeGpu(name.strip(), GpuIdentity(index=index, product=name.strip()), None, known=False)
            )
            continue
        mig = product if isinstance(product, Product) else None
        given = parse_pci_id(name)
        ids = (given,) if given is not None else product.pci_device_ids or (None,)
        for device in ids:
            packed = None if device is None else device << 16 | NVIDIA_VENDOR
            nvml = next(iter(product.nvml_names), None)
            ident = GpuIdentity(index=index, product=product.name, nvml_name=nvml, pci_device_id=packed)
            found.append(
                NodeGpu(product.name, ident, mig, True, product.compute_capability, product.memory_mib)
            )
    return tuple(found)


def catalog_targets(selector: Selector, catalog: Catalog) -> list[NodeGpu] | None:
    """Offline, no GPUs named: the catalog products a product or PCI selector names (None: any)."""
    if selector.pci:
        products: list[Product | PlainProduct] = []
        for f in selector.pci:
            device, vendor = f.device >> 16, f.device & 0xFFFF
            product = catalog.describe(f"0x{device:04X}") if vendor == NVIDIA_VENDOR else None
            if product is not None and product not in products:
                products.append(product)
        return [_catalog_gpu(p) for p in products]
    if selector.product is not None:
        product = catalog.describe(selector.product)
        if product is None:
            return [NodeGpu(selector.product, GpuIdentity(product=selector.product), None, known=False)]
        return [_catalog_gpu(product)]
    return None


def _catalog_gpu(product: Product | PlainProduct) -> NodeGpu:
    mig = product if isinstance(product, Product) else None
    return NodeGpu(product.name, GpuIdentity(product=product.name), mig, True, product.compute_capability,
                   product.memory_mib)  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _plan(product: Product, want: tuple[tuple[str, int], ...]) -> str | None:
    result = plan_gpu(product, (), dict(want))
    return result.reason if isinstance(result, Infeasible) else None


def layout_problems(
    product: Product, instances: dict[str, tuple[int, str]]
) -> tuple[list[tuple[str, str]], str | None]:
    """(per-profile (path, message) problems, whole-layout problem) of wanted instances on a product."""
    per_profile = []
    for profile, (count, path) in instances.items():
        found = product.profile(profile)
        if found is None:
            valid = ", ".join(p.name for p in product.profiles) or "none known to the catalog"
            per_profile.append((path, f"unknown MIG profile {profile!r} on {product.name} (valid: {valid})"))
        elif count > found.max_count:
            per_profile.append(
                (path, f"{count} instances exceed the maximum of {found.max_count} on {product.name}")
            )
    if per_profile:
        return per_profile, None
    return [], _plan(product, tuple(sorted((p, c) for p, (c, _) in instances.items())))
