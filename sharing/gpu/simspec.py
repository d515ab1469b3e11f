"""What a simulated GPU is: its identity and, for a MIG GPU, the profile table its "driver" reports.

The table is written into the state file when the GPUs are created, so every process that opens the
state (the agent, `sharing sim`, a test) sees the same hardware, and a simulated GPU can be a
product the shipped catalog does not contain (the NVML backend must then work from what the
simulated driver reports, as on a real GPU the catalog has not seen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sharing.errors import BackendError
from sharing.mig import NVIDIA_VENDOR, Catalog, Engines, Product, Profile

State = dict[str, Any]

COMPUTE_CLASS = 0x030200
"""PCI class of a 3D controller: what data-center GPUs report (GPU feature discovery: `compute`)."""


@dataclass(frozen=True, slots=True)
class SimGpuSpec:
    """What `init_state` creates for one simulated GPU."""

    product: str
    """Catalog name (or any name for a product of the caller's own)."""
    name: str
    """The NVML name."""
    memory_mib: int
    mig_capable: bool
    table: Product | None = None
    """The MIG profiles the simulated driver reports (None: no MIG)."""
    pci_device_id: int = 0
    """Packed device+vendor id (0x20B010DE); 0 when not known."""
    compute_capability: tuple[int, int] | None = None


def spec_of(product: Product) -> SimGpuSpec:
    """A simulated GPU that is this MIG product (any Product: the catalog's or the caller's)."""
    name = product.nvml_names[0] if product.nvml_names else f"NVIDIA {product.name}"
    device = product.pci_device_ids[0] << 16 | NVIDIA_VENDOR if product.pci_device_ids else 0
    return SimGpuSpec(
        product.name, name, product.memory_mib, True, product, device, product.compute_capability
    )


def resolve_product(catalog: Catalog, name: str) -> SimGpuSpec:
    """A product the simulator can play, by catalog name, NVML name or PCI id (`A100-SXM4-40GB`, `T4`)."""
    found = catalog.describe(name)
    if isinstance(found, Product):
        return spec_of(found)
    if found is not None:
        device = found.pci_device_ids[0] << 16 | NVIDIA_VENDOR if found.pci_device_ids else 0
        nvml_name = found.nvml_names[0] if found.nvml_names else found.name
        return SimGpuSpec(
            found.name, nvml_name, found.memory_mib, False, None, device, found.compute_capability
        )
    known = [p.name for p in catalog.products] + [p.name for p in catalog.plain]
    raise BackendError(f"the simulator cannot play GPU product {name!r} (known: {', '.join(known)})")


def gpu_state(index: int, uuid: str, spec: SimGpuSpec) -> State:
    """The state-file entry of one fresh GPU: no processes, MIG disabled, no instances."""
    return {
        "index": index,
        "uuid": uuid,
        "product": spec.product,
        "name": spec.name,
        "memoryMiB": spec.memory_mib,
        "migCapable": spec.mig_capable,
        "migCurrent": 0,
        "migPending": 0,
        "processes": [],
        "lost": False,
        "pciDeviceId": spec.pci_device_id,
        "pciSubsystemId": 0,
        "pciClass": COMPUTE_CLASS,
        "computeCapability": None if spec.compute_capability is None else list(spec.compute_capability),
        "mig": None if spec.table is None else table_state(spec.table),
        "gpuInstances": [],
    }


def table_state(table: Product) -> State:
    """A profile table as JSON-able state."""
    return {
        "slots": table.slots,
        "computeSlices": table.compute_slices,
        "profiles": [
            {
                "name": p.name,
                "enum": p.enum,
                "id": p.id,
                "slices": p.compute_slices,
                "size": p.size,
                "maxCount": p.max_count,
                "memoryMiB": p.memory_mib,
                "placements": list(p.placements),
                "sm": p.multiprocessors or 0,
                "engines": [0] * 5 if p.engines is None else
                [p.engines.copy, p.engines.decoder, p.engines.encoder, p.engines.jpeg, p.engines.ofa],
            }
            for p in table.profiles
        ],
    }  # fmt: skip


def table_of(gpu: State) -> Product | None:
    """The profile table a simulated GPU's driver reports (None: no MIG)."""
    mig = gpu.get("mig")
    if not gpu["migCapable"] or mig is None:
        return None
    profiles = tuple(
        Profile(
            name=p["name"],
            enum=p["enum"],
            id=p["id"],
            compute_slices=p["slices"],
            size=p["size"],
            max_count=p["maxCount"],
            memory_mib=p["memoryMiB"],
            placements=tuple(p["placements"]),
            multiprocessors=p["sm"],
            engines=Engines(*p["engines"]),
        )
        for p in mig["profiles"]
    )
    return Product(
        gpu["product"], (gpu["name"],), (), gpu["memoryMiB"], mig["slots"], mig["computeSlices"], profiles
    )
