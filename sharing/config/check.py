"""Meaning checks shared by every input format: drafts (values with their YAML paths) to SharingConfig.

The native reader and the NVIDIA importers only check shape and types; they hand over drafts that
remember where each value came from, so these checks name the user's own YAML path whatever the
format: rules that can never match, MIG profiles against each GPU's profiles, counts, capacity and
placement (by the exact planner, on an empty GPU), `single` strategy uniformity, replicas, renames.
A mig-parted draft keeps mig-parted's meaning: an entry that matches no GPU of the node is skipped
(a warning at most), an entry overridden by a later one is not an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sharing.config.mps import check_mps
from sharing.config.node import NodeGpu, catalog_targets, layout_problems
from sharing.config.problems import Report, key
from sharing.config.rules import GPU, check_rename, check_replicas, check_strategy, covers, reachability
from sharing.config.spec import (
    MigMode,
    MigStrategy,
    MpsLimits,
    Replicas,
    Rule,
    Selector,
    Sharing,
    SharingConfig,
)
from sharing.mig import Catalog

__all__ = ["GPU", "DraftConfig", "DraftRule", "covers", "finish"]

_GI_PROFILE = re.compile(r"^[0-9]+g\.[0-9]+gb([+-][a-z.]+)?$")
"""The form of a GPU-instance profile name (go-nvlib): `3g.139gb`, `1g.35gb+me`, `1g.24gb-me`."""


@dataclass(slots=True)
class DraftRule:
    """A rule as read, with the path of each part (for messages)."""

    path: str
    devices_path: str
    selector: Selector
    mig: MigMode = MigMode.DISABLED
    mig_path: str = ""
    instances: dict[str, tuple[int, str]] = field(default_factory=dict)
    replicas_default: int = 1
    replicas: dict[str, tuple[int, str]] = field(default_factory=dict)
    rename: dict[str, tuple[str, str]] = field(default_factory=dict)
    skip_without_mig: bool = False
    sharing: Sharing = Sharing.TIME_SLICING
    sharing_path: str = ""
    """The `mps` key of a native rule, or the `sharing.mps.resources[]` entry (MPS messages)."""
    mps: MpsLimits = field(default_factory=MpsLimits)
    thread_path: str = ""
    memory_path: str = ""
    reclaim_foreign: bool = False


@dataclass(slots=True)
class DraftConfig:
    """A config as read, before the meaning checks."""

    name: str
    strategy: MigStrategy = MigStrategy.NONE
    strategy_path: str = "migStrategy"
    rename_by_default: bool = False
    rename_path: str = "sharing.renameByDefault"
    fail_requests_greater_than_one: bool = False
    fail_path: str = "sharing.failRequestsGreaterThanOne"
    fail_implied: bool = False
    """failRequestsGreaterThanOne is true because MPS makes it so, not because the config says so."""
    rules: list[DraftRule] = field(default_factory=list)
    nvidia: bool = False
    """An NVIDIA device-plugin config: replicated resources that no GPU has are skipped with a warning."""
    migparted: bool = False
    """mig-parted semantics: rules are in reverse file order (the last entry wins), unmatched
    entries are skipped, overridden entries are fine."""


def finish(
    report: Report, draft: DraftConfig, catalog: Catalog, node: tuple[NodeGpu, ...] | None
) -> SharingConfig | None:
    """Check a draft; the SharingConfig when it has no errors (problems go to `report`)."""
    name = draft.name
    for rule in draft.rules:
        _canonical_product(report, name, rule, catalog)
    reachability(report, draft)
    for rule in draft.rules:
        targets = _targets(report, draft, rule, catalog, node)
        _check_mig(report, draft, rule, catalog, targets, offline=node is None)
        _check_dynamic(report, draft, rule, targets)
        check_replicas(report, name, draft.strategy, rule, catalog, targets=targets, lenient=draft.nvidia)
        check_rename(report, name, draft.strategy, rule)
        if rule.sharing is Sharing.MPS:
            check_mps(report, name, rule, _first_match(draft, rule, targets))
    check_strategy(report, draft)
    if report.has_errors_for(name):
        return None
    return SharingConfig(
        name=name,
        mig_strategy=draft.strategy,
        rename_by_default=draft.rename_by_default,
        fail_requests_greater_than_one=draft.fail_requests_greater_than_one,
        rules=tuple(
            Rule(
                devices=r.selector,
                mig=r.mig,
                instances=tuple(sorted((p, c) for p, (c, _) in r.instances.items())),
                replicas=Replicas(
                    r.replicas_default, tuple(sorted((k, n) for k, (n, _) in r.replicas.items()))
                ),
                rename=tuple(sorted((k, v) for k, (v, _) in r.rename.items())),
                skip_without_mig=r.skip_without_mig,
                sharing=r.sharing,
                mps=r.mps,
                reclaim_foreign=r.reclaim_foreign,
            )
            for r in draft.rules
        ),
    )


def _first_match(draft: DraftConfig, rule: DraftRule, targets: list[NodeGpu] | None) -> list[NodeGpu] | None:
    """The targets this rule applies to: those no earlier rule matches (the first match wins)."""
    if targets is None:
        return None
    first = {id(t): next((r for r in draft.rules if r.selector.matches(t.identity)), rule) for t in targets}
    return [t for t in targets if first[id(t)] is rule]


def _canonical_product(report: Report, name: str, rule: DraftRule, catalog: Catalog) -> None:
    wanted = rule.selector.product
    if wanted is None:
        return
    product = catalog.describe(wanted)
    canonical = product.name if product is not None else wanted.strip()
    rule.selector = Selector(indices=rule.selector.indices, product=canonical)
    if product is None:
        known = ", ".join([p.name for p in catalog.products] + [p.name for p in catalog.plain])
        report.warn(
            rule.devices_path,
            f"{wanted!r} is not in the hardware catalog: it matches GPUs whose NVML name is {wanted!r} "
            f"(catalog products: {known})",
            config=name,
        )


def _targets(
    report: Report, draft: DraftConfig, rule: DraftRule, catalog: Catalog, node: tuple[NodeGpu, ...] | None
) -> list[NodeGpu] | None:
    """The GPUs the rule is checked on; None: offline, any catalog product."""
    if node is not None:
        matched = [g for g in node if rule.selector.matches(g.identity)]
        if not matched and (rule.selector.product is not None or rule.selector.pci or rule.selector.indices):
            names = ", ".join(dict.fromkeys(g.name for g in node)) or "none"
            what = "skipped, as mig-parted skips it" if draft.migparted else "the rule does nothing here"
            report.warn(
                rule.devices_path, f"matches none of the node's GPUs ({names}): {what}", config=draft.name
            )
        return matched
    targets = catalog_targets(rule.selector, catalog)
    if targets == [] and rule.selector.pci:
        ids = ", ".join(str(f) for f in rule.selector.pci)
        report.warn(
            rule.devices_path,
            f"no product in the hardware catalog has PCI id {ids}: the entry applies only to GPUs with "
            "that id, and its layout cannot be checked offline",
            config=draft.name,
        )
    return targets


DYNAMIC_FRONTEND = (
    "mig: dynamic makes MIG devices per claim and works only on the DRA front-end: on a node served by "
    "the device plugins these GPUs get MIG mode on and offer nothing"
)


def _check_dynamic(
    report: Report, draft: DraftConfig, rule: DraftRule, targets: list[NodeGpu] | None
) -> None:
    """`mig: dynamic`: MIG on and nothing made ahead, so nothing to replicate, share or rename."""
    if rule.mig is not MigMode.DYNAMIC:
        return
    name = draft.name
    why = "MIG devices made on demand are given whole to one claim each"
    if rule.sharing is Sharing.MPS:
        report.error(rule.sharing_path or rule.path, f"MPS is not available with mig: dynamic: {why}",
                     config=name)  # fmt: skip
    if rule.replicas_default > 1:
        report.error(key(rule.path, "replicas"), f"replicas are not available with mig: dynamic: {why}",
                     config=name)  # fmt: skip
    for _, path in rule.replicas.values():
        if rule.sharing is not Sharing.MPS:
            report.error(path, f"replicas are not available with mig: dynamic: {why}", config=name)
    for _, path in rule.rename.values():
        report.error(path, f"nothing to rename with mig: dynamic: {why}", config=name)
    if rule.selector.product is not None or rule.selector.pci:  # names the product: MIG or nothing
        for target in targets or ():
            if target.known and target.geometry is None:
                report.error(rule.mig_path, f"{target.name} has no MIG (not a MIG product)", config=name)
    else:  # `all`, indices, UUIDs: a mixed node's GPUs without MIG are offered whole (spec.is_dynamic)
        whole = [t for t in _first_match(draft, rule, targets) or () if t.known and t.geometry is None]
        gpus = list(dict.fromkeys(f"GPU {t.identity.index} ({t.name})" for t in whole))
        if gpus:
            said = "has no MIG: it is" if len(gpus) == 1 else "have no MIG: they are"
            whole_gpus = "a whole GPU" if len(gpus) == 1 else "whole GPUs"
            report.warn(rule.mig_path, f"{', '.join(gpus)} {said} offered as {whole_gpus} (mig: dynamic "
                        "applies to the GPUs with MIG)", config=name)  # fmt: skip
    report.warn(rule.mig_path, DYNAMIC_FRONTEND, config=name)


def _check_mig(
    report: Report,
    draft: DraftConfig,
    rule: DraftRule,
    catalog: Catalog,
    targets: list[NodeGpu] | None,
    *,
    offline: bool,
) -> None:
    if rule.mig is not MigMode.ENABLED:
        return
    name = draft.name
    # A filtered mig-parted entry checked offline only warns: it applies to nodes with that GPU,
    # and drivers have named profiles differently (GB200 1g.24gb -> 1g.23gb).
    soft = report.warn if draft.migparted and offline else report.error
    if targets is not None:
        for target in targets:
            if target.geometry is None and not target.known:
                report.warn(
                    rule.mig_path,
                    f"{target.name} is not in the hardware catalog: the layout is checked against what its "
                    "driver reports when the agent runs on it",
                    config=name,
                )
                continue
            if target.geometry is None:
                if not rule.skip_without_mig:
                    soft(rule.mig_path, f"{target.name} has no MIG (not a MIG product)", config=name)
                continue
            if not target.geometry.profiles:
                report.warn(
                    rule.mig_path,
                    f"the hardware catalog knows no MIG profiles of {target.name}: the layout is checked "
                    "against what its driver reports when the agent runs on it",
                    config=name,
                )
                continue
            per_profile, whole = layout_problems(target.geometry, rule.instances)
            for path, message in per_profile:
                soft(path, message, config=name)
            if whole is not None:
                soft(rule.mig_path, whole, config=name)
        return
    # `all` or index rules with no GPUs given: the layout must be valid on some catalog product. A
    # profile no catalog product has may be a GPU's the catalog lacks: its driver decides on the node
    # (as mig-parted lets it; with --gpu naming a product the catalog knows, it is an error).
    unknown = [p for p in rule.instances if not any(prod.profile(p) for prod in catalog.products)]
    for profile in unknown:
        problem = f"unknown MIG profile {profile!r}: no product in the hardware catalog has it"
        if _GI_PROFILE.match(profile):
            report.warn(rule.instances[profile][1], f"{problem}; the driver of each GPU decides on the node",
                        config=name)  # fmt: skip
        else:  # not a GPU-instance profile name at all (`1c.2g.10gb` is a compute-instance profile)
            report.error(rule.instances[profile][1], problem, config=name)
    if unknown or not rule.instances:
        return
    candidates = [p for p in catalog.products if all(p.profile(n) for n in rule.instances)]
    if not candidates:
        report.error(
            rule.mig_path,
            f"no product in the hardware catalog has all of {', '.join(rule.instances)}",
            config=name,
        )
        return
    reasons = []
    for product in candidates:
        per_profile, whole = layout_problems(product, rule.instances)
        if not per_profile and whole is None:
            return
        reasons.append(per_profile[0][1] if per_profile else whole)
    report.error(rule.mig_path, f"fits no product in the hardware catalog: {reasons[0]}", config=name)
