"""What the node advertises: observed GPUs + the sharing config + health -> devices per resource.

This is the contract users see on the Node (DESIGN.md "Resources and device IDs"): full GPUs under
`nvidia.com/gpu`, MIG devices under `nvidia.com/mig-<profile>` (mixed; a compute instance smaller than
its GPU instance under its own profile, `mig-1c.3g.20gb`: `sharing.mig.device_profile`) or
`nvidia.com/gpu` (single),
replica `n` of a device as `<uuid>::<n>`, renamed `<name>.shared` with renameByDefault. Health is an
overlay kept apart from the devices, so a health event flips devices without rebuilding anything.
Pure: no I/O, no clock; warnings come back as data.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import NewType

from sharing.config import MigMode, MigStrategy, Rule, Sharing, SharingConfig, identity, is_dynamic
from sharing.devices.xids import APPLICATION_XIDS
from sharing.errors import PluginError
from sharing.mig import Catalog, default_catalog, device_profile
from sharing.model import Gpu, GpuUuid, HealthEvent, MigUuid, NodeState

ResourceName = NewType("ResourceName", str)
"""An extended resource name, `nvidia.com/gpu`, `nvidia.com/mig-1g.5gb.shared`, ..."""

DeviceId = NewType("DeviceId", str)
"""A device ID as the kubelet sees it: a GPU or MIG UUID, or `<uuid>::<n>` for replica n."""

GPU_RESOURCE = ResourceName("nvidia.com/gpu")
REPLICA_SEPARATOR = "::"
SHARED_SUFFIX = ".shared"


class Health(enum.Enum):
    """Device health, spelled as the kubelet's device-plugin API spells it."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class Device:
    """One advertised device: a full GPU, a MIG device, or a replica of either."""

    id: DeviceId
    health: Health
    numa_node: int | None
    gpu_uuid: GpuUuid
    """The physical GPU this device lives on."""
    mig_uuid: MigUuid | None = None
    replica: int | None = None
    """Replica index when the device is time-sliced, else None."""
    index: str = ""
    """The device as the driver numbers it: `0` for GPU 0, `0:1` for MIG device 1 of GPU 0
    (deviceIDStrategy `index`)."""
    mps: bool = False
    """A client of its GPU's MPS server (`sharing: mps`): Allocate hands out the daemon's pipes too."""

    @property
    def uuid(self) -> str:
        """The UUID a container gets for this device (MIG UUID for MIG devices)."""
        return self.mig_uuid if self.mig_uuid is not None else self.gpu_uuid


@dataclass(frozen=True, slots=True)
class Inventory:
    """Devices per resource name (sorted by name), and the allocation rules that come with them."""

    resources: tuple[tuple[ResourceName, tuple[Device, ...]], ...] = ()
    fail_requests_greater_than_one: bool = False
    warnings: tuple[str, ...] = ()
    dynamic: frozenset[str] = frozenset()
    """UUIDs of the GPUs under `mig: dynamic`: they have no devices here, the DRA front-end offers
    their placements (`sharing.dra.partitions`)."""
    whole: frozenset[str] = frozenset()
    """UUIDs of the GPUs without MIG that a `mig: dynamic` rule matches: offered as whole GPUs."""
    reclaim: frozenset[str] = frozenset()
    """The dynamic GPUs whose rule says `reclaimForeign: idle` (`sharing.dra.foreign`)."""

    def names(self) -> tuple[ResourceName, ...]:
        """Resource names, sorted."""
        return tuple(name for name, _ in self.resources)

    def devices(self, resource: str) -> tuple[Device, ...]:
        """The devices of one resource; empty when the node does not advertise it."""
        return next((devices for name, devices in self.resources if name == resource), ())

    def as_dict(self) -> dict[ResourceName, tuple[Device, ...]]:
        """{resource name: devices}."""
        return dict(self.resources)


@dataclass(frozen=True, slots=True)
class HealthState:
    """Which physical GPUs and MIG devices the backend reported unhealthy and not yet recovered."""

    unhealthy_gpus: frozenset[GpuUuid] = frozenset()
    unhealthy_migs: frozenset[tuple[GpuUuid, MigUuid]] = frozenset()

    def apply(self, event: HealthEvent, ignored_xids: Iterable[int] = APPLICATION_XIDS) -> HealthState:
        """The state after a backend event; application XIDs (`ignored_xids`) change nothing."""
        if not event.healthy:
            if event.xid is not None and event.xid in frozenset(ignored_xids):
                return self
            if event.mig_uuid is None:
                return replace(self, unhealthy_gpus=self.unhealthy_gpus | {event.gpu_uuid})
            return replace(self, unhealthy_migs=self.unhealthy_migs | {(event.gpu_uuid, event.mig_uuid)})
        if event.mig_uuid is None:
            # The whole GPU is healthy again, and with it every MIG device on it.
            return HealthState(
                self.unhealthy_gpus - {event.gpu_uuid},
                frozenset(m for m in self.unhealthy_migs if m[0] != event.gpu_uuid),
            )
        return replace(self, unhealthy_migs=self.unhealthy_migs - {(event.gpu_uuid, event.mig_uuid)})

    def health_of(self, device: Device) -> Health:
        """Unhealthy when its GPU is, or (for a MIG device or its replicas) when its MIG device is."""
        if device.gpu_uuid in self.unhealthy_gpus:
            return Health.UNHEALTHY
        if device.mig_uuid is not None and (device.gpu_uuid, device.mig_uuid) in self.unhealthy_migs:
            return Health.UNHEALTHY
        return Health.HEALTHY


def device_id(uuid: str, replica: int | None = None) -> DeviceId:
    """The ID of a device (`uuid`) or of its replica `n` (`uuid::n`)."""
    return DeviceId(uuid if replica is None else f"{uuid}{REPLICA_SEPARATOR}{replica}")


def parse_device_id(value: str) -> tuple[str, int | None]:
    """(device UUID, replica index or None) back from a device ID; PluginError when malformed."""
    uuid, sep, index = value.partition(REPLICA_SEPARATOR)
    if not uuid or (sep and not (index.isascii() and index.isdigit())):
        raise PluginError(f"malformed device ID {value!r}: expected <uuid> or <uuid>::<replica index>")
    return uuid, (int(index) if sep else None)


def mig_resource(profile: str) -> ResourceName:
    """`nvidia.com/mig-<profile>`, with `+` (as in `+me`) written `.` like NVIDIA's plugin does."""
    return ResourceName(f"nvidia.com/mig-{profile.replace('+', '.')}")


def build_inventory(
    node: NodeState,
    config: SharingConfig | None,
    health: HealthState | None = None,
    catalog: Catalog | None = None,
    *,
    per_gpu: Mapping[GpuUuid, SharingConfig | None] | None = None,
) -> Inventory:
    """What to advertise for this node; config None advertises the GPUs as they are (MIG mixed).

    `per_gpu` overrides the config for some GPUs: a GPU whose change failed keeps advertising
    its devices under the names of the config last applied to it.
    """
    catalog = catalog if catalog is not None else default_catalog()
    warnings: list[str] = []

    def config_of(uuid: GpuUuid) -> SharingConfig | None:
        return per_gpu[uuid] if per_gpu is not None and uuid in per_gpu else config

    singles = [g for g in node.gpus if _strategy(config_of(g.uuid)) is MigStrategy.SINGLE]
    single_ok = not singles or _single_is_uniform(NodeState(tuple(singles)), warnings)
    rules = {g.uuid: _rule(g, config_of(g.uuid), catalog) for g in node.gpus}
    found: dict[ResourceName, list[Device]] = {}
    for gpu in node.gpus:
        cfg = config_of(gpu.uuid)
        for resource, device in _devices_of(
            gpu, cfg, rules[gpu.uuid], strategy=_strategy(cfg), single_ok=single_ok, warnings=warnings
        ):
            found.setdefault(resource, []).append(device)
    inventory = Inventory(
        resources=tuple((name, tuple(found[name])) for name in sorted(found)),
        fail_requests_greater_than_one=config is not None and config.fail_requests_greater_than_one,
        warnings=tuple(warnings),
        dynamic=frozenset(g.uuid for g in node.gpus if is_dynamic(rules[g.uuid], g)),
        whole=frozenset(
            g.uuid
            for g in node.gpus
            if (r := rules[g.uuid]) and r.mig is MigMode.DYNAMIC and not g.mig_capable
        ),
        reclaim=frozenset(
            g.uuid
            for g in node.gpus
            if (r := rules[g.uuid]) is not None and is_dynamic(r, g) and r.reclaim_foreign
        ),
    )
    return with_health(inventory, health) if health is not None else inventory


def _rule(gpu: Gpu, config: SharingConfig | None, catalog: Catalog) -> Rule | None:
    return config.rule_matching(identity(gpu, catalog)) if config else None


def withdraw(inventory: Inventory, uuids: Collection[str]) -> Inventory:
    """The inventory without the devices (and their replicas) whose container UUID is in `uuids`."""
    gone = frozenset(uuids)
    resources = tuple(
        (name, kept)
        for name, devices in inventory.resources
        if (kept := tuple(d for d in devices if d.uuid not in gone))
    )
    return replace(inventory, resources=resources)


def forms(inventory: Inventory) -> dict[str, frozenset[tuple[ResourceName, DeviceId]]]:
    """{device UUID: every (resource, device ID) it is offered as}: how the kubelet sees each device."""
    found: dict[str, set[tuple[ResourceName, DeviceId]]] = {}
    for name, devices in inventory.resources:
        for d in devices:
            found.setdefault(d.uuid, set()).add((name, d.id))
    return {uuid: frozenset(entries) for uuid, entries in found.items()}


def reformed(before: Inventory, after: Inventory) -> frozenset[str]:
    """UUIDs of the devices both offer, `after` under other IDs or names (replicas or renames changed).

    The kubelet tracks allocations by resource and ID: it must stop offering the old form before the
    new one appears, or a pod admitted in between holds an ID the agent no longer knows about.
    """
    old, new = forms(before), forms(after)
    return frozenset(uuid for uuid in old.keys() & new.keys() if old[uuid] != new[uuid])


def _strategy(config: SharingConfig | None) -> MigStrategy:
    return config.mig_strategy if config is not None else MigStrategy.MIXED


def with_health(inventory: Inventory, health: HealthState) -> Inventory:
    """The same inventory with `health` overlaid: a device is unhealthy when it already was
    (e.g. its GPU cannot be read) or when `health` says so. Devices whose health does not change
    are the same objects (copying each was most of a health update's time on 2,048 devices)."""
    if not health.unhealthy_gpus and not health.unhealthy_migs:
        return inventory
    resources = tuple(
        (name, tuple(d if health.health_of(d) is d.health else _unhealthy(d) for d in devices))
        for name, devices in inventory.resources
    )
    return replace(inventory, resources=resources)


def _unhealthy(device: Device) -> Device:
    return device if device.health is Health.UNHEALTHY else replace(device, health=Health.UNHEALTHY)


def inventory_from(
    resources: Mapping[str, Iterable[Device]], *, fail_requests_greater_than_one: bool = False
) -> Inventory:
    """An Inventory from {resource: devices}, sorted the way build_inventory sorts (for tests, tools)."""
    return Inventory(
        resources=tuple((ResourceName(n), tuple(resources[n])) for n in sorted(resources)),
        fail_requests_greater_than_one=fail_requests_greater_than_one,
    )


def _devices_of(
    gpu: Gpu,
    config: SharingConfig | None,
    rule: Rule | None,
    *,
    strategy: MigStrategy,
    single_ok: bool,
    warnings: list[str],
) -> Iterable[tuple[ResourceName, Device]]:
    if is_dynamic(rule, gpu):
        return  # its MIG devices are made per claim: the DRA front-end offers them (sharing.dra.partitions)
    rename = _Rename(config is not None and config.rename_by_default, dict(rule.rename) if rule else {})
    if gpu.mig_enabled and strategy is MigStrategy.NONE:
        # A GPU in MIG mode runs nothing as a whole GPU: handing it out would give a pod a GPU it
        # cannot use, beside pods holding its MIG devices.
        warnings.append(
            f"GPU {gpu.index} ({gpu.uuid}) has MIG enabled but migStrategy is none: it is not advertised;"
            " use migStrategy mixed or single to advertise its MIG devices"
        )
        return
    if not gpu.mig_enabled:
        replicas = rule.replicas.for_kind("gpu") if rule else 1
        mps = rule is not None and rule.sharing is Sharing.MPS
        yield from _replicate(GPU_RESOURCE, gpu, None, replicas, rename, index=str(gpu.index), mps=mps)
        return
    if not gpu.mig_devices:
        warnings.append(
            f"GPU {gpu.index} ({gpu.uuid}) has MIG enabled but no MIG devices: nothing to advertise"
        )
    if not single_ok:
        return
    for position, (gi, ci) in enumerate(gpu.mig_devices):
        # A compute instance smaller than its GPU instance is a device of its own profile (`1c.3g.20gb`),
        # never one of the GPU instance's: a pod asking for a 3g.20gb gets all three compute slices.
        profile = device_profile(gi, ci)
        resource = GPU_RESOURCE if strategy is MigStrategy.SINGLE else mig_resource(profile)
        replicas = rule.replicas.for_kind(profile) if rule else 1
        index = f"{gpu.index}:{position if ci.mig_index is None else ci.mig_index}"
        yield from _replicate(resource, gpu, ci.uuid, replicas, rename, index=index)


@dataclass(frozen=True, slots=True)
class _Rename:
    """How time-sliced resources are named: the rule's own renames first, then renameByDefault."""

    by_default: bool
    per_resource: Mapping[str, str]

    def __call__(self, resource: ResourceName) -> ResourceName:
        if resource in self.per_resource:
            return ResourceName(self.per_resource[resource])
        return ResourceName(resource + SHARED_SUFFIX) if self.by_default else resource


def _replicate(
    resource: ResourceName,
    gpu: Gpu,
    mig_uuid: MigUuid | None,
    replicas: int,
    rename: _Rename,
    *,
    index: str,
    mps: bool = False,
) -> Iterable[tuple[ResourceName, Device]]:
    uuid = mig_uuid if mig_uuid is not None else gpu.uuid
    if replicas <= 1:
        yield (
            resource,
            Device(device_id(uuid), Health.HEALTHY, gpu.numa_node, gpu.uuid, mig_uuid, index=index, mps=mps),
        )
        return
    shared = rename(resource)
    for n in range(replicas):
        yield (
            shared,
            Device(device_id(uuid, n), Health.HEALTHY, gpu.numa_node, gpu.uuid, mig_uuid, n, index, mps),
        )


def _single_is_uniform(node: NodeState, warnings: list[str]) -> bool:
    """migStrategy single needs one MIG profile across the node; say why when it is not."""
    profiles = Counter(
        device_profile(gi, ci) for gpu in node.gpus if gpu.mig_enabled for gi, ci in gpu.mig_devices
    )
    if len(profiles) > 1:
        found = ", ".join(f"{p} x{n}" for p, n in sorted(profiles.items()))
        warnings.append(
            f"migStrategy single needs one MIG profile on the whole node, found {found}: no MIG devices are"
            " advertised; use migStrategy mixed or make the layouts uniform"
        )
        return False
    if profiles and any(not gpu.mig_enabled for gpu in node.gpus):
        warnings.append(
            "migStrategy single with some GPUs not in MIG mode: full GPUs and MIG devices are both"
            " advertised as nvidia.com/gpu"
        )
    return True
