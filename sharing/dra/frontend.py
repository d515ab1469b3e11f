"""The DRA front-end as the agent drives it: the kubelet plugin and the node's ResourceSlices together.

`publish` is what `Fleet.update` is to the device plugins: the devices the hardware has, under the
config in effect, go into the pool's slices (`sharing.dra.slices`) and the plugin prepares claims
against that same inventory. It returns once the API server holds the slices, so a withdrawal is
confirmed when it returns: from then on no scheduler that reads the slices afresh allocates what they
no longer list. A scheduling cycle that read them before may still write such an allocation: `settled`
waits that out (`SCHEDULER_WINDOW_S` after the last withdrawal) before the claims that hold devices
are read from the node (`sharing.kube.podclaims`). `withdraw` deletes the slices.

GPUs under `mig: dynamic` (`Inventory.dynamic`) are published as partitionable devices
(`sharing.dra.partitions`) beside the static ones, in one pool. Their order is the placement policy,
built from what the node knows, never from other nodes' claims: the claims prepared here (the
plugin's checkpoint) and the instances on the GPUs. The plugin makes the instance of an on-demand
device at prepare and destroys it at unprepare (`sharing.dra.ondemand`); the GPUs are read again
after each (coalesced: one wake for a burst) and every `resync_s` for instances made or destroyed by
someone else, and the slices re-published when either changed. A claim allocated and not prepared
yet is not known here: its placement has no instance, so its device stays published (the scheduler
counts what an allocated device consumes only while the slices list it), and the order is stale for
a moment, which is safe, only less good. Instances the agent did not make are offered as they are
(`sharing.dra.foreign`); on a GPU whose rule says `reclaimForeign: idle`, the idle ones no claim
holds are destroyed, as any change is made: their devices withdrawn and confirmed, the claims of the
node's pods read, and those a claim is allocated kept.

The pool adds no device until the kubelet has confirmed the plugin's registration
(`SlicePublisher.hold_additions`): a pod placed on a device of a driver the kubelet does not know
yet fails to start and waits out the kubelet's retry. So it is at every start of the agent, and
again when the kubelet restarts (its kubelet.sock is new; the kubelet wipes the node's slices and
registers the plugins it finds again), unless the new kubelet has already confirmed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import structlog

from sharing.devices import HealthState, Inventory
from sharing.dra.foreign import Foreign, Held, foreign_instances, held, reclaimable
from sharing.dra.fragmentation import GpuRoom, room
from sharing.dra.names import DRIVER
from sharing.dra.ondemand import OnDemand
from sharing.dra.partitions import partitionable_slices, pool, withdrawn_static
from sharing.dra.plugin import DraPaths, DraPlugin, Registration, others_serving
from sharing.dra.prepare import Recorder
from sharing.dra.slices import build_slices
from sharing.errors import KubeError, SharingError
from sharing.gpu.devfiles import DeviceFiles
from sharing.kube import KubeClient
from sharing.kube.api import SliceSpec
from sharing.kube.features import ClusterFeatures, described, probe
from sharing.kube.resourceslices import SlicePublisher
from sharing.kubelet.restarts import SocketId, socket_identity
from sharing.mig import Catalog
from sharing.model import ClaimAllocation, ClaimHold, NodeState
from sharing.store import PreparedClaim
from sharing.text import bounded

log = structlog.get_logger(__name__)

NodeClaims = Callable[[], Awaitable[tuple[ClaimAllocation, ...]]]
"""The claims with devices of the node's pool allocated, read from the node's pods
(`sharing.kube.podclaims`, after `settled`); KubeError when that cannot be told."""

SCHEDULER_WINDOW_S = 5.0
"""How long after a withdrawal reached the API server a scheduling cycle that read the pool before it
may still be on its way to writing an allocation of a withdrawn device where the node can see it. The
scheduler reads the slices at the start of a cycle (PreFilter) and, once it has reserved devices,
names the node in the pod's `status.nominatedNodeName` before it writes the claim's allocation in
PreBind (k8s.io/kubernetes v1.37.2 pkg/scheduler/schedule_one.go `bindingCycle`): what lies between
is one cycle's filtering and scoring and its informer's delay, with no wait on anything outside."""


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
        ondemand: OnDemand | None = None,
        gpu_health: Callable[[], HealthState] | None = None,
        resync_s: float = 10.0,
        kubelet_socket: Path | None = None,
        kubelet_poll_s: float = 1.0,
        node_claims: NodeClaims | None = None,
    ) -> None:
        self.kube = kube
        self._gpu_health = gpu_health
        self._backend = ondemand.backend if ondemand is not None else None
        self.node_name = node_name
        self.catalog = catalog
        self.inventory = Inventory()
        self.node = NodeState(())
        self.resync_s = resync_s
        self.node_claims: NodeClaims | None = node_claims
        """Where `reclaimForeign: idle` asks which claims hold devices (None: nothing is reclaimed)."""
        self._wake = asyncio.Event()
        """Set when claims were prepared or unprepared."""
        self._prepared: frozenset[str] = frozenset()
        """The pool's device names the prepared claims hold, as the slices were last built for."""
        self._reclaiming: frozenset[Held] = frozenset()
        """Foreign instances being reclaimed: their devices are withdrawn first."""
        self._published: frozenset[str] = frozenset()
        """The device names the API server holds in the pool, as last synced."""
        self._withdrawn_at = -SCHEDULER_WINDOW_S
        """When (loop time) a sync last took devices out of the pool."""
        self.plugin = DraPlugin(
            node_name=node_name,
            claims=kube,
            inventory=lambda: self.inventory,
            node=lambda: self.node,
            files=files,
            cdi_dir=cdi_dir,
            paths=paths or DraPaths(),
            recorder=recorder,
            ondemand=ondemand,
            gpu_health=gpu_health,
            prepared_changed=self._wake.set,
            on_registration=self._registration,
        )
        self.publisher = SlicePublisher(kube, node_name, DRIVER)
        self._task: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self._kubelet_watch: asyncio.Task[None] | None = None
        self._kubelet_socket = kubelet_socket
        """The kubelet's device-plugin kubelet.sock: made anew at each kubelet start."""
        self._kubelet_poll_s = kubelet_poll_s
        self._confirmed_by: SocketId | None = None
        """The kubelet (its kubelet.sock) that last confirmed the registration (None: none since start)."""
        self._problem = ""
        self._features = ClusterFeatures()
        self._probe_error = ""

    async def features(self) -> ClusterFeatures:
        """What the cluster's API server keeps of the fields the pool uses (`sharing.kube.features`):
        asked once, said once (`cluster_features_missing`); asked again while the API server has not
        answered (then `known` is False)."""
        if self._features.known:
            return self._features
        try:
            self._features = await asyncio.to_thread(probe, self.kube, DRIVER, self.node_name)
        except KubeError as err:
            if str(err) != self._probe_error:
                log.warning("cluster_features_not_probed", error=bounded(str(err)))
            self._probe_error = str(err)
            return self._features
        missing = self._features.missing
        self.publisher.said_missing = missing
        if missing:
            log.warning(
                "cluster_features_missing",
                feature_gates=",".join(sorted(missing)),
                lost=described(missing),
                hint="the API server drops these fields: turn the gates on (kube-apiserver, "
                "kube-scheduler, kube-controller-manager, kubelet) and restart the agent",
            )
        else:
            log.info("cluster_features", missing="none")
        return self._features

    async def start(self) -> None:
        """Serve the plugin's sockets and keep the slices as wanted (re-published after a wipe)."""
        if self._task is None:
            self.publisher.hold_additions = True  # until the kubelet confirms the registration
            self._confirmed_by = None
            await self.plugin.start()
            self._task = asyncio.create_task(self.publisher.run(), name="resourceslices")
            self._follow = asyncio.create_task(self._follow_node(), name="dra-follow")
            if self._kubelet_socket is not None:
                self._kubelet_watch = asyncio.create_task(self._watch_kubelet(), name="dra-kubelet")

    async def stop(self) -> None:
        """Unregister and stop serving; the slices stay until `withdraw`."""
        for task in (self._task, self._follow, self._kubelet_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._follow = self._kubelet_watch = None
        if self.plugin.serving:
            await self.plugin.stop()

    async def leave(self, timeout_s: float = 5.0) -> None:
        """The agent is going: delete the pool, unless another instance of the driver serves the node,
        then stop. Until the next agent's registration nothing can be prepared here, and a pod placed
        on the pool meanwhile would wait for the kubelet's pod resync (a minute: a failed prepare is
        no sync error, k8s.io/kubernetes pkg/kubelet/kuberuntime/kuberuntime_manager.go SyncPod);
        unscheduled, it is placed as soon as the next agent publishes. A killed agent cannot do this:
        the kubelet deletes the pool 30 s after the driver is gone."""
        serving = await asyncio.to_thread(others_serving, self.plugin.paths)
        if serving:
            log.info("dra_pool_left_to_another_instance", registration=str(serving[0]))
        elif self._task is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    problem = await self.withdraw()
            except TimeoutError:
                problem = f"no answer within {timeout_s:g} s"
            if problem:
                log.warning("dra_pool_not_withdrawn", error=bounded(problem))
            else:
                log.info("dra_pool_withdrawn", why="the agent stops")
        await self.stop()

    async def publish(self, inventory: Inventory, node: NodeState) -> str:
        """Offer exactly `inventory` in the pool's slices; "" once the API server holds them."""
        self.inventory, self.node = inventory, node
        self.plugin.refresh()
        await self.features()  # said once, by name, whatever the config asks
        return await self._publish()

    async def _publish(self, *, fresh: bool = True) -> str:
        """Want the pool as `slices()` builds it now and sync it; with `fresh`, a withdrawal is
        planned from the pool as the API server holds it (see `_sync`)."""
        self.publisher.want(self.slices())
        return await self._sync(fresh=fresh)

    def slices(self) -> tuple[SliceSpec, ...]:
        """The pool as wanted now: the static devices, then the dynamic GPUs' counters and placements
        (ordered for the claims prepared here and the instances on the GPUs)."""
        static = build_slices(self.node_name, self.node, self.inventory, self.catalog)
        dynamic = self.inventory.dynamic
        if not dynamic:
            return static
        return pool(
            withdrawn_static(static, dynamic),
            partitionable_slices(
                self.node_name,
                self.node,
                dynamic,
                self.catalog,
                prepared=self._prepared_devices(),
                unhealthy=self._gpu_health().unhealthy_gpus if self._gpu_health is not None else (),
                held=self._held() | self._reclaiming,
            ),
        )

    def _prepared_devices(self) -> frozenset[str]:
        """The device names of the pool that the claims prepared here hold (the checkpoint)."""
        prepared = self.plugin.prepared()
        self._prepared = frozenset(
            d.device for c in prepared.claims for d in c.devices if d.pool == self.node_name
        )
        return self._prepared

    def room(self) -> tuple[GpuRoom, ...]:
        """Per dynamic GPU: the largest profile one more instance of which it can still hold, and the
        free compute that no placement can use (`sharing.dra.fragmentation`)."""
        return room(self.node, self.inventory.dynamic, self.catalog)

    async def settled(self) -> None:
        """Return once no scheduling cycle that read the pool before its last withdrawal can still be
        on its way to writing an allocation of a withdrawn device (`SCHEDULER_WINDOW_S`)."""
        left = self._withdrawn_at + SCHEDULER_WINDOW_S - asyncio.get_running_loop().time()
        if left > 0:
            log.info("pool_withdrawal_settling", seconds=round(left, 2))
            await asyncio.sleep(left)  # the scheduler says nothing that ends this window sooner

    def _held(self) -> frozenset[Held]:
        """The instances the prepared claims hold; every instance while that cannot be told (the
        checkpoint unreadable, or a prepare under way), so none is offered as foreign meanwhile."""
        prepared = self.plugin.prepared()
        if prepared.unknown:
            return frozenset((g.uuid, gi.profile, gi.start) for g in self.node.gpus for gi in g.instances)
        return held(prepared.claims)

    def foreign(self) -> tuple[Foreign, ...]:
        """The MIG instances on the dynamic GPUs that the agent did not make (for `sharing status`);
        none while the checkpoint cannot tell."""
        prepared = self.plugin.prepared()
        if prepared.unknown:
            return ()
        return foreign_instances(self.node, self.inventory.dynamic, prepared.claims, self.catalog)

    def recorded(self) -> tuple[PreparedClaim, ...]:
        """The claims prepared on this node as the plugin's checkpoint records them, one being prepared
        too (for `sharing status`: the instances made for them are the dynamic GPUs' slices)."""
        return self.plugin.prepared().claims

    def _registration(self, registered: bool) -> None:
        """The kubelet's word on a registration: devices are added to the pool once it uses the plugin."""
        if registered:
            if self._kubelet_socket is not None:
                self._confirmed_by = socket_identity(self._kubelet_socket)
            if self.publisher.hold_additions:
                log.info("dra_pool_additions_released", why="the kubelet confirmed the plugin's registration")
            self.publisher.release()
        else:
            self.publisher.hold_additions = True

    async def _watch_kubelet(self) -> None:
        """Hold additions again when the kubelet restarts, until it confirms the registration again."""
        assert self._kubelet_socket is not None
        path = str(self._kubelet_socket)
        seen = socket_identity(path)
        while True:
            await asyncio.sleep(self._kubelet_poll_s)
            now = socket_identity(path)
            if now == seen:
                continue
            seen = now
            if now != self._confirmed_by:  # a new kubelet, which has not confirmed the registration yet
                log.info("dra_pool_additions_held", why="the kubelet restarted; waiting for its registration")
                self.publisher.hold_additions = True
                self.plugin.registration = Registration()

    async def follow_node(self) -> bool:
        """While the node has a dynamic GPU: re-publish the slices when the claims prepared here or the
        instances on the dynamic GPUs changed since the slices were built, and reclaim idle foreign
        instances where the rule says so; True when it re-published."""
        if not self.inventory.dynamic:
            return False
        made = await self._observe_instances()
        reclaim = self.inventory.reclaim & self.inventory.dynamic
        # Only while the plugin serves: its checkpoint is loaded, so what claims hold is known.
        if reclaim and self.plugin.serving and self.node_claims is not None and await self._reclaim(reclaim):
            made = await self._observe_instances() or made
        prepared = self._prepared
        if not made and self._prepared_devices() == prepared:
            return False
        log.info("pool_order_changed", prepared=len(self._prepared), instances_changed=made)
        # No safety rests on this write (the scheduler's counters keep an allocated device's
        # overlaps out): it is planned from the pool as last written, one request.
        await self._publish(fresh=False)
        return True

    async def _reclaim(self, gpus: frozenset[str]) -> bool:
        """`reclaimForeign: idle`, as any change is made: the devices of the idle foreign instances no
        claim prepared here holds are withdrawn and confirmed, the claims of the node's pods read
        (after `settled`), and the instances none of them is allocated destroyed (journaled steps,
        `sharing.dra.instances.reclaim`); True when one was."""
        prepared = self.plugin.prepared()
        if prepared.unknown:
            return False
        found = reclaimable(self.node, gpus, prepared.claims, (), self.catalog)
        if not found:
            return False
        self._reclaiming = frozenset((f.gpu.uuid, f.instance.profile, f.instance.start) for f in found)
        try:
            if await self._publish():
                return False  # not withdrawn: nothing is destroyed
            await self.settled()
            assert self.node_claims is not None
            try:
                allocated = await self.node_claims()
            except SharingError as err:
                log.warning("foreign_instances_not_reclaimed", error=bounded(str(err)))
                return False
            names = tuple(d for c in allocated for d in c.devices)
            return bool(await self.plugin.preparer.reclaim_foreign(gpus, names, self.catalog))
        finally:
            self._reclaiming = frozenset()

    async def _observe_instances(self) -> bool:
        """Read the GPUs again (prepare makes and unprepare destroys instances without the rollout
        observing them); True when the instances of a dynamic GPU differ from the node as last
        known, which is then updated. A GPU that cannot be read keeps its last known state."""
        if self._backend is None:
            return False
        try:
            observed = await self._backend.observe()
        except SharingError as err:
            log.warning("gpus_not_read", error=bounded(str(err)))
            return False

        def placements(node: NodeState) -> dict[str, list[tuple[str, int, bool]]]:
            return {
                g.uuid: sorted((gi.profile, gi.start, bool(gi.compute_instances)) for gi in g.instances)
                for g in node.gpus
                if g.uuid in self.inventory.dynamic
            }

        fresh = {g.uuid: g for g in observed.gpus if g.uuid in self.inventory.dynamic}
        known = {u: p for u, p in placements(self.node).items() if u in fresh}
        if placements(observed) == known:
            return False
        self.node = replace(self.node, gpus=tuple(fresh.get(g.uuid, g) for g in self.node.gpus))
        return True

    async def _follow_node(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.resync_s)
            self._wake.clear()
            try:
                await self.follow_node()
            except Exception as err:  # never end silently: the dynamic GPUs' order would go stale
                log.error("pool_not_followed", error=f"{type(err).__name__}: {bounded(str(err))}")

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

    async def _sync(self, *, fresh: bool = True) -> str:
        wanted = frozenset(d.name for s in self.publisher.wanted for d in s.devices)
        # A withdrawal that a change's safety rests on (the rollout's, a reclaim's, the agent's
        # stop) is made against the pool as the API server holds it now: a slice another writer
        # made meanwhile (an agent beside this one in an upgrade) is read too. A new order after a
        # prepare or an unprepare is planned from the pool as last written: one write, and a 409 or
        # 404 if anyone changed it since, upon which it is read.
        withdrawing = bool(self._published - wanted)
        try:
            await asyncio.to_thread(functools.partial(self.publisher.sync, again=fresh and withdrawing))
        except SharingError as err:
            why = f"the ResourceSlices of node {self.node_name} could not be written: {bounded(str(err))}"
            log.warning("resourceslices_not_synced", error=why)
            self._problem = why
            return why
        self._problem = ""
        if self._published - wanted:  # devices went: a scheduling cycle may still hold them
            self._withdrawn_at = asyncio.get_running_loop().time()
        self._published = wanted
        return ""
