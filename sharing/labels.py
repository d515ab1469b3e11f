"""Node labels: what the node offers, in GPU-feature-discovery names, and the reconfiguration state.

Pure. Labels are derived from what is advertised (the inventory) and what is observed (products,
memory), so schedulers and people see exactly the slices the kubelet sees. The agent owns a fixed set
of keys and computes a patch that sets what changed and removes owned labels that no longer apply;
it never touches any other label (`nvidia.com/device-plugin.config`, `nvidia.com/gpu.deploy.*`, ...).
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Mapping

from sharing.catalog import Catalog, default_catalog
from sharing.inventory import GPU_RESOURCE, SHARED_SUFFIX, Device, Inventory
from sharing.model import NodeState
from sharing.spec import MigStrategy, SharingConfig

PREFIX = "nvidia.com/"
STATE_LABEL = "nvidia.com/mig.config.state"

_GLOBAL_KEYS = frozenset(
    PREFIX + key
    for key in (
        "gpu.present",
        "gpu.product",
        "gpu.count",
        "gpu.memory",
        "gpu.replicas",
        "gpu.sharing-strategy",
        "gpu.slices.gi",
        "gpu.slices.ci",
        "mig.capable",
        "mig.strategy",
        "mig.config.state",
    )
)
_MIG_KEY = re.compile(
    r"^nvidia\.com/mig-[0-9]+(c\.[0-9]+)?g\.[0-9]+gb[a-z.]*"
    r"\.(count|memory|replicas|product|sharing-strategy|slices\.gi|slices\.ci)$"
)


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
    strategy = config.mig_strategy if config is not None else MigStrategy.MIXED
    labels[PREFIX + "gpu.present"] = "true"
    labels[PREFIX + "mig.capable"] = _bool(any(g.mig_capable for g in node.gpus))
    if strategy is not MigStrategy.NONE and any(g.mig_enabled for g in node.gpus):
        labels[PREFIX + "mig.strategy"] = strategy.value
    facts = _DeviceFacts(node, catalog)
    full = [d for name, devices in inventory.resources if _base(name) == GPU_RESOURCE for d in devices]
    labels.update(_resource_labels("gpu", full, _renamed(inventory, GPU_RESOURCE), facts))
    labels.setdefault(PREFIX + "gpu.count", "0")
    for name, devices in inventory.resources:
        base = _base(name)
        # Resources a rule renamed to a name of its own get no GFD labels (GFD has no names for them).
        if base.startswith(PREFIX + "mig-"):
            labels.update(_resource_labels(base.removeprefix(PREFIX), devices, name != base, facts))
    return labels


def label_patch(current: Mapping[str, str], desired: Mapping[str, str]) -> dict[str, str | None]:
    """A merge patch for `metadata.labels`: changed owned labels, None for owned ones to remove."""
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    patch.update({k: None for k in current if owned(k) and k not in desired})
    return patch


def sanitise(*parts: str) -> str:
    """GFD's product naming: drop characters outside [A-Za-z0-9-_. ], whitespace runs become '-'."""
    cleaned = (re.sub(r"\s+", "-", re.sub(r"[^A-Za-z0-9\-_. ]", "", part).strip()) for part in parts)
    return "-".join(c for c in cleaned if c)


class _DeviceFacts:
    """Product, memory and slices of a device, looked up from the observed node and the catalog."""

    def __init__(self, node: NodeState, catalog: Catalog) -> None:
        self._gpus = {g.uuid: g for g in node.gpus}
        self._migs = {ci.uuid: (gpu, gi) for gpu in node.gpus for gi, ci in gpu.mig_devices}
        self._catalog = catalog

    def describe(self, device: Device) -> tuple[str, int, int | None]:
        """(product label, memory MiB, GPU-instance slices or None for a full GPU)."""
        if device.mig_uuid is None or device.mig_uuid not in self._migs:
            gpu = self._gpus[device.gpu_uuid]
            return sanitise(gpu.product), gpu.memory_mib, None
        gpu, gi = self._migs[device.mig_uuid]
        product = self._catalog.find(gpu.product)
        profile = product.profile(gi.profile) if product is not None else None
        memory = profile.memory_mib if profile is not None else 0
        slices = int(gi.profile.split("g.")[0].split(".")[-1])
        return sanitise(gpu.product, "MIG", gi.profile), memory, slices


def _resource_labels(
    key: str, devices: list[Device] | tuple[Device, ...], renamed: bool, facts: _DeviceFacts
) -> dict[str, str]:
    if not devices:
        return {}
    physical = {d.uuid: d for d in devices}
    replicas = Counter(d.uuid for d in devices).most_common(1)[0][1]
    described = Counter(facts.describe(d) for d in physical.values())
    (product, memory, slices), _ = described.most_common(1)[0]
    shared = replicas > 1
    labels = {
        f"{PREFIX}{key}.count": str(len(physical)),
        f"{PREFIX}{key}.replicas": str(replicas),
        f"{PREFIX}{key}.memory": str(memory),
        f"{PREFIX}{key}.product": product + ("-SHARED" if shared and not renamed else ""),
        f"{PREFIX}{key}.sharing-strategy": "time-slicing" if shared else "none",
    }
    if slices is not None:
        labels[f"{PREFIX}{key}.slices.gi"] = str(slices)
        labels[f"{PREFIX}{key}.slices.ci"] = str(slices)
    return labels


def _base(name: str) -> str:
    return name.removesuffix(SHARED_SUFFIX)


def _renamed(inventory: Inventory, base: str) -> bool:
    return any(name == base + SHARED_SUFFIX for name in inventory.names())


def _bool(value: bool) -> str:
    return "true" if value else "false"
