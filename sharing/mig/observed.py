"""What the catalog says of an observed GPU: its MIG geometry and its catalog name (pure)."""

from __future__ import annotations

from sharing.mig.catalog import Catalog, PlainProduct, Product
from sharing.model import Gpu


def geometry(gpu: Gpu, catalog: Catalog) -> Product | None:
    """The MIG profiles of a GPU: what its driver reported, else the catalog's (offline, old data)."""
    if gpu.profiles is not None:
        return gpu.profiles
    if not gpu.mig_capable:
        return None
    found = catalog.for_gpu(gpu.product, gpu.pci_device_id)
    return found if isinstance(found, Product) else None


def catalog_name(gpu: Gpu, catalog: Catalog) -> str | None:
    """The catalog's name for this GPU (by PCI id, then NVML name), or None when it is not known."""
    found = catalog.for_gpu(gpu.product, gpu.pci_device_id)
    return found.name if isinstance(found, Product | PlainProduct) else None
