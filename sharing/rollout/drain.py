"""Drain mode (off by default): evict the pods that block a change, apply it, and let pods back in.

When a change waits for devices pods hold, the agent cordons its Node (so nothing new lands on
it), asks the Eviction API to evict exactly the pods that hold the blocking devices (so
PodDisruptionBudgets hold: a refused eviction is tried again at every re-check of the blocked
change, as `kubectl drain` retries every few seconds), and uncordons the Node as soon as the change
no longer waits: applied, failed, rejected, or no config selected any more. It only ever uncordons a
cordon it made itself, recorded in the annotation `nvidia.com/gpu-sharing.cordoned`; the Node
remembers it, so an agent restarted mid-drain (or restarted with drain mode turned off) undoes it at
its first reconcile that does not wait. The extra permissions (pods/eviction, a Node's
spec.unschedulable) are granted only when the chart's `drain.enabled` is set (the admission policy
still lets the agent undo its own cordon).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from sharing.errors import SharingError
from sharing.kube import KubeClient, NodeObject, Watched
from sharing.kubelet import Holders
from sharing.labels import ConfigState
from sharing.rollout.verdict import Retry, Verdict
from sharing.text import bounded, listed

log = structlog.get_logger(__name__)
CORDONED = "nvidia.com/gpu-sharing.cordoned"

EventSink = Callable[[str, str, str], Awaitable[None]]


class Drainer:
    """Cordons, evicts blockers, uncordons; does nothing unless enabled."""

    def __init__(
        self, kube: KubeClient, node: Watched[NodeObject], event: EventSink, *, enabled: bool
    ) -> None:
        self.kube = kube
        self.node = node
        self.event = event
        self.enabled = enabled
        self._evicted: set[str] = set()
        self._said = ""
        self.refused: tuple[str, ...] = ()
        """Pods whose eviction a PodDisruptionBudget refused at the last try: the agent tries again
        at each re-check (a budget changes without anything the agent watches changing)."""

    async def after(self, verdict: Verdict, holders: Callable[[], Awaitable[Holders]]) -> None:
        """Act on a reconcile's verdict: drain for a blocked change, release once it is through."""
        node = self.node.current
        if node is None:
            return
        self.refused = ()
        if verdict.retry is Retry.BLOCKED and self.enabled:
            await self._drain(node, verdict, await holders())
        elif node.annotations.get(CORDONED) == "true":  # whatever the outcome: the drain is over
            await self._release(node, verdict)

    async def _drain(self, node: NodeObject, verdict: Verdict, holders: Holders) -> None:
        if holders.unknown:
            return  # who to evict cannot be told: evict nobody
        pods = holders.pods_holding(verdict.blockers)
        if not pods:
            return
        try:
            if not node.unschedulable:
                await asyncio.to_thread(self.kube.patch_node_labels, node.name, {}, {CORDONED: "true"})
                self.node.current = await asyncio.to_thread(self.kube.set_unschedulable, node.name, True)
                log.info("node_cordoned", reason="drain mode: a change waits for pods")
            refused = []
            for pod in pods:
                namespace, _, name = pod.partition("/")
                if not await asyncio.to_thread(self.kube.evict, namespace, name):
                    refused.append(pod)
                elif pod not in self._evicted:
                    self._evicted.add(pod)
                    log.info("pod_evicted", pod=pod)
        except SharingError as err:
            log.warning("drain_failed", error=bounded(str(err)))
            await self.event("Warning", "DrainFailed", f"drain mode could not evict the blocking pods: {err}")
            return
        self.refused = tuple(refused)
        evicting = [p for p in pods if p not in refused]
        message = "drain mode: node cordoned"
        if evicting:
            message += f"; evicting {listed(evicting)}"
        if refused:
            message += f"; a PodDisruptionBudget refuses evicting {listed(refused)} for now (retried)"
        if message != self._said:  # said once per situation, not on every re-check
            self._said = message
            await self.event("Normal" if not refused else "Warning", "Draining", message)

    async def _release(self, node: NodeObject, verdict: Verdict) -> None:
        try:
            if node.unschedulable:
                self.node.current = await asyncio.to_thread(self.kube.set_unschedulable, node.name, False)
            self.node.current = await asyncio.to_thread(
                self.kube.patch_node_labels, node.name, {}, {CORDONED: None}
            )
        except SharingError as err:
            log.warning("uncordon_failed", error=bounded(str(err)))
            return
        self._evicted.clear()
        self._said = ""
        if verdict.state is ConfigState.SUCCESS:
            outcome = "the change is applied"
        elif verdict.retry is Retry.BLOCKED:
            outcome = "drain mode is off"
        elif verdict.state is None:
            outcome = "no config is selected any more"
        else:
            outcome = f"the change did not go through ({verdict.reason})"
        log.info("node_uncordoned", outcome=outcome)
        await self.event("Normal", "Drained", f"drain mode: {outcome}; node uncordoned")
