"""NVIDIA k8s-device-plugin configs (`sharing.timeSlicing.resources`) as native drafts.

Users bring the ConfigMaps they already have. Those configs never partition, so every converted rule
says `mig: unchanged`. Unlike NVIDIA's plugin, which parses `rename` and `devices` and then ignores
them, both are honoured: `devices` becomes per-GPU rules and `rename` a per-rule rename. Unknown keys
are errors here (NVIDIA drops them silently); NVIDIA's own flags that the agent takes from its
settings instead are warned about and ignored.
"""

from __future__ import annotations

import re
from typing import Any

from sharing.config.check import GPU, DraftConfig, DraftRule
from sharing.config.document import describe
from sharing.config.native import MAX_GPU_INDEX, MAX_REPLICAS, STRATEGIES, add_gpu_index
from sharing.config.problems import Report, item, key
from sharing.config.schema import boolean, choice, fields, integer, resource_name
from sharing.spec import MigMode, MigStrategy, Selector

DEFAULT = "*"
"""Contribution key of `nvidia.com/gpu` under none/single: every device the rule produces."""
PLUGIN_FLAGS = (
    "failOnInitError", "mpsRoot", "nvidiaDriverRoot", "nvidiaDevRoot", "gdrcopyEnabled", "gdsEnabled",
    "mofedEnabled", "useNodeFeatureAPI", "deviceDiscoveryStrategy", "plugin", "gfd",
)  # fmt: skip
_MIG_RESOURCE = re.compile(r"^nvidia\.com/mig-(?P<profile>\d+g\.\d+gb)(?:\.(?P<attrs>[a-z.]+))?$")
TS = "sharing.timeSlicing"


def is_nvidia(doc: dict[Any, Any]) -> bool:
    """True when a document looks like a device-plugin config rather than a native one."""
    if "gpus" in doc or "migStrategy" in doc:
        return False
    sharing = doc.get("sharing")
    return "flags" in doc or (isinstance(sharing, dict) and ("timeSlicing" in sharing or "mps" in sharing))


def read_nvidia(report: Report, name: str, doc: dict[str, Any]) -> DraftConfig:
    """A device-plugin config as a draft (`mig: unchanged` rules)."""
    draft = DraftConfig(
        name,
        strategy_path="flags.migStrategy",
        rename_path=f"{TS}.renameByDefault",
        fail_path=f"{TS}.failRequestsGreaterThanOne",
    )
    top = fields(report, "", doc, optional=("version", "flags", "sharing", "resources", "imex")) or {}
    if "version" in top and top["version"] != "":
        choice(report, "version", top["version"], ("v1",))
    for ignored in ("resources", "imex"):
        if ignored in top:
            report.warn(ignored, "ignored: the agent names resources itself")
    flags = fields(report, "flags", top.get("flags", {}), optional=("migStrategy", *PLUGIN_FLAGS)) or {}
    for flag in PLUGIN_FLAGS:
        if flag in flags:
            report.warn(key("flags", flag), "ignored: the agent's own settings cover it")
    if "migStrategy" in flags:
        strategy = choice(report, "flags.migStrategy", flags["migStrategy"], STRATEGIES)
        draft.strategy = MigStrategy(strategy) if strategy else draft.strategy
    sharing = fields(report, "sharing", top.get("sharing", {}), optional=("timeSlicing", "mps")) or {}
    if "mps" in sharing:
        report.error("sharing.mps", "MPS is not supported; use timeSlicing")
    if "timeSlicing" not in sharing:
        return draft
    ts = (
        fields(
            report,
            TS,
            sharing["timeSlicing"],
            required=("resources",),
            optional=("renameByDefault", "failRequestsGreaterThanOne"),
        )
        or {}
    )
    if "renameByDefault" in ts:
        draft.rename_by_default = bool(boolean(report, f"{TS}.renameByDefault", ts["renameByDefault"]))
    if "failRequestsGreaterThanOne" in ts:
        value = boolean(report, f"{TS}.failRequestsGreaterThanOne", ts["failRequestsGreaterThanOne"])
        draft.fail_requests_greater_than_one = bool(value)
    resources = ts.get("resources")
    if "resources" in ts and (not isinstance(resources, list) or not resources):
        report.error(f"{TS}.resources", f"expected a non-empty list of resources, got {describe(resources)}")
    elif isinstance(resources, list):
        draft.rules = _rules(report, draft.strategy, resources)
    return draft


class _Contribution:
    """What one resource entry asks of the GPUs it selects."""

    def __init__(self, path: str, kind: str, replicas: int, resource: str, rename: str | None) -> None:
        self.path, self.kind, self.replicas, self.resource, self.rename = (
            path,
            kind,
            replicas,
            resource,
            rename,
        )


def _rules(report: Report, strategy: MigStrategy, resources: list[Any]) -> list[DraftRule]:
    everywhere: list[_Contribution] = []
    per_index: dict[int, list[_Contribution]] = {}
    for i, value in enumerate(resources):
        path = item(f"{TS}.resources", i)
        entry = fields(report, path, value, required=("name", "replicas"), optional=("rename", "devices"))
        if entry is None or "name" not in entry or "replicas" not in entry:
            continue
        resource = resource_name(report, key(path, "name"), entry["name"])
        kind = None if resource is None else _kind(report, key(path, "name"), strategy, resource)
        replicas = integer(report, key(path, "replicas"), entry["replicas"], low=1, high=MAX_REPLICAS)
        rename = resource_name(report, key(path, "rename"), entry["rename"]) if "rename" in entry else None
        devices = _devices(report, key(path, "devices"), entry.get("devices", "all"))
        if (
            resource is None
            or kind is None
            or replicas is None
            or devices is None
            or ("rename" in entry and not rename)
        ):
            continue
        contribution = _Contribution(path, kind, replicas, resource, rename)
        for bucket in [everywhere] if not devices else [per_index.setdefault(n, []) for n in devices]:
            clash = next((c for c in bucket if c.kind == contribution.kind), None)
            if clash is not None:
                report.error(
                    key(path, "name"), f"{resource} is already time-sliced on these GPUs by {clash.path}"
                )
                break
            bucket.append(contribution)
    # GPUs asked for by the same resources form one rule; a resource naming a GPU overrides an
    # `all` resource of the same kind on it.
    groups: dict[tuple[str, ...], tuple[list[int], list[_Contribution]]] = {}
    for index in sorted(per_index):
        own = per_index[index]
        merged = own + [c for c in everywhere if c.kind not in {x.kind for x in own}]
        groups.setdefault(tuple(sorted(c.path for c in merged)), ([], merged))[0].append(index)
    rules = [_rule(Selector(indices=tuple(indices)), merged) for indices, merged in groups.values()]
    if everywhere:
        rules.append(_rule(Selector(all=True), everywhere))
    return rules


def _rule(selector: Selector, contributions: list[_Contribution]) -> DraftRule:
    first = contributions[0].path
    rule = DraftRule(
        path=first,
        devices_path=key(first, "devices"),
        selector=selector,
        mig=MigMode.UNCHANGED,
        mig_path=first,
    )
    for c in contributions:
        if c.kind == DEFAULT:
            rule.replicas_default = c.replicas
        else:
            rule.replicas[c.kind] = (c.replicas, key(c.path, "replicas"))
        if c.rename is not None:
            rule.rename[c.resource] = (c.rename, key(c.path, "rename"))
    return rule


def _kind(report: Report, path: str, strategy: MigStrategy, resource: str) -> str | None:
    """`gpu`, a MIG profile, or DEFAULT (every device of the rule) for the resource under the strategy."""
    if resource == "nvidia.com/gpu":
        return GPU if strategy is MigStrategy.MIXED else DEFAULT
    match = _MIG_RESOURCE.match(resource)
    if match is None:
        report.error(
            path,
            f"the agent advertises no resource {resource} (expected nvidia.com/gpu or "
            "nvidia.com/mig-<profile>)",
        )
        return None
    if strategy is not MigStrategy.MIXED:
        report.error(path, f"{resource} is only advertised with migStrategy mixed (flags.migStrategy)")
        return None
    attrs = match["attrs"]
    return match["profile"] + (f"+{attrs}" if attrs else "")


def _devices(report: Report, path: str, value: object) -> tuple[int, ...] | None:
    """() for `all`, a count N (the first N GPUs) or GPU indices; UUIDs and MIG indices are refused."""
    if value == "all":
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        count = integer(report, path, value, low=1, high=MAX_GPU_INDEX + 1)
        return None if count is None else tuple(range(count))
    if not isinstance(value, list) or not value:
        report.error(path, f"expected all, a count or a list of GPU indices, got {describe(value)}")
        return None
    indices: list[int] = []
    for i, given in enumerate(value):
        digits = isinstance(given, str) and given.isascii() and given.isdigit() and len(given) <= 6
        entry = int(given) if digits else given
        if isinstance(entry, str) and (entry.startswith(("GPU-", "MIG-")) or ":" in entry):
            report.error(
                item(path, i),
                f"{entry!r}: selecting devices by UUID or MIG index is not supported; "
                "use GPU indices (or a native config with {product: NAME})",
            )
            continue
        add_gpu_index(report, item(path, i), entry, indices)
    return tuple(indices) if len(indices) == len(value) else None
