"""mig-parted files (`version: v1`, `mig-configs:`) as native drafts, one named config per entry.

Users of NVIDIA's mig-manager bring these. Each `mig-configs` entry becomes a config of the same
name with migStrategy mixed. PCI `device-filter` ids map to catalog products (the `:subsystem`
suffix is accepted and ignored, with a warning); an unknown id is an error that names it.
"""

from __future__ import annotations

import re
from typing import Any

from sharing.catalog import Catalog
from sharing.config.check import DraftConfig, DraftRule
from sharing.config.document import describe
from sharing.config.native import read_indices
from sharing.config.problems import Report, item, key
from sharing.config.schema import boolean, choice, fields, integer
from sharing.spec import MigMode, MigStrategy, Selector

_PCI = re.compile(
    r"^0x(?P<device>[0-9a-fA-F]{4})(?P<vendor>[0-9a-fA-F]{4})(?::0x(?P<subsystem>[0-9a-fA-F]{8}))?$"
)
NVIDIA_VENDOR = 0x10DE
ORDER_HINT = (
    " (mig-parted applies every matching entry in turn, so there the last one wins; here the first "
    "matching entry wins: put the more specific entries first)"
)


def is_migparted(doc: dict[Any, Any]) -> bool:
    """True when a document is a mig-parted file."""
    return "mig-configs" in doc


def read_migparted(report: Report, doc: dict[str, Any], catalog: Catalog) -> list[tuple[DraftConfig, Report]]:
    """One (draft, its own report) per `mig-configs` entry; file-level problems go to `report`."""
    top = fields(report, "", doc, required=("version", "mig-configs")) or {}
    if "version" in top:
        choice(report, "version", top["version"], ("v1",))
    configs = top.get("mig-configs")
    if "mig-configs" in top and (not isinstance(configs, dict) or not configs):
        report.error("mig-configs", f"expected a non-empty mapping of config names, got {describe(configs)}")
        return []
    if not isinstance(configs, dict):
        return []
    drafts = []
    for name, entries in configs.items():
        if not isinstance(name, str):
            report.error("mig-configs", f"config name {describe(name)} is not a string")
            continue
        entry_report = Report(name)
        path = key("mig-configs", name)
        draft = DraftConfig(name, strategy=MigStrategy.MIXED, order_hint=ORDER_HINT)
        if not isinstance(entries, list) or not entries:
            entry_report.error(path, f"expected a non-empty list of entries, got {describe(entries)}")
        else:
            for j, entry in enumerate(entries):
                draft.rules.extend(_entry(entry_report, item(path, j), entry, catalog))
        drafts.append((draft, entry_report))
    return drafts


def _entry(report: Report, path: str, value: object, catalog: Catalog) -> list[DraftRule]:
    entry = fields(
        report, path, value, required=("devices", "mig-enabled"), optional=("mig-devices", "device-filter")
    )
    if entry is None or "devices" not in entry or "mig-enabled" not in entry:
        return []
    devices = entry["devices"]
    indices = () if devices == "all" else read_indices(report, key(path, "devices"), devices)
    enabled = boolean(report, key(path, "mig-enabled"), entry["mig-enabled"])
    products = (
        _filters(report, key(path, "device-filter"), entry["device-filter"], catalog)
        if "device-filter" in entry
        else []
    )
    if indices is None or enabled is None or products is None:
        return []
    mig_path = key(path, "mig-devices") if "mig-devices" in entry else key(path, "mig-enabled")
    instances: dict[str, tuple[int, str]] = {}
    if "mig-devices" in entry:
        instances = _mig_devices(report, key(path, "mig-devices"), entry["mig-devices"], enabled)
    elif enabled:
        report.error(
            key(path, "mig-devices"), "required key is missing (mig-enabled is true); use {} for no instances"
        )
    selectors = [Selector(product=p, indices=indices) for p in products] or [
        Selector(indices=indices) if indices else Selector(all=True)
    ]
    return [
        DraftRule(
            path=path,
            devices_path=path,
            selector=selector,
            mig=MigMode.ENABLED if enabled else MigMode.DISABLED,
            mig_path=mig_path,
            instances=dict(instances),
        )
        for selector in selectors
    ]


def _mig_devices(report: Report, path: str, value: object, enabled: bool) -> dict[str, tuple[int, str]]:
    if not isinstance(value, dict):
        report.error(path, f"expected {{profile: count}}, got {describe(value)}")
        return {}
    instances: dict[str, tuple[int, str]] = {}
    for profile, count in value.items():
        if not isinstance(profile, str):
            report.error(path, f"MIG profile {describe(profile)} is not a string (e.g. 1g.5gb)")
            continue
        number = integer(report, key(path, profile), count, low=0)
        if number:
            instances[profile] = (number, key(path, profile))
    if not enabled and instances:
        report.error(path, "mig-enabled is false, so there can be no MIG devices")
    if enabled and value and not instances and len(value) == len([c for c in value.values() if c == 0]):
        report.error(path, "every count is 0; use {} for MIG enabled with no instances")
    return instances


def _filters(report: Report, path: str, value: object, catalog: Catalog) -> list[str] | None:
    """Catalog product names for a device-filter (a PCI id or a list of them), in order, without repeats."""
    ids = (
        [(path, value)]
        if isinstance(value, str)
        else [(item(path, i), v) for i, v in enumerate(value)]
        if (isinstance(value, list) and value)
        else None
    )
    if ids is None:
        report.error(path, f"expected a PCI id like 0x20B010DE or a list of them, got {describe(value)}")
        return None
    products: list[str] = []
    ok = True
    for where, text in ids:
        match = _PCI.match(text) if isinstance(text, str) else None
        if match is None:
            report.error(
                where, f"expected a PCI id like 0x20B010DE (device, vendor[:subsystem]), got {describe(text)}"
            )
            ok = False
            continue
        device, vendor = int(match["device"], 16), int(match["vendor"], 16)
        product = catalog.by_pci_device_id(device) if vendor == NVIDIA_VENDOR else None
        if product is None:
            why = (
                "not an NVIDIA vendor id"
                if vendor != NVIDIA_VENDOR
                else "no product in the hardware catalog has it"
            )
            report.error(where, f"unknown PCI device id 0x{device:04X} in {text}: {why}")
            ok = False
            continue
        if match["subsystem"]:
            report.warn(
                where,
                f"subsystem id 0x{match['subsystem']} is ignored: the entry applies to every {product.name}",
            )
        if product.name not in products:
            products.append(product.name)
    return products if ok else None
