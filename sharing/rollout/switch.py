"""Switching a node between the device plugins and DRA: a change like any other.

A node's GPUs are served by one front-end, never both (`sharing.config.frontend`). Before the other
one starts, the one in service is withdrawn and confirmed free:
- device plugins: every device withdrawn from ListAndWatch, the kubelet's GetAllocatableResources
  confirmed to offer none of them (as a rollout confirms a withdrawal), no pod left holding one
  (PodResources List; fail closed when it cannot be read or believed), and the Node's
  `status.allocatable` on the API server showing none of the plugins' resources. The scheduler
  sends a pod asking by limits (`nvidia.com/mig-1g.5gb: 1`) down the device-plugin path while the
  Node's allocatable has the resource, and through DRA only where it is 0 and a DeviceClass names
  it (`filterExtendedResources` in pkg/scheduler/framework/plugins/dynamicresources/
  extendeddynamicresources.go, Kubernetes v1.37.2). The kubelet copies its devices into the Node
  on its status loop (`nodeStatusUpdateFrequency`, 10 s by default), well after PodResources says
  they are gone; a pool published before that gets pods bound the device-plugin way, which the
  kubelet then fails for good ("no healthy devices present": `devicesToAllocate` in
  pkg/kubelet/cm/devicemanager/manager.go, a refused pod is not retried);
- DRA: the node's ResourceSlices deleted, no claim left with devices of our pool allocated (the API
  server's ResourceClaims) and none left prepared on the node (the plugin's checkpoint).
Until then nothing new is offered through either, and the verdict names the pods or claims that
hold the switch back; it is looked at again as soon as they are free. The front-end in service is
remembered beside the journal, so a restarted agent serves through the same one before it can ask
the API server which one its node wants.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from sharing.config import Frontend, FrontendChoice
from sharing.deviceplugin import Fleet
from sharing.devices import Inventory
from sharing.kube import NodePublisher
from sharing.kube.api import NodeObject
from sharing.kube.watch import Watched
from sharing.kubelet import Holders, device_of
from sharing.labels import ConfigState
from sharing.model import NodeState
from sharing.rollout.frontend import DraFrontend
from sharing.rollout.rollout import Rollout
from sharing.rollout.verdict import Retry, Verdict
from sharing.text import bounded, listed

log = structlog.get_logger(__name__)

NODE_CONFIRM_TIMEOUT_S = 45.0
"""How long the Node on the API server gets to stop showing the withdrawn resources as allocatable:
four of the kubelet's default status loops (10 s) and the watch's delay."""


class Frontends:
    """The node's front-end in service, and the switch to the one the node asks for."""

    def __init__(
        self,
        *,
        fleet: Fleet,
        dra: DraFrontend | None,
        rollout: Rollout,
        node_out: NodePublisher,
        remembered_at: Path,
        node: Watched[NodeObject] | None = None,
    ) -> None:
        self.fleet = fleet
        self.node = node
        """This Node as the API server has it (None: not watched, nothing to confirm there)."""
        self.dra = dra
        self.rollout = rollout
        self.node_out = node_out
        self._file = remembered_at
        self.serving = remembered(remembered_at) or Frontend.DEVICE_PLUGIN
        """The front-end in service (as before a restart; device plugins for an agent that had no choice)."""
        self._said: tuple[str, str] | None = None

    async def start(self) -> None:
        """Serve through the front-end in service."""
        self.rollout.frontend = self.serving
        await self._start(self.serving)

    async def stop(self) -> None:
        """The agent is going: stop serving through the front-end in service (on DRA the pool goes
        too, unless another instance serves the node: `DraFrontend.leave`)."""
        if self.serving is Frontend.DRA and self.dra is not None:
            await self.dra.leave()
        else:
            await self._stop(self.serving)

    def health(self) -> tuple[bool, str]:
        """Whether the front-end in service runs, and why it is not ready ("": it is)."""
        if self.serving is Frontend.DEVICE_PLUGIN:
            waiting = [p.resource for p in self.fleet.status() if not p.registered]
            ready = self.fleet.ready
            return (
                self.fleet.alive,
                "" if ready else f"not registered with the kubelet: {', '.join(waiting) or 'pending'}",
            )
        if self.dra is None:
            return True, ""
        return self.dra.health()

    async def serve(self, choice: FrontendChoice, observed: NodeState) -> tuple[Verdict | None, str]:
        """Serve through the front-end the node asks for: (a verdict while a switch waits, said on the
        Node when it is news; why the node's choice is refused or "")."""
        refused = choice.error and f"{choice.error}; the node stays on the {self.serving.value} front-end"
        wanted = choice.frontend or self.serving
        if wanted is Frontend.DRA and self.dra is None:
            refused = (
                f"{choice.source} asks for the dra front-end, which this agent does not have; the node"
                f" stays on the {self.serving.value} front-end"
            )
            wanted = self.serving
        if wanted is self.serving:
            return None, refused
        waits = await self._switch(wanted, observed)
        if waits is not None:
            waits = await self._report(waits)
        return waits, refused

    async def _switch(self, to: Frontend, observed: NodeState) -> Verdict | None:
        """Withdraw the front-end in service and confirm it free, then start `to`; a verdict while not."""
        old = self.serving
        log.info("frontend_switching", to=to.value, frm=old.value)
        everything = frozenset(
            {g.uuid for g in observed.gpus} | {ci.uuid for g in observed.gpus for _, ci in g.mig_devices}
        )
        served = frozenset(p.resource for p in self.fleet.status()) if old is Frontend.DEVICE_PLUGIN else None
        if old is Frontend.DRA and self.dra is not None:
            problem = await self.dra.withdraw()  # the slices deleted, not only emptied
            self.rollout.advertised = Inventory()
        else:
            problem = await self.rollout.withdraw_all(everything)
        holders = await self.rollout.holders(node=observed)
        if problem or holders.unknown:
            return switch_waits(to, (), problem or holders.unknown)
        if old is Frontend.DEVICE_PLUGIN:
            held, uuids = device_plugin_holders(holders)
        else:
            held, uuids = claim_holders(holders)
        if held:
            # Prepared but no longer allocated has no device to watch: looked at again after a backoff.
            return switch_waits(to, held, blockers=uuids)
        if served:
            shown = await self._node_shows_none(served)
            if shown:
                return switch_waits(to, (), shown)
        await self._stop(old)
        self.serving = to
        self.rollout.frontend = to
        self.rollout.advertised = Inventory()
        await self._start(to)
        await remember(self._file, to)
        log.info("frontend_switched", to=to.value)
        await self.node_out.event(
            "Normal",
            "FrontendSwitched",
            f"the node's devices are now served through the {to.value} front-end",
        )
        self._said = None
        return None

    async def _node_shows_none(self, resources: frozenset[str]) -> str:
        """Wait until the Node on the API server shows none of these resources allocatable; "" then,
        else what it still shows."""
        if self.node is None:
            return ""
        if self.node.current is not None and (showing := allocatable(self.node.current, resources)):
            log.info("frontend_switch_waits_for_node", allocatable=showing)
        node = await self.node.until(lambda n: not allocatable(n, resources), NODE_CONFIRM_TIMEOUT_S)
        if node is not None:
            return ""
        left = allocatable(self.node.current, resources) if self.node.current is not None else {}
        shown = ", ".join(f"{r}: {n}" for r, n in sorted(left.items())) or "it cannot be read"
        return (
            f"the Node on the API server still shows them allocatable ({shown})"
            f" {NODE_CONFIRM_TIMEOUT_S:.0f} s after the kubelet stopped offering them (the kubelet copies"
            " them in on its status loop), and the scheduler would send pods asking for them by limits"
            " to the device plugins"
        )

    async def _start(self, frontend: Frontend) -> None:
        if frontend is Frontend.DRA and self.dra is not None:
            await self.dra.start()
        elif frontend is Frontend.DEVICE_PLUGIN:
            await self.fleet.start()

    async def _stop(self, frontend: Frontend) -> None:
        if frontend is Frontend.DRA and self.dra is not None:
            await self.dra.stop()
        elif frontend is Frontend.DEVICE_PLUGIN:
            await self.fleet.stop()

    async def _report(self, verdict: Verdict) -> Verdict:
        """The state label and, when it is news, the Event of a switch that waits."""
        await self.node_out.set_state(ConfigState.FAILED)
        said = (verdict.reason, verdict.subject)
        if said != self._said:
            self._said = said
            log.warning("frontend_switch_waits", message=bounded(verdict.message))
            await self.node_out.event("Warning", verdict.reason, verdict.message)
        return verdict


def remembered(path: Path) -> Frontend | None:
    """The front-end the agent served through before it restarted (None: not known)."""
    try:
        return Frontend(path.read_text().strip())
    except (OSError, ValueError):
        return None


async def remember(path: Path, frontend: Frontend) -> None:
    """Record the front-end in service (atomically; a failure is logged, the next switch retries)."""

    def write() -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(frontend.value + "\n")
        tmp.replace(path)

    try:
        await asyncio.to_thread(write)
    except OSError as err:
        log.warning("frontend_not_remembered", path=str(path), error=bounded(str(err)))


def allocatable(node: NodeObject, resources: frozenset[str]) -> dict[str, str]:
    """Which of `resources` the Node's `status.allocatable` shows as more than none."""
    return {r: q for r, q in node.allocatable.items() if r in resources and q.strip() not in ("", "0")}


def device_plugin_holders(holders: Holders) -> tuple[tuple[str, ...], frozenset[str]]:
    """`namespace/pod` of the pods that hold devices through the device plugins, and those devices."""
    held = [h for h in holders.pods if h.device_ids]
    pods = tuple(sorted({f"{h.namespace}/{h.pod}" for h in held}))
    return pods, frozenset(device_of(i) for h in held for i in h.device_ids)


def claim_holders(holders: Holders) -> tuple[tuple[str, ...], frozenset[str]]:
    """The claims that hold devices of our pool (allocated, or still prepared here), and those devices."""
    return (
        tuple(sorted({c.describe() for c in holders.claims})),
        frozenset(u for c in holders.claims for u in c.uuids),
    )


def switch_waits(
    to: Frontend, held_by: tuple[str, ...], why: str = "", blockers: frozenset[str] = frozenset()
) -> Verdict:
    """The verdict while a switch to `to` waits for the old front-end's devices to be free."""
    old = "device plugins" if to is Frontend.DRA else "DRA"
    who = why or (f"held by {listed(list(held_by))}" if held_by else "")
    message = (
        f"switching to the {to.value} front-end waits: the {old} still hand out devices ({who}); nothing"
        " new is offered meanwhile, and the switch finishes as soon as they are free (checked every few"
        " seconds)"
    )
    return Verdict(
        ConfigState.FAILED,
        "FrontendSwitchBlocked",
        bounded(message, 1000),
        f"{to.value}: {held_by}",
        retry=Retry.BLOCKED if blockers else Retry.BACKOFF,
        blockers=blockers,
    )
