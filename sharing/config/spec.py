"""A named sharing config as frozen values: what the ConfigMap asks of each GPU of a node.

`sharing.config` parses and validates YAML into these; the applier, inventory and labels read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sharing.mig import Catalog, Target, catalog_name, product_key
from sharing.model import Gpu


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
    DYNAMIC = "dynamic"
    """MIG on, no instances made ahead: on the DRA front-end each claim gets one made at prepare."""


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """What rules match a GPU on; None where it is not known (a GPU named only by its product)."""

    index: int | None = None
    product: str | None = None
    """Catalog name when the catalog knows the GPU, else its NVML name."""
    nvml_name: str | None = None
    pci_device_id: int | None = None
    """NVML's packed pciDeviceId (0x20B010DE)."""
    pci_subsystem_id: int | None = None
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class PciFilter:
    """A mig-parted device-filter: exact device+vendor (0x20B010DE), optionally the subsystem too."""

    device: int
    subsystem: int | None = None

    def matches(self, device: int | None, subsystem: int | None) -> bool:
        """True for a GPU with this packed PCI id (and subsystem, when the filter names one)."""
        return device == self.device and (self.subsystem is None or subsystem == self.subsystem)

    def __str__(self) -> str:
        sub = "" if self.subsystem is None else f":0x{self.subsystem:08X}"
        return f"0x{self.device:08X}{sub}"


@dataclass(frozen=True, slots=True)
class Selector:
    """Which GPUs a rule matches: all, a list of indices or UUIDs, one product, or PCI ids.

    A product or PCI filter with indices (native `{product: X, indices: [0, 1]}`, or a mig-parted
    entry with both `device-filter` and a `devices` list) matches the GPUs at those indices that
    are that product. PCI filters compare exact ids, as mig-parted does.
    """

    all: bool = False
    indices: tuple[int, ...] = ()
    product: str | None = None
    """Product name, canonical catalog name when the catalog knows it (`A100-SXM4-40GB`)."""
    pci: tuple[PciFilter, ...] = ()
    uuids: tuple[str, ...] = ()

    def matches(self, gpu: GpuIdentity) -> bool:
        """True when the rule selects this GPU; an unknown index counts as any index."""
        if self.all:
            return True
        if self.uuids:
            return gpu.uuid is not None and gpu.uuid in self.uuids
        if self.pci:
            if not any(f.matches(gpu.pci_device_id, gpu.pci_subsystem_id) for f in self.pci):
                return False
        elif self.product is not None:
            wanted = product_key(self.product)
            names = (gpu.product, gpu.nvml_name)
            if not any(n is not None and product_key(n) == wanted for n in names):
                return False
        return not self.indices or gpu.index is None or gpu.index in self.indices


@dataclass(frozen=True, slots=True)
class Replicas:
    """Time-slicing replicas: a default for every device, and overrides per profile (or `gpu`)."""

    default: int = 1
    per_device_kind: tuple[tuple[str, int], ...] = ()
    """(`gpu` or a MIG profile name, replicas) pairs, sorted by name."""

    def for_kind(self, kind: str) -> int:
        """Replicas for a whole GPU (`gpu`) or a MIG device of this profile."""
        return dict(self.per_device_kind).get(kind, self.default)


class Sharing(enum.Enum):
    """How a rule's replicas share a device: time-sliced, or as clients of one MPS server."""

    TIME_SLICING = "timeSlicing"
    MPS = "mps"


@dataclass(frozen=True, slots=True)
class MpsLimits:
    """Per-replica limits the MPS control daemon of a GPU enforces as its client defaults.

    None means the default: `100 // replicas` percent of the threads, `memory // replicas` MiB.
    """

    active_thread_percentage: int | None = None
    pinned_memory_mib: int | None = None


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
    skip_without_mig: bool = False
    """mig-parted semantics: a GPU without MIG that the rule matches is left as it is."""
    sharing: Sharing = Sharing.TIME_SLICING
    """How the rule's replicas (`replicas`) share a whole GPU; MPS only without MIG."""
    mps: MpsLimits = field(default_factory=MpsLimits)
    """The per-replica limits, with `sharing` MPS."""
    reclaim_foreign: bool = False
    """`reclaimForeign: idle` (only with `mig: dynamic`): MIG instances the agent did not make are
    destroyed once idle and unclaimed, and their room offered; False (`never`, the default): they
    are offered as they are and never destroyed."""


@dataclass(frozen=True, slots=True)
class SharingConfig:
    """One named config."""

    name: str
    mig_strategy: MigStrategy = MigStrategy.NONE
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    rules: tuple[Rule, ...] = ()

    def rule_for(
        self,
        index: int,
        product: str | None,
        *,
        pci_device_id: int | None = None,
        pci_subsystem_id: int | None = None,
        nvml_name: str | None = None,
        uuid: str | None = None,
    ) -> Rule | None:
        """The first rule matching the GPU, or None (the GPU is left as it is)."""
        gpu = GpuIdentity(index, product, nvml_name, pci_device_id, pci_subsystem_id, uuid)
        return self.rule_matching(gpu)

    def rule_matching(self, gpu: GpuIdentity) -> Rule | None:
        """The first rule whose selector matches `gpu`, or None."""
        return next((r for r in self.rules if r.devices.matches(gpu)), None)


def identity(gpu: Gpu, catalog: Catalog) -> GpuIdentity:
    """What config rules match this GPU on: index, catalog and NVML names, PCI ids, UUID."""
    return GpuIdentity(
        index=gpu.index,
        product=catalog_name(gpu, catalog) or gpu.product,
        nvml_name=gpu.product,
        pci_device_id=gpu.pci_device_id,
        pci_subsystem_id=gpu.pci_subsystem_id,
        uuid=gpu.uuid,
    )


def target_for(config: SharingConfig, gpu: Gpu, catalog: Catalog) -> Target | None:
    """What the config asks of this GPU; None when it is to be left as it is."""
    rule = config.rule_matching(identity(gpu, catalog))
    if rule is None or rule.mig is MigMode.UNCHANGED:
        return None
    if rule.skip_without_mig and not gpu.mig_capable:
        return None  # mig-parted skips GPUs without MIG that an entry matches
    if rule.mig is MigMode.DISABLED:
        return Target(mig_enabled=False)
    if rule.mig is MigMode.DYNAMIC:
        if not is_dynamic(rule, gpu):
            return Target(mig_enabled=False)  # no MIG: offered whole
        return Target(mig_enabled=True, dynamic=True)  # the instances are the claims' (DRA front-end)
    return Target(mig_enabled=True, instances=rule.instances)


def is_dynamic(rule: Rule | None, gpu: Gpu) -> bool:
    """The GPU's MIG devices are made per claim: its rule says `mig: dynamic` and it has MIG.

    A GPU without MIG (an L4 or A10 beside A100s) under such a rule is offered whole, as `mig: disabled`
    offers it, so one config serves every GPU of a mixed node; NVIDIA's DRA driver publishes nothing
    for the whole node then (https://github.com/kubernetes-sigs/dra-driver-nvidia-gpu/issues/1092).
    """
    return rule is not None and rule.mig is MigMode.DYNAMIC and gpu.mig_capable
