"""Meaning checks shared by every input format: drafts (values with their YAML paths) to SharingConfig.

The native reader and the NVIDIA importers only check shape and types; they hand over drafts that
remember where each value came from, so these checks name the user's own YAML path whatever the
format: rules that can never match, MIG profiles against the catalog, counts, capacity and placement
(by the exact planner, on an empty GPU), `single` strategy uniformity, replicas and renames.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from sharing.catalog import Catalog, Product, product_key
from sharing.config.problems import Report
from sharing.plan import Infeasible, plan_gpu
from sharing.spec import MigMode, MigStrategy, Replicas, Rule, Selector, SharingConfig

GPU = "gpu"
"""The replicas/kind key of a whole GPU (MIG disabled)."""


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
    rules: list[DraftRule] = field(default_factory=list)
    order_hint: str = ""
    """Appended to "never matches" errors (the mig-parted importer explains first-match-wins)."""


def finish(
    report: Report, draft: DraftConfig, catalog: Catalog, node: tuple[str, ...] | None
) -> SharingConfig | None:
    """Check a draft; the SharingConfig when it has no errors (problems go to `report`)."""
    name = draft.name
    for rule in draft.rules:
        _canonical_product(report, name, rule, catalog, node)
    _reachability(report, draft)
    for rule in draft.rules:
        targets = _targets(rule, catalog, node)
        _check_mig(report, name, rule, catalog, targets)
        _check_replicas(
            report, name=name, strategy=draft.strategy, rule=rule, catalog=catalog, targets=targets
        )
        _check_rename(report, name, draft.strategy, rule)
    _check_strategy(report, draft)
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
            )
            for r in draft.rules
        ),
    )


def _canonical_product(
    report: Report, name: str, rule: DraftRule, catalog: Catalog, node: tuple[str, ...] | None
) -> None:
    wanted = rule.selector.product
    if wanted is None:
        return
    product = catalog.find(wanted)
    if product is not None:
        rule.selector = Selector(indices=rule.selector.indices, product=product.name)
    else:
        rule.selector = Selector(indices=rule.selector.indices, product=wanted.strip())
        report.warn(
            rule.devices_path,
            f"{wanted!r} is not in the hardware catalog: treated as a GPU without MIG "
            f"(catalog products: {', '.join(p.name for p in catalog.products)})",
            config=name,
        )
    if node is not None and not any(product_key(n) == product_key(rule.selector.product or "") for n in node):
        report.warn(rule.devices_path, f"matches none of the given GPUs ({', '.join(node)})", config=name)


def covers(earlier: Selector, later: Selector) -> bool:
    """True when every GPU `later` can match is matched by `earlier`."""
    if earlier.all:
        return True
    if later.all:
        return False
    if earlier.product is not None and (
        later.product is None or product_key(later.product) != product_key(earlier.product)
    ):
        return False
    if not earlier.indices:
        return True
    return bool(later.indices) and set(later.indices) <= set(earlier.indices)


def _reachability(report: Report, draft: DraftConfig) -> None:
    for i, rule in enumerate(draft.rules):
        earlier = draft.rules[:i]
        hint = draft.order_hint
        shadow = next((e for e in earlier if covers(e.selector, rule.selector)), None)
        if shadow is not None:
            if shadow.selector == rule.selector:
                why = f"it selects the same GPUs as {shadow.path}"
            elif shadow.selector.all:
                why = f"{shadow.path} already matches every GPU"
            else:
                why = f"{shadow.path} already matches every GPU it selects"
            report.error(rule.devices_path, f"this rule never matches: {why}{hint}", config=draft.name)
            continue
        if not rule.selector.indices:
            continue
        taken: dict[int, str] = {}
        for e in earlier:
            same_product = rule.selector.product is not None and product_key(
                e.selector.product or ""
            ) == product_key(rule.selector.product)
            if e.selector.product is None or same_product:
                for index in e.selector.indices:
                    taken.setdefault(index, e.path)
        overlap = [n for n in rule.selector.indices if n in taken]
        if overlap and len(overlap) == len(rule.selector.indices):
            paths = ", ".join(sorted({taken[n] for n in overlap}))
            report.error(
                rule.devices_path,
                f"this rule never matches: every GPU it selects is matched by {paths}{hint}",
                config=draft.name,
            )
        elif overlap:
            text = ", ".join(f"GPU {n} by {taken[n]}" for n in overlap)
            report.warn(
                rule.devices_path,
                f"partly shadowed: {text} (the first matching rule wins)",
                config=draft.name,
            )


def _targets(rule: DraftRule, catalog: Catalog, node: tuple[str, ...] | None) -> list[Product | str] | None:
    """The products the rule is checked on (a name for non-catalog ones); None: any catalog product."""
    if rule.selector.product is not None:
        return [catalog.find(rule.selector.product) or rule.selector.product]
    if node is None:
        return None
    return [catalog.find(n) or n for n in node]


@functools.lru_cache(maxsize=4096)
def _plan(product: Product, want: tuple[tuple[str, int], ...]) -> str | None:
    result = plan_gpu(product, (), dict(want))
    return result.reason if isinstance(result, Infeasible) else None


def _layout_problems(product: Product, rule: DraftRule) -> tuple[list[tuple[str, str]], str | None]:
    """(per-profile (path, message) problems, whole-layout problem) of the rule's instances on a product."""
    per_profile = []
    for profile, (count, path) in rule.instances.items():
        found = product.profile(profile)
        if found is None:
            valid = ", ".join(p.name for p in product.profiles)
            per_profile.append((path, f"unknown MIG profile {profile!r} on {product.name} (valid: {valid})"))
        elif count > found.max_count:
            per_profile.append(
                (path, f"{count} instances exceed the maximum of {found.max_count} on {product.name}")
            )
    if per_profile:
        return per_profile, None
    return [], _plan(product, tuple(sorted((p, c) for p, (c, _) in rule.instances.items())))


def _check_mig(
    report: Report, name: str, rule: DraftRule, catalog: Catalog, targets: list[Product | str] | None
) -> None:
    if rule.mig is not MigMode.ENABLED:
        return
    if targets is not None:
        for target in targets:
            if isinstance(target, str):
                report.error(
                    rule.mig_path,
                    f"{target} has no MIG (not a MIG product in the hardware catalog)",
                    config=name,
                )
                continue
            per_profile, whole = _layout_problems(target, rule)
            for path, message in per_profile:
                report.error(path, message, config=name)
            if whole is not None:
                report.error(rule.mig_path, whole, config=name)
        return
    # `all` or index rules with no products given: the layout must be valid on some catalog product.
    unknown = [p for p in rule.instances if not any(prod.profile(p) for prod in catalog.products)]
    for profile in unknown:
        report.error(
            rule.instances[profile][1],
            f"unknown MIG profile {profile!r}: no product in the hardware catalog has it",
            config=name,
        )
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
        per_profile, whole = _layout_problems(product, rule)
        if not per_profile and whole is None:
            return
        reasons.append(per_profile[0][1] if per_profile else whole)
    report.error(rule.mig_path, f"fits no product in the hardware catalog: {reasons[0]}", config=name)


def _profile_exists(profile: str, catalog: Catalog, targets: list[Product | str] | None) -> bool:
    if targets is None:
        return any(p.profile(profile) for p in catalog.products)
    return any(isinstance(t, Product) and t.profile(profile) for t in targets)


def _check_replicas(
    report: Report,
    *,
    name: str,
    strategy: MigStrategy,
    rule: DraftRule,
    catalog: Catalog,
    targets: list[Product | str] | None,
) -> None:
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
        elif not _profile_exists(kind, catalog, targets):
            problem = f"unknown MIG profile {kind!r} for the GPUs of this rule"
        if problem is not None:
            report.error(path, problem, config=name)


def resource_of(profile: str) -> str:
    """The mixed-strategy resource of a MIG profile: `1g.10gb+me` -> `nvidia.com/mig-1g.10gb.me`."""
    return "nvidia.com/mig-" + profile.replace("+", ".")


def _check_rename(report: Report, name: str, strategy: MigStrategy, rule: DraftRule) -> None:
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


def _shares_node(a: Selector, b: Selector) -> bool:
    return a.product is None or b.product is None or product_key(a.product) == product_key(b.product)


def _check_strategy(report: Report, draft: DraftConfig) -> None:
    name = draft.name
    enabled = [r for r in draft.rules if r.mig is MigMode.ENABLED]
    if draft.strategy is MigStrategy.NONE and any(r.instances for r in enabled):
        report.warn(
            draft.strategy_path,
            "migStrategy none advertises MIG-enabled GPUs as whole GPUs; "
            "the MIG instances are not advertised (use mixed or single)",
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
        if draft.fail_requests_greater_than_one:
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
