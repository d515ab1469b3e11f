"""Checks across the rules of one draft: reachability, replicas, renames, the `single` strategy.

Split from `check` (which checks each rule's MIG layout against the GPUs); same drafts, same
reports, same path-named messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sharing.config.node import NodeGpu
from sharing.config.problems import Report
from sharing.config.spec import MigMode, MigStrategy, Selector
from sharing.mig import Catalog, product_key

if TYPE_CHECKING:
    from sharing.config.check import DraftConfig, DraftRule

GPU = "gpu"

OVERRIDE_HINT = "mig-parted applies every matching entry in turn, so the last one wins"


def covers(earlier: Selector, later: Selector) -> bool:
    """True when every GPU `later` can match is matched by `earlier`."""
    if earlier.all:
        return True
    if later.all:
        return False
    if earlier.uuids or later.uuids:
        return bool(earlier.uuids) and bool(later.uuids) and set(later.uuids) <= set(earlier.uuids)
    if earlier.pci or later.pci:
        if not (earlier.pci and later.pci and set(later.pci) <= set(earlier.pci)):
            return False
    elif earlier.product is not None and (
        later.product is None or product_key(later.product) != product_key(earlier.product)
    ):
        return False
    if not earlier.indices:
        return True
    return bool(later.indices) and set(later.indices) <= set(earlier.indices)


def _same_kind(a: Selector, b: Selector) -> bool:
    """True when an index of `a` and one of `b` name the same GPU whenever both match it."""
    if a.pci or b.pci:
        return set(a.pci) == set(b.pci)
    if a.product is None:
        return True
    return b.product is not None and product_key(a.product) == product_key(b.product)


def reachability(report: Report, draft: DraftConfig) -> None:
    """Rules that can never match are errors (mig-parted: entries overridden by later ones, warnings)."""
    say = report.warn if draft.migparted else report.error
    for i, rule in enumerate(draft.rules):
        earlier = draft.rules[:i]
        shadow = next((e for e in earlier if covers(e.selector, rule.selector)), None)
        if shadow is not None:
            if draft.migparted:
                say(rule.devices_path, f"never applies: {shadow.path} comes later and matches every GPU "
                    f"this entry matches ({OVERRIDE_HINT})", config=draft.name)  # fmt: skip
                continue
            if shadow.selector == rule.selector:
                why = f"it selects the same GPUs as {shadow.path}"
            elif shadow.selector.all:
                why = f"{shadow.path} already matches every GPU"
            else:
                why = f"{shadow.path} already matches every GPU it selects"
            say(rule.devices_path, f"this rule never matches: {why}", config=draft.name)
            continue
        if not rule.selector.indices:
            continue
        taken: dict[int, str] = {}
        for e in earlier:
            if not e.selector.uuids and (
                (e.selector.product is None and not e.selector.pci) or _same_kind(e.selector, rule.selector)
            ):
                for index in e.selector.indices:
                    taken.setdefault(index, e.path)
        overlap = [n for n in rule.selector.indices if n in taken]
        if overlap and len(overlap) == len(rule.selector.indices) and not draft.migparted:
            paths = ", ".join(sorted({taken[n] for n in overlap}))
            say(rule.devices_path, f"this rule never matches: every GPU it selects is matched by {paths}",
                config=draft.name)  # fmt: skip
        elif overlap:
            text = ", ".join(f"GPU {n} by {taken[n]}" for n in overlap)
            winner = OVERRIDE_HINT if draft.migparted else "the first matching rule wins"
            report.warn(rule.devices_path, f"partly overridden: {text} ({winner})", config=draft.name)


def _profile_exists(profile: str, catalog: Catalog, targets: list[NodeGpu] | None) -> bool:
    if targets is None:
        return any(p.profile(profile) for p in catalog.products)
    return any(t.geometry is not None and t.geometry.profile(profile) for t in targets)


def check_replicas(
    report: Report,
    name: str,
    strategy: MigStrategy,
    rule: DraftRule,
    catalog: Catalog,
    *,
    targets: list[NodeGpu] | None,
    lenient: bool = False,
) -> None:
    """Per-kind replicas must name something the rule advertises.

    `lenient` (NVIDIA device-plugin configs): a MIG profile no GPU has is a warning, because NVIDIA's
    plugin skips a replicated resource it does not advertise.
    """
    for kind, (_, path) in rule.replicas.items():
        problem = None
        if kind == GPU:
            if rule.mig is MigMode.ENABLED:
                problem = "MIG is enabled on these GPUs: there is no whole GPU to replicate"
        elif strategy is MigStrategy.NONE:
            problem = "migStrategy none does not advertise MIG devices; use single or mixed"
        elif rule.mig is MigMode.DISABLED:
            problem = f"MIG is disabled by this rule: there are no {kind} devices"
        elif rule.mig is MigMode.ENABLED and kind not in rule.instances:
            wanted = ", ".join(rule.instances) or "none"
            problem = f"{kind} is not one of this rule's MIG instances ({wanted})"
        elif targets != [] and not _profile_exists(kind, catalog, targets):  # []: no GPU to ask
            problem = f"unknown MIG profile {kind!r} for the GPUs of this rule"
            if lenient:
                report.warn(path, f"{problem}: nothing is replicated for it (NVIDIA's plugin skips it too)",
                            config=name)  # fmt: skip
                continue
        if problem is not None:
            report.error(path, problem, config=name)


def resource_of(profile: str) -> str:
    """The mixed-strategy resource of a MIG profile: `1g.10gb+me` -> `nvidia.com/mig-1g.10gb.me`."""
    return "nvidia.com/mig-" + profile.replace("+", ".")


def check_rename(report: Report, name: str, strategy: MigStrategy, rule: DraftRule) -> None:
    """A rename must name a resource the rule advertises, and must not take one of ours."""
    produced = {"nvidia.com/gpu"}
    if strategy is MigStrategy.MIXED:
        produced |= {resource_of(p) for p in rule.instances} if rule.mig is MigMode.ENABLED else set()
    for resource, (new, path) in rule.rename.items():
        unchanged_mig = rule.mig is MigMode.UNCHANGED and strategy is MigStrategy.MIXED
        if resource not in produced and not (unchanged_mig and resource.startswith("nvidia.com/mig-")):
            report.error(
                path,
                f"this rule advertises no {resource} (it advertises {', '.join(sorted(produced))})",
                config=name,
            )
        if new == "nvidia.com/gpu" or new.startswith("nvidia.com/mig-"):
            report.error(
                path, f"{new} is a name the agent advertises itself; choose another name", config=name
            )
        kind = next((p for p in rule.instances if resource_of(p) == resource), "gpu")
        if rule.replicas.get(kind, (rule.replicas_default, ""))[0] <= 1:
            report.warn(
                path,
                f"only time-sliced replicas are renamed, and this rule gives {resource} 1 replica: "
                "nothing is renamed (add replicas)",
                config=name,
            )


def _shares_node(a: Selector, b: Selector) -> bool:
    if a.product is None or b.product is None:
        return True
    return product_key(a.product) == product_key(b.product)


def check_strategy(report: Report, draft: DraftConfig) -> None:
    """What the strategy makes of the rules: none hides MIG devices, single needs one profile."""
    name = draft.name
    enabled = [r for r in draft.rules if r.mig is MigMode.ENABLED]
    if draft.strategy is MigStrategy.NONE and any(r.instances for r in enabled):
        report.warn(
            draft.strategy_path,
            "migStrategy none advertises no MIG devices, and a GPU in MIG mode is never advertised as a "
            "whole GPU: these GPUs would offer nothing (use mixed or single)",
            config=name,
        )
    if draft.strategy is MigStrategy.SINGLE:
        _check_single(report, draft, enabled)
    replicated = any(
        r.replicas_default > 1 or any(n > 1 for n, _ in r.replicas.values()) for r in draft.rules
    )
    if not replicated:
        if draft.rename_by_default:
            report.warn(
                draft.rename_path, "has no effect: no rule time-slices a device (replicas > 1)", config=name
            )
        if draft.fail_requests_greater_than_one and not draft.fail_implied:
            report.warn(
                draft.fail_path, "has no effect: no rule time-slices a device (replicas > 1)", config=name
            )


def _check_single(report: Report, draft: DraftConfig, enabled: list[DraftRule]) -> None:
    name = draft.name
    for i, rule in enumerate(enabled):
        if len(rule.instances) > 1:
            report.error(
                rule.mig_path,
                "migStrategy single needs one MIG profile per GPU; "
                f"this rule has {', '.join(sorted(rule.instances))} (use mixed)",
                config=name,
            )
        elif not rule.instances:
            report.warn(
                rule.mig_path,
                "migStrategy single advertises nothing for a MIG-enabled GPU without instances",
                config=name,
            )
        for other in enabled[:i]:
            if (
                _shares_node(rule.selector, other.selector)
                and rule.instances
                and other.instances
                and set(rule.instances) != set(other.instances)
            ):
                report.error(
                    rule.mig_path,
                    f"migStrategy single needs the same MIG profile on every GPU of a node; "
                    f"{other.path} uses {', '.join(sorted(other.instances))} (use mixed)",
                    config=name,
                )
                break
    for rule in draft.rules:
        if rule.mig is MigMode.DISABLED:
            clash = next((e for e in enabled if _shares_node(rule.selector, e.selector)), None)
            if clash is not None:
                report.warn(
                    rule.mig_path or rule.devices_path,
                    "migStrategy single needs MIG on every GPU of a node "
                    f"or on none; {clash.path} enables it on GPUs that may share a node with these",
                    config=name,
                )
