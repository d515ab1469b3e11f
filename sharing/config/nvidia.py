"""NVIDIA k8s-device-plugin configs (`sharing.timeSlicing` or `sharing.mps`) as native drafts.

Users bring the ConfigMaps they already have, so a file is accepted and refused where NVIDIA's
parser (api/config/v1) accepts and refuses it: `replicas` must be at least 2, `devices` may be
`all`, a count, or a list of GPU indices, MIG indices (`0:1`), GPU UUIDs, MIG UUIDs or
`MIG-GPU-<uuid>/<gi>/<ci>`, resource names get `nvidia.com/` when they have no prefix. Those configs
never partition, so every converted rule says `mig: unchanged`. NVIDIA's plugin parses `devices`
and `rename` and then throws them away (every device behind a name gets the same replicas; the
name follows `renameByDefault`); the agent honours them: `rename` as written, `devices` per GPU for
GPU indices, counts and GPU UUIDs. A list naming MIG devices applies to every device, as NVIDIA's
plugin does with any list, with a warning. `sharing.mps` shares each selected whole GPU with MPS
(`failRequestsGreaterThanOne` true unless set, `migStrategy: mixed` refused, as NVIDIA's config.go
and main.go `validateFlags` do); its resources may also set the per-replica limits
`activeThreadPercentage` and `pinnedMemoryLimit` (an extension: NVIDIA's parser would drop them).
Deliberate differences: unknown keys are errors (NVIDIA drops them silently), and `timeSlicing`
next to `mps` is an error (NVIDIA silently ignores `timeSlicing`, api/config/v1/sharing.go).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sharing.config import nvidiadevices
from sharing.config.check import DraftConfig, DraftRule
from sharing.config.document import describe
from sharing.config.mps import LIMIT_KEYS, read_limits
from sharing.config.native import MAX_REPLICAS, STRATEGIES
from sharing.config.nvidiaflags import read_flags, read_imex, read_resources
from sharing.config.problems import Report, item, key
from sharing.config.schema import boolean, choice, fields, integer
from sharing.config.spec import MigMode, MigStrategy, Selector, Sharing

DEFAULT = "*"
"""Contribution key of `nvidia.com/gpu` under none/single: every device the rule produces."""
TS = "sharing.timeSlicing"
MPS = "sharing.mps"
GPU_KIND = "gpu"


def is_nvidia(doc: dict[Any, Any]) -> bool:
    """True when a document is a device-plugin config rather than a native one."""
    if "gpus" in doc or "migStrategy" in doc:
        return False
    sharing = doc.get("sharing")
    timesliced = isinstance(sharing, dict) and ("timeSlicing" in sharing or "mps" in sharing)
    return timesliced or any(k in doc for k in ("flags", "resources", "imex"))


def read_nvidia(
    report: Report, name: str, doc: dict[str, Any], default_strategy: MigStrategy = MigStrategy.NONE
) -> DraftConfig:
    """A device-plugin config as a draft (`mig: unchanged` rules); `default_strategy` when it names none."""
    draft = DraftConfig(
        name,
        strategy=default_strategy,
        strategy_path="flags.migStrategy",
        rename_path=f"{TS}.renameByDefault",
        fail_path=f"{TS}.failRequestsGreaterThanOne",
        nvidia=True,
    )
    top = fields(report, "", doc, optional=("version", "flags", "sharing", "resources", "imex")) or {}
    if "version" in top and top["version"] != "":
        choice(report, "version", top["version"], ("v1",))
    if "resources" in top:
        read_resources(report, top["resources"])
    if "imex" in top:
        read_imex(report, top["imex"])
    strategy = read_flags(report, top.get("flags", {}), STRATEGIES)
    if strategy is not None:
        draft.strategy = MigStrategy(strategy)
    sharing = fields(report, "sharing", top.get("sharing", {}), optional=("timeSlicing", "mps")) or {}
    if "mps" in sharing and "timeSlicing" in sharing:
        report.error(
            "sharing",
            "both timeSlicing and mps are set: NVIDIA's plugin would silently ignore timeSlicing; "
            "keep the one you mean (one config per node, chosen by its label)",
        )
    word = "mps" if "mps" in sharing else "timeSlicing"  # NVIDIA's ReplicatedResources(): mps wins
    if word not in sharing:
        return draft
    section = f"sharing.{word}"
    draft.rename_path = f"{section}.renameByDefault"
    draft.fail_path = f"{section}.failRequestsGreaterThanOne"
    ts = fields(report, section, sharing[word], optional=("resources", "renameByDefault",
                "failRequestsGreaterThanOne")) or {}  # fmt: skip
    if "renameByDefault" in ts:
        draft.rename_by_default = bool(boolean(report, draft.rename_path, ts["renameByDefault"]))
    if "failRequestsGreaterThanOne" in ts:
        value = boolean(report, draft.fail_path, ts["failRequestsGreaterThanOne"])
        draft.fail_requests_greater_than_one = bool(value)
    elif section == MPS:
        # api/config/v1/config.go: "Preserve the historical MPS behavior unless the config explicitly
        # relaxes it" (unset means true for MPS).
        draft.fail_requests_greater_than_one = draft.fail_implied = True
    if section == MPS and draft.strategy is MigStrategy.MIXED:
        where = "flags.migStrategy" if strategy is not None else section
        default = "" if strategy is not None else " (the agent's default: no flags.migStrategy is set)"
        report.error(
            where,
            f"using migStrategy mixed{default} is not supported with MPS, as in NVIDIA's plugin: MPS "
            "shares whole GPUs only; use none",
        )
    resources = ts.get("resources")
    if not isinstance(resources, list) or not resources:
        got = "nothing" if "resources" not in ts else describe(resources)
        report.error(f"{section}.resources", f"no resources specified: expected a non-empty list, got {got}")
    else:
        draft.rules = _rules(report, draft.strategy, resources, section)
    return draft


@dataclass(slots=True)
class _Contribution:
    """What one resource entry asks of the GPUs it selects."""

    path: str
    kind: str
    replicas: int
    resource: str
    rename: str | None
    limits: dict[str, Any] = field(default_factory=dict)
    """MPS only: the entry's activeThreadPercentage and pinnedMemoryLimit, as written."""


def _rules(report: Report, strategy: MigStrategy, resources: list[Any], section: str) -> list[DraftRule]:
    mps = section == MPS
    keys = ("name", "replicas", "rename", "devices", *(LIMIT_KEYS if mps else ()))
    everywhere: list[_Contribution] = []
    per_gpu: dict[int | str, list[_Contribution]] = {}
    for i, value in enumerate(resources):
        path = item(f"{section}.resources", i)
        entry = fields(report, path, value, optional=keys)
        if entry is None:
            continue
        if "name" not in entry:
            report.error(key(path, "name"), "no resource name specified")
        if "replicas" not in entry:
            report.error(key(path, "replicas"), "no replicas specified")
        resource = (
            nvidiadevices.resource_name(report, key(path, "name"), entry["name"]) if "name" in entry else None
        )
        replicas = (
            _replicas(report, key(path, "replicas"), entry["replicas"]) if "replicas" in entry else None
        )
        rename = (
            nvidiadevices.resource_name(report, key(path, "rename"), entry["rename"])
            if "rename" in entry
            else None
        )
        devices = nvidiadevices.read(report, key(path, "devices"), entry.get("devices", "all"))
        if resource is None or replicas is None or devices is None or ("rename" in entry and not rename):
            continue
        if devices == ():
            continue  # an empty list selects nothing (warned)
        kind = _kind(report, key(path, "name"), strategy, resource)
        if kind is None:
            continue
        if mps:  # whole GPUs only; their MIG devices, under single, are not replicated
            kind = GPU_KIND
        limits = {k: v for k, v in entry.items() if k in LIMIT_KEYS}
        contribution = _Contribution(path, kind, replicas, resource, rename, limits)
        for bucket in (
            [everywhere] if devices == nvidiadevices.ALL else [per_gpu.setdefault(d, []) for d in devices]
        ):
            clash = next((c for c in bucket if c.kind == contribution.kind), None)
            if clash is not None:
                how = "shared with MPS" if mps else "time-sliced"
                report.error(key(path, "name"), f"{resource} is already {how} on these GPUs by {clash.path}")
                break
            bucket.append(contribution)
    # GPUs asked for by the same resources form one rule; a resource naming a GPU overrides an
    # `all` resource of the same kind on it.
    groups: dict[tuple[str, ...], tuple[list[int | str], list[_Contribution]]] = {}
    for gpu in sorted(per_gpu, key=lambda g: (isinstance(g, str), str(g).zfill(6))):
        own = per_gpu[gpu]
        merged = own + [c for c in everywhere if c.kind not in {x.kind for x in own}]
        groups.setdefault(tuple(sorted(c.path for c in merged)), ([], merged))[0].append(gpu)
    rules = [_rule(report, _selector(gpus), merged, mps) for gpus, merged in groups.values()]
    if everywhere:
        rules.append(_rule(report, [Selector(all=True)], everywhere, mps))
    return [r for rule in rules for r in rule]


def _selector(gpus: list[int | str]) -> list[Selector]:
    indices = tuple(g for g in gpus if isinstance(g, int))
    uuids = tuple(g for g in gpus if isinstance(g, str))
    return [
        s
        for s in (Selector(indices=indices) if indices else None, Selector(uuids=uuids) if uuids else None)
        if s
    ]


def _rule(
    report: Report, selectors: list[Selector], contributions: list[_Contribution], mps: bool
) -> list[DraftRule]:
    first = contributions[0].path
    rules = []
    for selector in selectors:
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
            if mps:
                rule.sharing, rule.sharing_path = Sharing.MPS, c.path
                read_limits(report, rule, c.path, c.limits)
        rules.append(rule)
    return rules


def _kind(report: Report, path: str, strategy: MigStrategy, resource: str) -> str | None:
    """`gpu`, a MIG profile, or DEFAULT (every device of the rule); None (warned) when not advertised."""
    if resource == "nvidia.com/gpu":
        return GPU_KIND if strategy is MigStrategy.MIXED else DEFAULT
    profile = nvidiadevices.mig_profile(resource)
    if profile is None:
        report.warn(path, f"the agent advertises no {resource}: nothing is replicated for it "
                    "(NVIDIA's plugin skips it too)")  # fmt: skip
        return None
    if strategy is not MigStrategy.MIXED:
        report.warn(
            path,
            f"{resource} is only advertised with migStrategy mixed (flags.migStrategy is "
            f"{strategy.value}): nothing is replicated for it (NVIDIA's plugin skips it too)",
        )
        return None
    return profile


def _replicas(report: Report, path: str, value: object) -> int | None:
    """An integer from 2 to MAX_REPLICAS; NVIDIA's parser refuses fewer than 2 with this message."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 2:
        report.error(
            path, f"number of replicas must be >= 2, got {value} (leave the resource out to not share)"
        )
        return None
    return integer(report, path, value, low=2, high=MAX_REPLICAS)
