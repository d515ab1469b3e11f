"""What a node should show for a config, computed from the config and the catalog, never by asking
the agent: the devices per resource (what the kubelet should count), the labels that say the change
is done, and the configs the benchmarks switch between.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sharing.config.spec import MigMode, MigStrategy, SharingConfig
from sharing.mig.catalog import Catalog

STATE_LABEL = "nvidia.com/mig.config.state"
CONFIG_ANNOTATION = "nvidia.com/gpu-sharing.config"
Inventory = dict[str, tuple[int, int, int]]
"""{resource: (devices, physical devices, replicas)}."""


def expected_inventory(config: SharingConfig, gpus: Sequence[str], catalog: Catalog) -> Inventory:
    """What the node should advertise under `config`, per resource."""
    found: dict[str, list[int]] = {}

    def add(resource: str, physical: int, replicas: int, rename: Mapping[str, str]) -> None:
        if physical == 0:
            return
        name = resource
        if replicas > 1:
            name = rename.get(resource) or (resource + ".shared" if config.rename_by_default else resource)
        entry = found.setdefault(name, [0, 0, replicas])
        entry[0] += physical * max(1, replicas)
        entry[1] += physical

    for index, product_name in enumerate(gpus):
        product = catalog.find(product_name)
        rule = config.rule_for(index, product.name if product else product_name)
        if rule is None or rule.mig is MigMode.UNCHANGED:
            raise ValueError(
                f"config {config.name!r} leaves GPU {index} as it is; the bench cannot predict it"
            )
        rename = dict(rule.rename)
        if rule.mig is MigMode.DISABLED or config.mig_strategy is MigStrategy.NONE:
            add("nvidia.com/gpu", 1, rule.replicas.for_kind("gpu"), rename)
            continue
        for profile, count in rule.instances:
            resource = (
                "nvidia.com/gpu"
                if config.mig_strategy is MigStrategy.SINGLE
                else "nvidia.com/mig-" + profile.replace("+", ".")
            )
            add(resource, count, rule.replicas.for_kind(profile), rename)
    return {name: (d, p, r) for name, (d, p, r) in found.items()}


def expected_labels(inventory: Inventory) -> dict[str, str]:
    """The success state and the MIG count labels (GFD's `mig-<profile>.count`, physical devices).

    The `gpu.*` labels follow GFD (the GPUs of one model, MIG or not), so they say less about
    whether this change is done; the MIG counts and the config annotation say it.
    """
    labels = {STATE_LABEL: "success"}
    for name, (_, physical, _) in inventory.items():
        key = name.removeprefix("nvidia.com/").removesuffix(".shared")
        if key.startswith("mig-"):
            labels[f"nvidia.com/{key}.count"] = str(physical)
    return labels


_COUNT_LABEL = re.compile(r"^nvidia\.com/mig-.*\.count$")


def labels_match(
    expected: Mapping[str, str], config: str | None = None
) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate on a Node view (`labels`, `annotations`): these labels, no other MIG counts, and
    (given `config`) the agent's annotation naming the config in effect."""

    def match(node: Mapping[str, Any]) -> bool:
        labels = node["labels"]
        if any(labels.get(k) != v for k, v in expected.items()):
            return False
        if config is not None and node["annotations"].get(CONFIG_ANNOTATION) != config:
            return False
        return not any(_COUNT_LABEL.match(k) and k not in expected for k in labels)

    return match


def allocatable_match(inventory: Inventory) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate on a Node view: status.allocatable has these counts and 0 for every other
    nvidia.com/ resource (the kubelet keeps a resource it no longer has at 0)."""

    def match(node: Mapping[str, Any]) -> bool:
        have = {k: v for k, v in node["allocatable"].items() if k.startswith("nvidia.com/")}
        if any(str(inventory.get(k, (0, 0, 0))[0]) != v for k, v in have.items()):
            return False
        return all(k in have for k in inventory)

    return match


def resources_match(inventory: Inventory) -> Callable[[dict[str, Any]], bool]:
    """The harness shows exactly these devices, all allocatable, and nothing else allocatable."""

    def match(resources: dict[str, Any]) -> bool:
        for name, info in resources.items():
            want = inventory.get(name, (0, 0, 0))[0]
            if want == 0:
                if info.get("allocatable", 0) != 0:
                    return False
            elif info.get("capacity") != want or info.get("allocatable") != want:
                return False
        return all(name in resources for name in inventory)

    return match


def nothing_allocatable(names: Sequence[str]) -> Callable[[dict[str, Any]], bool]:
    return lambda resources: all(resources.get(n, {}).get("allocatable", 0) == 0 for n in names)


def replicas_config(replicas: int) -> str:
    """Every GPU whole, time-sliced `replicas` ways."""
    return f"version: v1\ngpus:\n  - devices: all\n    mig: disabled\n    replicas: {replicas}\n"


def mig_config(layout: Mapping[str, int]) -> str:
    """Every GPU in MIG mode with this layout (mixed strategy)."""
    mig = ", ".join(f"{profile}: {count}" for profile, count in layout.items())
    return f"version: v1\nmigStrategy: mixed\ngpus:\n  - devices: all\n    mig: {{{mig}}}\n"
