"""Node labels: what the node offers, in GPU-feature-discovery names and value formats, and the state.

Pure. Labels come from what is observed (models, memory, compute capability, driver and CUDA
versions, the driver's MIG profiles) and what is advertised (the inventory: counts and replicas),
so schedulers see exactly the slices the kubelet sees, under the names GPU feature discovery uses
(`gfd` builds them; docs/labels.md lists every one). The agent owns a fixed set of keys and
computes a patch that sets what changed and removes owned labels that no longer apply; it never
touches any other label (`nvidia.com/device-plugin.config`, `nvidia.com/gpu.deploy.*`, ...). A
label the API server would refuse is left out of the patch (`refused`), since one bad entry fails
the whole request and with it the state label.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

from sharing.config import MigStrategy, Sharing, SharingConfig, identity
from sharing.devices import Inventory
from sharing.labels.gfd import (
    ENGINES,
    PREFIX,
    driver_labels,
    full_gpu_labels,
    mixed_labels,
    node_wide_labels,
    sanitise,
    single_labels,
)
from sharing.labels.layout import layout
from sharing.mig import Catalog, default_catalog
from sharing.model import NodeState

__all__ = [
    "PREFIX",
    "STATE_LABEL",
    "ConfigState",
    "label_patch",
    "layout",
    "node_labels",
    "owned",
    "refused",
    "sanitise",
]

STATE_LABEL = "nvidia.com/mig.config.state"

_RESOURCE_KEYS = (
    "product",
    "count",
    "replicas",
    "sharing-strategy",
    "memory",
    "multiprocessors",
    "slices.gi",
    "slices.ci",
    *(f"engines.{e}" for e in ENGINES),
)
_GLOBAL_KEYS = frozenset(
    PREFIX + key
    for key in (
        "gpu.present",
        "mig.capable",
        "mig.strategy",
        "mig.config.state",
        "mps.capable",
        "vgpu.present",
        "gpu.mode",
        "gpu.machine",
        "gpu.family",
        "gpu.compute.major",
        "gpu.compute.minor",
        "cuda.driver.major",
        "cuda.driver.minor",
        "cuda.driver.rev",
        "cuda.runtime.major",
        "cuda.runtime.minor",
        "cuda.driver-version.major",
        "cuda.driver-version.minor",
        "cuda.driver-version.revision",
        "cuda.driver-version.full",
        "cuda.runtime-version.major",
        "cuda.runtime-version.minor",
        "cuda.runtime-version.full",
        *(f"gpu.{k}" for k in _RESOURCE_KEYS),
    )
)
_MIG_KEY = re.compile(
    r"^nvidia\.com/mig-[0-9]+(c\.[0-9]+)?g\.[0-9]+gb[a-z.-]*\.("
    + "|".join(re.escape(k) for k in _RESOURCE_KEYS)
    + r")$"
)
# The API server's rule for a label value and for the name part of a key (k8s.io/apimachinery
# pkg/util/validation/validation.go: IsValidLabelValue, IsQualifiedName; at most 63 characters).
_NAME = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


class ConfigState(enum.Enum):
    """The value of `nvidia.com/mig.config.state`."""

    PENDING = "pending"
    SUCCESS = "success"
    FAILED = "failed"


def owned(key: str) -> bool:
    """True for the label keys this agent writes and may remove."""
    return key in _GLOBAL_KEYS or _MIG_KEY.match(key) is not None


def node_labels(
    node: NodeState,
    config: SharingConfig | None,
    inventory: Inventory,
    state: ConfigState | None,
    catalog: Catalog | None = None,
) -> dict[str, str]:
    """Every owned label with its value for this node (labels absent here are to be removed)."""
    catalog = catalog if catalog is not None else default_catalog()
    labels: dict[str, str] = {}
    if state is not None:
        labels[STATE_LABEL] = state.value
    if not node.gpus:
        return labels
    # No config: the GPUs are advertised as they are, MIG devices per profile (mixed). Labels follow
    # what is advertised: a GPU whose change was blocked keeps its MIG devices under the config in
    # effect on it, even when the node's new config has no MIG.
    strategy = config.mig_strategy if config is not None else MigStrategy.MIXED
    if strategy is MigStrategy.NONE and any(n.startswith(PREFIX + "mig-") for n in inventory.names()):
        strategy = MigStrategy.MIXED
    mps = _mps_gpus(node, config, inventory, catalog)
    labels.update(node_wide_labels(node, bool(mps)))
    labels.update(driver_labels(node.driver))
    if strategy is not MigStrategy.NONE:
        labels[PREFIX + "mig.strategy"] = strategy.value
    labels.update(full_gpu_labels(node, inventory, mps))
    if strategy is MigStrategy.SINGLE:
        labels.update(single_labels(node, inventory, catalog))
    elif strategy is MigStrategy.MIXED:
        labels.update(mixed_labels(node, inventory, catalog))
    return labels


def _mps_gpus(
    node: NodeState, config: SharingConfig | None, inventory: Inventory, catalog: Catalog
) -> frozenset[str]:
    """UUIDs of the GPUs whose advertised replicas the config shares with MPS (MIG off on them)."""
    if config is None:
        return frozenset()
    replicated = {d.gpu_uuid for _, devices in inventory.resources for d in devices if d.replica is not None}
    found = set()
    for gpu in node.gpus:
        rule = config.rule_matching(identity(gpu, catalog))
        mps = rule is not None and rule.sharing is Sharing.MPS
        if mps and not gpu.mig_enabled and gpu.uuid in replicated:
            found.add(gpu.uuid)
    return frozenset(found)


def refused(labels: Mapping[str, str]) -> dict[str, str]:
    """The labels the API server would refuse: a value, or a key's name, not of the label rule."""
    return {
        k: v
        for k, v in labels.items()
        if not all(len(t) <= 63 and _NAME.fullmatch(t) for t in (v, k.rpartition("/")[2])) or k.endswith("/")
    }


def label_patch(current: Mapping[str, str], desired: Mapping[str, str]) -> dict[str, str | None]:
    """A merge patch for `metadata.labels`: changed owned labels, None for owned ones to remove.

    Labels the API server would refuse are treated as absent (an older value of theirs is removed).
    """
    bad = refused(desired)
    desired = {k: v for k, v in desired.items() if k not in bad}
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    patch.update({k: None for k in current if owned(k) and k not in desired})
    return patch
