"""mig-parted files (`version: v1`, `mig-configs:`) as native drafts, one named config per entry.

Users of NVIDIA's mig-manager bring these, and they keep mig-parted's meaning: a `device-filter`
compares the exact PCI device+vendor id (and the subsystem id when given), never a whole product;
an entry that matches no GPU of the node is skipped; when several entries match a GPU, the last one
wins (mig-parted applies them in turn); `devices: all` with MIG on leaves GPUs without MIG alone.
Each `mig-configs` entry becomes a config of the same name with migStrategy mixed.
"""

from __future__ import annotations

import re
from typing import Any

from sharing.config.check import DraftConfig, DraftRule
from sharing.config.document import describe
from sharing.config.native import add_gpu_index
from sharing.config.problems import Report, item, key
from sharing.config.schema import boolean, choice, fields, integer
from sharing.config.spec import MigMode, MigStrategy, PciFilter, Selector
from sharing.mig import NVIDIA_VENDOR

_NUMBER = re.compile(r"^(0[xX][0-9a-fA-F]{1,8}|[0-9]{1,10})$")
_ATTR = r"(me|me\.all|gfx)"
PROFILE = re.compile(rf"^([1-9][0-9]*c\.)?[1-9][0-9]*g\.[0-9]+gb(\+{_ATTR}(,{_ATTR})*|-me)?$")
"""A mig-parted profile name: `[<C>c.]<G>g.<GB>gb`, optionally +me, +me.all, +gfx (comma-joined) or -me."""


def is_migparted(doc: dict[Any, Any]) -> bool:
    """True when a document is a mig-parted file."""
    return "mig-configs" in doc


def read_migparted(report: Report, doc: dict[str, Any]) -> list[tuple[DraftConfig, Report]]:
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
        draft = DraftConfig(name, strategy=MigStrategy.MIXED, migparted=True)
        if not isinstance(entries, list) or not entries:
            entry_report.error(path, f"expected a non-empty list of entries, got {describe(entries)}")
        else:
            for j, entry in enumerate(entries):
                draft.rules.extend(_entry(entry_report, item(path, j), entry))
        # The last matching entry wins in mig-parted; ours is first-match-wins: reverse.
        draft.rules.reverse()
        drafts.append((draft, entry_report))
    return drafts


def _entry(report: Report, path: str, value: object) -> list[DraftRule]:
    entry = fields(
        report, path, value, required=("devices", "mig-enabled"), optional=("mig-devices", "device-filter")
    )
    if entry is None or "devices" not in entry or "mig-enabled" not in entry:
        return []
    devices = entry["devices"]
    indices = () if devices == "all" else _indices(report, key(path, "devices"), devices)
    enabled = boolean(report, key(path, "mig-enabled"), entry["mig-enabled"])
    filters = (
        _filters(report, key(path, "device-filter"), entry["device-filter"])
        if "device-filter" in entry
        else ()
    )
    if indices is None or enabled is None or filters is None:
        return []
    mig_path = key(path, "mig-devices") if "mig-devices" in entry else key(path, "mig-enabled")
    instances: dict[str, tuple[int, str]] = {}
    if "mig-devices" in entry:
        instances = _mig_devices(report, key(path, "mig-devices"), entry["mig-devices"], enabled)
    elif enabled:
        report.error(
            key(path, "mig-devices"), "required key is missing (mig-enabled is true); use {} for no instances"
        )
    if devices != "all" and not indices:
        report.warn(key(path, "devices"), "an empty list selects no GPU: the entry does nothing")
        return []
    selector = Selector(pci=filters, indices=indices) if filters else (
        Selector(indices=indices) if indices else Selector(all=True)
    )  # fmt: skip
    rule = DraftRule(
        path=path,
        devices_path=path,
        selector=selector,
        mig=MigMode.ENABLED if enabled else MigMode.DISABLED,
        mig_path=mig_path,
        instances=instances,
        skip_without_mig=devices == "all",
    )
    return [rule]


def _indices(report: Report, path: str, value: object) -> tuple[int, ...] | None:
    """A list of GPU indices (an empty list is allowed, as in mig-parted)."""
    if not isinstance(value, list):
        report.error(path, f"expected all or a list of GPU indices, got {describe(value)}")
        return None
    indices: list[int] = []
    for i, entry in enumerate(value):
        add_gpu_index(report, item(path, i), entry, indices)
    return tuple(indices) if len(indices) == len(value) else None


def _mig_devices(report: Report, path: str, value: object, enabled: bool) -> dict[str, tuple[int, str]]:
    if not isinstance(value, dict):
        report.error(path, f"expected {{profile: count}}, got {describe(value)}")
        return {}
    instances: dict[str, tuple[int, str]] = {}
    for profile, count in value.items():
        if not isinstance(profile, str) or not PROFILE.match(profile):
            report.error(
                path,
                f"MIG profile {describe(profile)} is not of the form <G>g.<GB>gb (e.g. 1g.5gb, 1g.10gb+me, "
                "1g.24gb-me)",
            )
            continue
        number = integer(report, key(path, profile), count, low=0)
        if number:
            instances[profile] = (number, key(path, profile))
    if not enabled and instances:
        report.error(path, "mig-enabled is false, so there can be no MIG devices")
    if enabled and value and not instances and len(value) == len([c for c in value.values() if c == 0]):
        report.error(path, "every count is 0; use {} for MIG enabled with no instances")
    return instances


def _number(text: str) -> int | None:
    return int(text, 0) if _NUMBER.match(text) and int(text, 0) <= 0xFFFFFFFF else None


def _filters(report: Report, path: str, value: object) -> tuple[PciFilter, ...] | None:
    """The PCI ids of a device-filter (a string or a list of them; empty: no filter, as mig-parted)."""
    if value in ("", []):
        return ()
    given = [(path, value)] if isinstance(value, str) else (
        [(item(path, i), v) for i, v in enumerate(value)] if isinstance(value, list) else None
    )  # fmt: skip
    if given is None:
        report.error(path, f"expected a PCI id like 0x20B010DE or a list of them, got {describe(value)}")
        return None
    filters: list[PciFilter] = []
    ok = True
    for where, text in given:
        parts = text.split(":") if isinstance(text, str) else []
        numbers = [_number(p) for p in parts]
        device = numbers[0] if numbers else None
        if not 1 <= len(parts) <= 2 or device is None or None in numbers:
            report.error(
                where, f"expected a PCI id like 0x20B010DE (device, vendor[:subsystem]), got {describe(text)}"
            )
            ok = False
            continue
        subsystem = numbers[1] if len(numbers) == 2 else None
        if device & 0xFFFF != NVIDIA_VENDOR:
            report.warn(where, f"0x{device:08X} does not have NVIDIA's vendor id (10DE): it matches no GPU")
        if PciFilter(device, subsystem) not in filters:
            filters.append(PciFilter(device, subsystem))
    return tuple(filters) if ok else None
