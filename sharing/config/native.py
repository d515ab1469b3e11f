"""The native config format (DESIGN.md "Config"): shape and types, into a draft for the meaning checks."""

from __future__ import annotations

from typing import Any

from sharing.config.check import DraftConfig, DraftRule
from sharing.config.document import describe
from sharing.config.mps import LIMIT_KEYS, read_limits
from sharing.config.problems import Report, item, key
from sharing.config.schema import boolean, choice, fields, integer, resource_name, string
from sharing.config.spec import MigMode, MigStrategy, Selector, Sharing

MAX_REPLICAS = 256
MAX_GPU_INDEX = 255
STRATEGIES = tuple(s.value for s in MigStrategy)
MIG_WORDS = ("disabled", "enabled", "unchanged", "dynamic")
RECLAIM_WORDS = ("never", "idle")


def read_native(report: Report, name: str, doc: dict[str, Any]) -> DraftConfig:
    """A native config document (a mapping) as a draft; shape and type problems go to `report`."""
    draft = DraftConfig(name)
    top = fields(report, "", doc, required=("version",), optional=("migStrategy", "sharing", "gpus")) or {}
    if "version" in top:
        choice(report, "version", top["version"], ("v1",))
    if "migStrategy" in top:
        strategy = choice(report, "migStrategy", top["migStrategy"], STRATEGIES)
        draft.strategy = MigStrategy(strategy) if strategy else draft.strategy
    if "sharing" in top:
        sharing = fields(
            report, "sharing", top["sharing"], optional=("renameByDefault", "failRequestsGreaterThanOne")
        )
        if sharing:
            draft.rename_by_default = bool(
                boolean(report, "sharing.renameByDefault", sharing.get("renameByDefault", False))
            )
            draft.fail_requests_greater_than_one = bool(
                boolean(
                    report,
                    "sharing.failRequestsGreaterThanOne",
                    sharing.get("failRequestsGreaterThanOne", False),
                )
            )
    gpus = top.get("gpus", [])
    if not isinstance(gpus, list):
        report.error("gpus", f"expected a list of rules, got {describe(gpus)}")
        return draft
    for i, value in enumerate(gpus):
        rule = read_rule(report, item("gpus", i), value)
        if rule is not None:
            draft.rules.append(rule)
    fail_set = isinstance(top.get("sharing"), dict) and "failRequestsGreaterThanOne" in top["sharing"]
    if not fail_set and any(r.sharing is Sharing.MPS for r in draft.rules):
        draft.fail_requests_greater_than_one = draft.fail_implied = True  # NVIDIA's MPS default
    return draft


def read_rule(report: Report, path: str, value: object) -> DraftRule | None:
    """One `gpus[]` entry."""
    rule = fields(
        report, path, value, required=("devices",),
        optional=("mig", "replicas", "rename", "mps", "reclaimForeign"),
    )  # fmt: skip
    if rule is None or "devices" not in rule:
        return None
    selector = read_devices(report, key(path, "devices"), rule["devices"])
    if selector is None:
        return None
    draft = DraftRule(
        path=path, devices_path=key(path, "devices"), selector=selector, mig_path=key(path, "mig")
    )
    if "mig" in rule:
        read_mig(report, draft, rule["mig"])
    if "replicas" in rule:
        read_replicas(report, draft, key(path, "replicas"), rule["replicas"])
    if "rename" in rule:
        read_rename(report, draft, key(path, "rename"), rule["rename"])
    if "mps" in rule:
        if "replicas" in rule:
            report.error(key(path, "replicas"), "a rule shares its GPUs one way: mps.replicas gives MPS "
                         "replicas, replicas time-sliced ones; keep one")  # fmt: skip
        read_mps(report, draft, key(path, "mps"), rule["mps"])
    if "reclaimForeign" in rule:
        read_reclaim(report, draft, key(path, "reclaimForeign"), rule["reclaimForeign"])
    return draft


def read_reclaim(report: Report, rule: DraftRule, path: str, value: object) -> None:
    """`reclaimForeign: idle | never` of a `mig: dynamic` rule: whether MIG instances the agent did not
    make are destroyed once idle and unclaimed (never, by default)."""
    word = choice(report, path, value, RECLAIM_WORDS)
    if word is not None and rule.mig is not MigMode.DYNAMIC:
        report.error(path, "reclaimForeign applies to the MIG instances of a mig: dynamic rule only; "
                     "remove it or set mig: dynamic")  # fmt: skip
    rule.reclaim_foreign = word == "idle"


def read_mps(report: Report, rule: DraftRule, path: str, value: object) -> None:
    """`{replicas: N, activeThreadPercentage: P, pinnedMemoryLimit: SIZE}`: each whole GPU shared by MPS."""
    found = fields(report, path, value, required=("replicas",), optional=LIMIT_KEYS)
    if found is None:
        return
    rule.sharing, rule.sharing_path = Sharing.MPS, path
    if "replicas" in found:
        replicas = integer(report, key(path, "replicas"), found["replicas"], low=2, high=MAX_REPLICAS)
        if replicas is not None:
            rule.replicas["gpu"] = (replicas, key(path, "replicas"))
    read_limits(report, rule, path, found)


def read_indices(report: Report, path: str, value: object) -> tuple[int, ...] | None:
    """A non-empty list of distinct GPU indices."""
    if not isinstance(value, list) or not value:
        report.error(path, f"expected a non-empty list of GPU indices, got {describe(value)}")
        return None
    indices: list[int] = []
    for i, entry in enumerate(value):
        add_gpu_index(report, item(path, i), entry, indices)
    return tuple(indices) if len(indices) == len(value) else None


def add_gpu_index(report: Report, path: str, entry: object, indices: list[int]) -> None:
    """Append a GPU index from a `devices` list, or report why it is not one (or listed twice)."""
    index = integer(report, path, entry, low=0, high=MAX_GPU_INDEX)
    if index is not None and index in indices:
        report.error(path, f"GPU {index} is listed twice")
    elif index is not None:
        indices.append(index)


def read_devices(report: Report, path: str, value: object) -> Selector | None:
    """`all`, a list of indices, or {product: NAME} (optionally with `indices`)."""
    if value == "all":
        return Selector(all=True)
    if isinstance(value, list):
        indices = read_indices(report, path, value)
        return None if indices is None else Selector(indices=indices)
    if isinstance(value, dict):
        found = fields(report, path, value, required=("product",), optional=("indices",))
        if found is None or "product" not in found:
            return None
        product = string(report, key(path, "product"), found["product"])
        indices = read_indices(report, key(path, "indices"), found["indices"]) if "indices" in found else ()
        if product is None or indices is None:
            return None
        return Selector(product=product.strip(), indices=indices)
    report.error(path, f"expected all, a list of GPU indices or {{product: NAME}}, got {describe(value)}")
    return None


def read_mig(report: Report, rule: DraftRule, value: object) -> None:
    """`{profile: count}`, `{}` or one of the words disabled, enabled, unchanged, dynamic."""
    path = rule.mig_path
    if isinstance(value, str) and value in MIG_WORDS:
        rule.mig = MigMode(value)
        return
    if not isinstance(value, dict):
        report.error(
            path, f"expected {{profile: count}} or one of {', '.join(MIG_WORDS)}, got {describe(value)}"
        )
        return
    for profile, count in value.items():
        if not isinstance(profile, str):
            report.error(path, f"MIG profile {describe(profile)} is not a string (e.g. 1g.5gb)")
            continue
        number = integer(report, key(path, profile), count, low=1)
        if number is not None:
            rule.instances[profile] = (number, key(path, profile))
    rule.mig = MigMode.ENABLED if value else MigMode.DISABLED


def read_replicas(report: Report, rule: DraftRule, path: str, value: object) -> None:
    """An int for every device of the rule, or {gpu|profile: int}."""
    if isinstance(value, dict):
        for kind, count in value.items():
            if not isinstance(kind, str):
                report.error(path, f"key {describe(kind)} is not a string; expected gpu or a MIG profile")
                continue
            number = integer(report, key(path, kind), count, low=1, high=MAX_REPLICAS)
            if number is not None:
                rule.replicas[kind] = (number, key(path, kind))
        return
    number = integer(report, path, value, low=1, high=MAX_REPLICAS)
    if number is not None:
        rule.replicas_default = number


def read_rename(report: Report, rule: DraftRule, path: str, value: object) -> None:
    """{resource: new resource name} for the time-sliced replicas of that resource."""
    if not isinstance(value, dict):
        report.error(path, f"expected {{resource: new name}}, got {describe(value)}")
        return
    for resource, new in value.items():
        if not isinstance(resource, str):
            report.error(path, f"key {describe(resource)} is not a string; expected a resource name")
            continue
        old = resource_name(report, key(path, resource), resource)
        renamed = resource_name(report, key(path, resource), new)
        if old is not None and renamed is not None:
            rule.rename[old] = (renamed, key(path, resource))
