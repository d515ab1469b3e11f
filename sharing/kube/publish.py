"""What the agent writes on its Node: labels, its annotations, the state label, and Events.

Labels follow what is advertised (GPU-feature-discovery names, `sharing.labels`); two annotations
say what is in effect (`nvidia.com/gpu-sharing.config`: the config last applied, kept after a
failure; `nvidia.com/gpu-sharing.layout`: one line per GPU); one Event per outcome that is news (a
new reason or subject, or hardware changed), never the same one on every resync. Only what changed
is patched, in one request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol

import structlog

from sharing.config import ConfigSet, Failed, Problem, Selected, Selection, SharingConfig
from sharing.devices import Inventory
from sharing.errors import SharingError
from sharing.kube.api import KubeClient, NodeObject
from sharing.kube.events import EventOutbox
from sharing.kube.watch import Watched
from sharing.labels import STATE_LABEL, ConfigState, label_patch, layout, node_labels, refused
from sharing.mig import Catalog
from sharing.model import NodeState
from sharing.text import bounded, summary

log = structlog.get_logger(__name__)

CONFIG_ANNOTATION = "nvidia.com/gpu-sharing.config"
LAYOUT_ANNOTATION = "nvidia.com/gpu-sharing.layout"
LAYOUT_LIMIT = 8000
EVENT_LIMIT = 1000
"""What an Event message of this agent holds at most (as the rollout's verdicts)."""
OUTCOMES = {
    "ConfigApplied": "applied",
    "ConfigApplyFailed": "failed",
    "ConfigApplyBlocked": "blocked",
    "ConfigRejected": "rejected",
    "ConfigInvalid": "rejected",
    "JournalCorrupt": "failed",
    "JournalUnusable": "failed",
}


class Verdict(Protocol):
    """What the Node is told of a reconcile's outcome (`sharing.rollout.Verdict` is one)."""

    @property
    def state(self) -> ConfigState | None: ...
    @property
    def reason(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def subject(self) -> str:
        """What the Event is about: the same reason and subject again is not news."""

    @property
    def changed(self) -> bool:
        """Hardware was changed: always news."""


class NodePublisher:
    """Keeps the Node's labels, annotations and state current, and records its Events."""

    def __init__(self, kube: KubeClient, node: Watched[NodeObject], catalog: Catalog) -> None:
        self.kube = kube
        self.node = node
        self.catalog = catalog
        self.events = EventOutbox(kube, lambda: self.node.current)
        """Events about the Node; the agent runs its `run` to send those an outage held back."""
        self.state: ConfigState | None = None
        self.last_change: dict[str, str] = {}
        self._reported: tuple[str, str] | None = None
        self._disagreement: tuple[str, str] | None = None
        self._refused: dict[str, str] = {}
        self._invalid: tuple[str, ...] = ()
        self._warned: tuple[str | None, tuple[Problem, ...]] = (None, ())

    async def publish(
        self,
        observed: NodeState,
        config: SharingConfig | None,
        inventory: Inventory,
        verdict: Verdict,
        *,
        good: SharingConfig | None,
        in_effect: Mapping[str, str | None],
    ) -> str | None:
        """Labels and annotations for what is advertised; the verdict's Event when it is news.

        Returns the outcome (`applied`, `failed`, ...) of the Event recorded, None when there was none.
        """
        if verdict.state is not None:
            self.state = verdict.state
        node = self.node.current
        if node is None:
            return None
        desired = node_labels(observed, config, inventory, self.state, self.catalog)
        if (bad := refused(desired)) and bad != self._refused:
            log.warning("labels_left_out", reason="not valid label values", labels=bad)
        self._refused = bad
        patch = label_patch(node.labels, desired)
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
            return None
        if not verdict.changed and (verdict.reason, verdict.subject) == self._reported:
            return None
        kind = "Warning" if verdict.state is ConfigState.FAILED else "Normal"
        outcome = OUTCOMES.get(verdict.reason, verdict.reason)
        (log.warning if kind == "Warning" else log.info)(
            f"config_{outcome}", message=bounded(verdict.message)
        )
        await self.event(kind, verdict.reason, verdict.message)
        self._reported = (verdict.reason, verdict.subject)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.last_change = {"time": now, "reason": verdict.reason, "message": verdict.message}
        return outcome

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

    async def invalid_configs(
        self, configs: ConfigSet, selection: Selection, quiet: frozenset[str] = frozenset()
    ) -> None:
        """Keys with errors that this node does not select, each with its first error, less those in
        `quiet`: said once per change (the selected one gets ConfigRejected); the node goes on with
        its own config."""
        selected = selection.name if isinstance(selection, Failed) else None
        if isinstance(selection, Selected):
            selected = selection.config.name
        skip = quiet | {selected}
        first = {p.config: str(p) for p in reversed(configs.errors) if p.config not in skip}
        shown = tuple(first[name] for name in configs.invalid if name in first)
        if shown == self._invalid:
            return
        self._invalid = shown
        if shown:
            message = "ConfigMap keys with errors, not selected by this node: " + "; ".join(shown)
            log.warning("config_invalid", message=bounded(message))
            await self.event("Warning", "ConfigInvalid", bounded(message, 1000))

    async def config_warnings(self, name: str | None, warnings: Sequence[Problem]) -> None:
        """The warnings of the config the node selects (`name`; those of the ConfigMap as a whole
        included) as one Event, said once per change: as many as fit in an Event's ~1,000 characters,
        then how many more; `sharing status` and the agent's log (`config_warnings`) have them all."""
        if (name, tuple(warnings)) == self._warned:
            return
        self._warned = (name, tuple(warnings))
        if not warnings or name is None:
            return
        shown = [f"{p.path}: {p.message}" if p.path else p.message for p in warnings]
        head = f"config {name!r} has {len(warnings)} warning{'s' if len(warnings) > 1 else ''}: "
        tail = " (every one in `sharing status` and the agent's log)"
        body = summary(shown, EVENT_LIMIT - len(head) - len(tail), unit="more")
        await self.event("Warning", "ConfigWarnings", head + body + tail)

    async def event(self, kind: str, reason: str, message: str) -> None:
        """Record an Event about the Node, now or once the API server answers (`sharing.kube.events`)."""
        await self.events.record(kind, reason, message)
