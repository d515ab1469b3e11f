"""MIG: the hardware catalog, the exact placement planner, and the change one GPU needs (pure).

`catalog` (with `catalog.yaml`, package data) says what each product offers when the driver did not
say it; `plan` searches exact placements of MIG instances; `observed` reads an observed GPU against
the catalog; `change` turns a GPU and its target into hardware steps and checks the result;
`rightsize` finds the smallest profile that holds what a slice's pod used. Frozen values in, frozen
values out: no I/O, no clock, no logging.
"""

from sharing.mig.catalog import (
    MIB,
    NVIDIA_VENDOR,
    AnyProduct,
    Catalog,
    Engines,
    PlainProduct,
    Product,
    Profile,
    default_catalog,
    differences,
    parse_pci_id,
    product_key,
    profile_name,
    split_pci,
)
from sharing.mig.change import GpuChange, Outcome, Step, StepKind, Target, plan_change, verify
from sharing.mig.observed import catalog_name, device_profile, geometry
from sharing.mig.plan import Existing, Infeasible, Placement, Plan, plan_gpu
from sharing.mig.rightsize import HEADROOM, Basis, RightSize, right_size

__all__ = [
    "HEADROOM",
    "MIB",
    "NVIDIA_VENDOR",
    "AnyProduct",
    "Basis",
    "Catalog",
    "Engines",
    "Existing",
    "GpuChange",
    "Infeasible",
    "Outcome",
    "Placement",
    "PlainProduct",
    "Plan",
    "Product",
    "Profile",
    "RightSize",
    "Step",
    "StepKind",
    "Target",
    "catalog_name",
    "default_catalog",
    "device_profile",
    "differences",
    "geometry",
    "parse_pci_id",
    "plan_change",
    "plan_gpu",
    "product_key",
    "profile_name",
    "right_size",
    "split_pci",
    "verify",
]
