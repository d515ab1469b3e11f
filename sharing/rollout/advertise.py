"""What the front-end in service offers: the inventory built from the hardware, handed on.

Each GPU is offered under the config in effect on it (`Rollout.effective`). A GPU that cannot be read
keeps its last known devices, offered unhealthy; MPS replicas are offered only where their GPU's
daemon enforces their limits (fail closed). On the device plugins the CDI spec is written before the
plugins learn of a device, so every name Allocate can hand out resolves; on DRA the node's
ResourceSlices carry the devices (the DRA plugin writes a CDI spec per claim itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import structlog

from sharing.config import Frontend, SharingConfig
from sharing.deviceplugin import Fleet
from sharing.devices import (
    Health,
    Injection,
    Inventory,
    MpsSettings,
    build_inventory,
    mps_layout,
    with_health,
)
from sharing.gpu import GpuBackend, build_spec, write_spec
from sharing.gpu.mps import MpsDaemons, Readiness
from sharing.mig import Catalog
from sharing.model import Gpu, GpuUuid, NodeState
from sharing.rollout.frontend import DraFrontend
from sharing.text import bounded

log = structlog.get_logger(__name__)


class Advertiser:
    """Builds what the hardware offers and hands it to the front-end in service."""

    def __init__(
        self,
        *,
        backend: GpuBackend,
        fleet: Fleet,
        catalog: Catalog,
        dra: DraFrontend | None,
        injection: Injection,
        cdi_spec_dir: Path | None,
        mps: MpsDaemons | None,
    ) -> None:
        self.backend = backend
        self.fleet = fleet
        self.catalog = catalog
        self.dra = dra
        self.injection = injection
        self.cdi_spec_dir = cdi_spec_dir
        self.mps = mps
        self.frontend = Frontend.DEVICE_PLUGIN
        """Where `publish` sends the devices (`sharing.rollout.switch` switches it)."""
        self.dra_problem = ""
        """Why the DRA front-end could not publish the last inventory ("": it did)."""
        self.shown = Inventory()
        """What the front-end was last given: the advertised devices, less what a change under way
        withdrew."""
        self.node = NodeState(())
        """The node the last inventory was built from (for the CDI spec)."""
        self._mps_wanted: dict[GpuUuid, MpsSettings] = {}
        """What each GPU's daemon must enforce for the devices advertised (their config in effect)."""
        self._seen: dict[GpuUuid, Gpu] = {}

    def build(
        self,
        observed: NodeState,
        config: SharingConfig | None,
        effective: Mapping[GpuUuid, SharingConfig | None],
    ) -> Inventory:
        """What the hardware has, each GPU under the config in `effective` (else `config`); a GPU that
        cannot be read keeps its last known devices, unhealthy."""
        self._seen.update((g.uuid, g) for g in observed.gpus)
        lost = [
            self._seen[u.uuid]
            for u in observed.unreadable
            if u.uuid is not None and u.uuid in self._seen and observed.gpu(u.uuid) is None
        ]
        gpus = tuple(sorted((*observed.gpus, *lost), key=lambda g: g.index))
        inventory = build_inventory(
            replace(observed, gpus=gpus), config, catalog=self.catalog, per_gpu=effective
        )
        if lost:
            inventory = unhealthy(inventory, frozenset(g.uuid for g in lost))
        for warning in inventory.warnings:
            log.warning("inventory_warning", warning=bounded(warning))
        self.node = replace(observed, gpus=gpus)
        self._mps_wanted = mps_layout(self.node, config, self.catalog, per_gpu=effective)
        return inventory

    def forget(self, gpu: GpuUuid) -> None:
        """A GPU changed, then unreadable: what it had before is no longer known to exist."""
        self._seen.pop(gpu, None)

    def ready(self, inventory: Inventory) -> Inventory:
        """MPS replicas only where their GPU's daemon enforces their limits: unhealthy where the daemon
        started for them no longer answers, absent where none enforces them yet (fail closed)."""
        if self.mps is None:
            return inventory
        state = {u: self.mps.readiness(u, s) for u, s in self._mps_wanted.items()}
        gpus = {d.gpu_uuid for _, devices in inventory.resources for d in devices if d.mps}
        pending = {u for u in gpus if state.get(u, Readiness.PENDING) is Readiness.PENDING}
        down = frozenset(u for u in gpus if state.get(u) is Readiness.DOWN)
        resources = tuple(
            (name, kept)
            for name, devices in inventory.resources
            if (kept := tuple(d for d in devices if not (d.mps and d.gpu_uuid in pending)))
        )
        return unhealthy(replace(inventory, resources=resources), down)

    async def republish(self) -> None:
        """The devices last shown again, with what the MPS daemons answer now or new health on DRA."""
        await self.publish(self.shown)

    async def publish(self, inventory: Inventory) -> None:
        """The CDI spec first (every name Allocate can hand out resolves), then the plugins; on the DRA
        front-end the node's ResourceSlices (the DRA plugin writes a CDI spec per claim itself)."""
        self.shown = inventory
        inventory = self.ready(inventory)
        if self.frontend is Frontend.DRA:
            if self.dra is None:
                return
            # Health events reach the device plugins through the fleet; the slices carry them as taints.
            self.dra_problem = await self.dra.publish(with_health(inventory, self.fleet.health), self.node)
            if self.dra_problem:
                log.error("slices_not_published", error=bounded(self.dra_problem))
            return
        if self.cdi_spec_dir is not None:
            spec = (
                build_spec(
                    inventory,
                    self.node,
                    self.backend.device_files,
                    self.injection.ids,
                    mps_root=self.injection.mps_root,
                )
                if self.injection.cdi
                else None
            )
            try:
                if await asyncio.to_thread(write_spec, self.cdi_spec_dir, spec):
                    log.info(
                        "cdi_spec_written",
                        dir=str(self.cdi_spec_dir),
                        devices=len(spec["devices"]) if spec else 0,
                    )
            except OSError as err:
                # The plugins still advertise: a container using CDI names would fail to start,
                # and the kubelet says so on the pod; the log says why here.
                log.error("cdi_spec_not_written", dir=str(self.cdi_spec_dir), error=bounded(str(err)))
        self.fleet.update(inventory)


def unhealthy(inventory: Inventory, gpus: frozenset[GpuUuid]) -> Inventory:
    """`inventory` with every device of these GPUs unhealthy."""
    resources = tuple(
        (name, tuple(replace(d, health=Health.UNHEALTHY) if d.gpu_uuid in gpus else d for d in devices))
        for name, devices in inventory.resources
    )
    return replace(inventory, resources=resources)
