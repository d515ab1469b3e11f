"""What the agent writes on its Node: labels, its annotations, the state label, and Events.

Labels follow what is advertised (GPU-feature-discovery names, `sharing.labels`); two annotations
say what is in effect (`nvidia.com/gpu-sharing.config`: the config last applied, kept after a
failure; `nvidia.com/gpu-sharing.layout`: one line per GPU); one Event per outcome that is news (a
new reason or subject, or hardware changed), never the same one on every resync. Only what changed
is patched, in one request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime

import structlog

from sharing.catalog import Catalog
from sharing.errors import SharingError
from sharing.inventory import Inventory
from sharing.kube import KubeClient, NodeObject
from sharing.labels import STATE_LABEL, ConfigState, label_patch, node_labels
from sharing.metrics import Metrics
from sharing.model import NodeState
from sharing.spec import SharingConfig
from sharing.status import layout
from sharing.text import bounded
from sharing.verdict import Verdict
from sharing.watch import Watched

log = structlog.get_logger(__name__)

CONFIG_ANNOTATION = "nvidia.com/gpu-sharing.config"
LAYOUT_ANNOTATION = "nvidia.com/gpu-sharing.layout"
LAYOUT_LIMIT = 8000
OUTCOMES = {
    "ConfigApplied": "applied",
    "ConfigApplyFailed": "failed",
    "ConfigApplyBlocked": "blocked",
    "ConfigRejected": "rejected",
    "JournalCorrupt": "failed",
    "JournalUnusable": "failed",
}


class NodePublisher:
    """Keeps the Node's labels, annotations and state current, and records its Events."""

    def __init__(
        self, kube: KubeClient, node: Watched[NodeObject], catalog: Catalog, metrics: Metrics
    ) -> None:
        self.kube = kube
        self.node = node
        self.catalog = catalog
        self.metrics = metrics
        self.state: ConfigState | None = None
        self.last_change: dict[str, str] = {}
        self._reported: tuple[str, str] | None = None
        self._disagreement: tuple[str, str] | None = None

    async def publish(
        self,
        observed: NodeState,
        config: SharingConfig | None,
        inventory: Inventory,
        verdict: Verdict,
        *,
        good: SharingConfig | None,
        in_effect: Mapping[str, str | None],
    ) -> None:
        """Labels and annotations for what is advertised; the verdict's Event when it is news."""
        if verdict.state is not None:
            self.state = verdict.state
        node = self.node.current
        if node is None:
            return
        patch = label_patch(node.labels, node_labels(observed, config, inventory, self.state, self.catalog))
        notes = {
            CONFIG_ANNOTATION: good.name if good else None,
            LAYOUT_ANNOTATION: bounded(layout(observed, inventory, in_effect), LAYOUT_LIMIT) or None,
        }
        note_patch = {k: v for k, v in notes.items() if node.annotations.get(k) != v}
        if patch or note_patch:
            self.node.current = await asyncio.to_thread(
                self.kube.patch_node_labels, node.name, patch, note_patch
            )
            log.info("node_patched", labels=len(patch), annotations=len(note_patch))
        if not verdict.reason:
            return
        if not verdict.changed and (verdict.reason, verdict.subject) == self._reported:
            return
        kind = "Warning" if verdict.state is ConfigState.FAILED else "Normal"
        outcome = OUTCOMES.get(verdict.reason, verdict.reason)
        (log.warning if kind == "Warning" else log.info)(
            f"config_{outcome}", message=bounded(verdict.message)
        )
        self.metrics.changes.labels(outcome=outcome).inc()
        await self.event(kind, verdict.reason, verdict.message)
        self._reported = (verdict.reason, verdict.subject)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.last_change = {"time": now, "reason": verdict.reason, "message": verdict.message}

    async def set_state(self, state: ConfigState) -> None:
        """Set the state label at once (`pending` before hardware steps run)."""
        node = self.node.current
        if node is None or self.state is state:
            return
        self.state = state
        try:
            self.node.current = await asyncio.to_thread(
                self.kube.patch_node_labels, node.name, {STATE_LABEL: state.value}
            )
        except SharingError as err:
            log.warning("state_label_not_set", state=state.value, error=bounded(str(err)))

    async def labels_disagree(self, labels: Mapping[str, str], primary: str, fallback: str) -> None:
        """Both selection labels set and different: say once which one is used."""
        first, second = labels.get(primary, ""), labels.get(fallback, "")
        if not first or not second or first == second or (first, second) == self._disagreement:
            return
        self._disagreement = (first, second)
        await self.event(
            "Warning",
            "ConfigLabelsDisagree",
            f"{primary}={first} and {fallback}={second} name different configs: {first!r} is used "
            f"({primary} wins)",
        )

    async def event(self, kind: str, reason: str, message: str) -> None:
        """Record an Event about the Node (a failure to do so is logged, never raised)."""
        node = self.node.current
        if node is None:
            return
        try:
            await asyncio.to_thread(self.kube.create_node_event, node, kind, reason, message)
        except SharingError as err:
            log.warning("event_not_recorded", reason=reason, error=bounded(str(err)))
