"""A named sharing config as frozen values: what the ConfigMap asks of each GPU of a node.

`sharing.config` parses and validates YAML into these; the applier, inventory and labels read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sharing.catalog import product_key


class MigStrategy(enum.Enum):
    """How MIG devices are advertised: not at all, uniformly as `nvidia.com/gpu`, or per profile."""

    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


class MigMode(enum.Enum):
    """What a rule asks of MIG on its GPUs."""

    DISABLED = "disabled"
    """MIG off (the default when `mig` is absent or `{}`)."""
    ENABLED = "enabled"
    """MIG on with exactly `Rule.instances` (none for the word `enabled`)."""
    UNCHANGED = "unchanged"
    """Leave MIG mode and instances alone; only advertise and replicate what exists."""


@dataclass(frozen=True, slots=True)
class Selector:
    """Which GPUs a rule matches: all, a list of indices, or one product.

    A product with indices (native `{product: X, indices: [0, 1]}`, or a mig-parted entry with both
    `device-filter` and a `devices` list) matches the GPUs at those indices that are that product.
    """

    all: bool = False
    indices: tuple[int, ...] = ()
    product: str | None = None
    """Product name, canonical catalog name when the catalog knows it (`A100-SXM4-40GB`)."""

    def matches(self, index: int, product: str | None) -> bool:
        """True when the GPU with this index and product name (catalog name when known) is selected."""
        if self.all:
            return True
        if self.product is not None:
            same = product is not None and product_key(product) == product_key(self.product)
            return same and (not self.indices or index in self.indices)
        return index in self.indices


@dataclass(frozen=True, slots=True)
class Replicas:
    """Time-slicing replicas: a default for every device, and overrides per profile (or `gpu`)."""

    default: int = 1
    per_device_kind: tuple[tuple[str, int], ...] = ()
    """(`gpu` or a MIG profile name, replicas) pairs, sorted by name."""

    def for_kind(self, kind: str) -> int:
        """Replicas for a whole GPU (`gpu`) or a MIG device of this profile."""
        return dict(self.per_device_kind).get(kind, self.default)


@dataclass(frozen=True, slots=True)
class Rule:
    """One `gpus[]` entry: a selector and what to do to the GPUs it matches."""

    devices: Selector
    mig: MigMode = MigMode.DISABLED
    instances: tuple[tuple[str, int], ...] = ()
    """Wanted MIG instances as (profile, count) pairs sorted by profile; only with MigMode.ENABLED."""
    replicas: Replicas = field(default_factory=Replicas)
    rename: tuple[tuple[str, str], ...] = ()
    """(resource name as the MIG strategy names it, name advertised for its time-sliced replicas)
    pairs sorted by the first: native `rename: {nvidia.com/gpu: nvidia.com/gpu-small}` or an NVIDIA
    `resources[].rename`. Overrides `renameByDefault` for that resource on the GPUs of this rule."""


@dataclass(frozen=True, slots=True)
class SharingConfig:
    """One named config."""

    name: str
    mig_strategy: MigStrategy = MigStrategy.NONE
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    rules: tuple[Rule, ...] = ()

    def rule_for(self, index: int, product: str | None) -> Rule | None:
        """The first rule matching the GPU, or None (the GPU is left as it is)."""
        return next((r for r in self.rules if r.devices.matches(index, product)), None)
