"""What the catalog says of an observed GPU: its MIG geometry, its catalog name, and the profile each of
its MIG devices goes by (pure)."""

from __future__ import annotations

import re

from sharing.mig.catalog import Catalog, PlainProduct, Product
from sharing.model import ComputeInstance, Gpu, GpuInstance

_GPU_INSTANCE = re.compile(r"^(\d+)g\.")
"""`<G>g.`: the compute slices of a GPU-instance profile, as its name begins (`profile_name`)."""


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


def device_profile(gi: GpuInstance, ci: ComputeInstance) -> str:
    """The profile one MIG device goes by, as NVIDIA names it: its GPU instance's (`3g.20gb`) when the
    compute instance spans all of the GPU instance's compute slices, else `<C>c.` and the GPU
    instance's (`1c.3g.20gb`: a compute instance of one slice inside a 3g.20gb GPU instance).

    go-nvlib writes a MIG device's profile so (pkg/nvlib/device/mig_profile.go, `MigProfileInfo.String`:
    `%dg.%dgb%s` when C == G, else `%dc.%dg.%dgb%s`), and NVIDIA's device plugin and GFD name the
    resource and labels `mig-<that>` (internal/resource/nvml-mig-device.go `GetName`). A compute
    instance whose size was not read is taken to span its GPU instance."""
    whole = _GPU_INSTANCE.match(gi.profile)
    if ci.slices is None or whole is None or ci.slices >= int(whole.group(1)):
        return gi.profile
    return f"{ci.slices}c.{gi.profile}"
