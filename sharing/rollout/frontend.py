"""Switching a node between the device plugins and DRA: a change like any other.

A node's GPUs are served by one front-end, never both (`sharing.config.frontend`). Before the other
one starts, the one in service is withdrawn and confirmed free:
- device plugins: every device withdrawn from ListAndWatch, the kubelet's GetAllocatableResources
  confirmed to offer none of them (as a rollout confirms a withdrawal), and no pod left holding one
  (PodResources List; fail closed when it cannot be read or believed);
- DRA: the node's ResourceSlices deleted, no claim left with devices of our pool allocated (the API
  server's ResourceClaims) and none left prepared on the node (the plugin's checkpoint).
Until then nothing new is offered through either, and the verdict names the pods or claims that
hold the switch back; it is looked at again as soon as they are free. The front-end in service is
remembered beside the journal, so a restarted agent serves through the same one before it can ask
the API server which one its node wants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

import structlog

from sharing.config import Frontend
from sharing.devices import Inventory
from sharing.dra.fragmentation import Fragmented
from sharing.kubelet import Holders, device_of
from sharing.labels import ConfigState
from sharing.model import ClaimHold, NodeState
from sharing.rollout.verdict import Retry, Verdict
from sharing.text import bounded, listed

log = structlog.get_logger(__name__)


class DraFrontend(Protocol):
    """The DRA front-end (`sharing.dra`): the kubelet plugin and the publisher of the node's slices."""

    event: Callable[[str, str, str], Awaitable[None]] | None
    """Where it records Events on the Node ((type, reason, message)); set by the agent."""

    async def start(self) -> None:
        """Serve the DRA and registration sockets; publish once an inventory is given."""
        ...

    async def stop(self) -> None:
        """Stop serving (the slices stay until `withdraw`)."""
        ...

    async def publish(self, inventory: Inventory, node: NodeState) -> str:
        """Make the node's ResourceSlices offer exactly `inventory`; "" once written, else why not."""
        ...

    async def withdraw(self) -> str:
        """Delete the node's ResourceSlices; "" once gone, else why not."""
        ...

    def health(self) -> tuple[bool, str]:
        """(its servers run, why it is not ready: not registered, slices not written; or "")."""
        ...

    @property
    def fragmented(self) -> Sequence[Fragmented]:
        """Pending claims whose MIG profile fits a dynamic GPU's free memory and compute but no placement."""
        ...

    async def prepared(self) -> tuple[tuple[ClaimHold, ...], str]:
        """The claims prepared on this node and not yet unprepared, with their devices; why that
        cannot be told, or ""."""
        ...


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
