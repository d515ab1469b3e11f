"""The DRA front-end as the agent drives it: the kubelet plugin and the node's ResourceSlices together.

`publish` is what `Fleet.update` is to the device plugins: the devices the hardware has, under the
config in effect, go into the pool's slices (`sharing.dra.slices`) and the plugin prepares claims
against that same inventory. It returns once the API server holds the slices, so a withdrawal is
confirmed when it returns: from then on no scheduler allocates what the slices no longer list
(allocations made before are claims the rollout reads as holders). `withdraw` deletes the slices.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import structlog

from sharing.devices import Inventory
from sharing.dra.holds import ClaimHold
from sharing.dra.names import DRIVER
from sharing.dra.plugin import DraPaths, DraPlugin
from sharing.dra.prepare import Recorder
from sharing.dra.slices import build_slices
from sharing.errors import SharingError
from sharing.gpu.devfiles import DeviceFiles
from sharing.kube import KubeClient
from sharing.kube.resourceslices import SlicePublisher
from sharing.mig import Catalog
from sharing.model import NodeState
from sharing.text import bounded

log = structlog.get_logger(__name__)


class DraFrontEnd:
    """The DRA plugin and the slice publisher of one node (pool = node name)."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        node_name: str,
        files: DeviceFiles,
        cdi_dir: Path,
        catalog: Catalog,
        paths: DraPaths | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        self.node_name = node_name
        self.catalog = catalog
        self.inventory = Inventory()
        self.node = NodeState(())
        self.plugin = DraPlugin(
            node_name=node_name,
            claims=kube,
            inventory=lambda: self.inventory,
            node=lambda: self.node,
            files=files,
            cdi_dir=cdi_dir,
            paths=paths or DraPaths(),
            recorder=recorder,
        )
        self.publisher = SlicePublisher(kube, node_name, DRIVER)
        self._task: asyncio.Task[None] | None = None
        self._problem = ""

    async def start(self) -> None:
        """Serve the plugin's sockets and keep the slices as wanted (re-published after a wipe)."""
        if self._task is None:
            await self.plugin.start()
            self._task = asyncio.create_task(self.publisher.run(), name="resourceslices")

    async def stop(self) -> None:
        """Unregister and stop serving; the slices stay until `withdraw`."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.plugin.serving:
            await self.plugin.stop()

    async def publish(self, inventory: Inventory, node: NodeState) -> str:
        """Offer exactly `inventory` in the pool's slices; "" once the API server holds them."""
        self.inventory, self.node = inventory, node
        self.plugin.refresh()
        self.publisher.want(build_slices(self.node_name, node, inventory, self.catalog))
        return await self._sync()

    async def withdraw(self) -> str:
        """Delete the pool's slices; "" once they are gone."""
        self.inventory = Inventory()
        self.publisher.want(())
        return await self._sync()

    def health(self) -> tuple[bool, str]:
        """(the plugin serves and the publisher runs, why it is not ready or "")."""
        alive = self.plugin.serving and self._task is not None and not self._task.done()
        registration = self.plugin.registration
        if not registration.registered:
            why = registration.error or "waiting for the kubelet"
            return alive, f"the DRA plugin is not registered with the kubelet: {why}"
        if self._problem:
            return alive, self._problem
        return alive, ""

    async def prepared(self) -> tuple[tuple[ClaimHold, ...], str]:
        """The claims prepared on this node with the devices they hold, and why that cannot be told
        ("": it can; the checkpoint is unreadable otherwise, and then everything counts as held)."""
        prepared = self.plugin.prepared()
        holds = tuple(
            ClaimHold(
                c.namespace,
                c.name,
                tuple(f"{c.namespace}/{p.name}" for p in c.pods),
                frozenset(d.uuid for d in c.devices),
            )
            for c in prepared.claims
        )
        return holds, prepared.unknown

    async def _sync(self) -> str:
        try:
            await asyncio.to_thread(self.publisher.sync)
        except SharingError as err:
            why = f"the ResourceSlices of node {self.node_name} could not be written: {bounded(str(err))}"
            log.warning("resourceslices_not_synced", error=why)
            self._problem = why
            return why
        self._problem = ""
        return ""
