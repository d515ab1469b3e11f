"""The DRA front-end as the rollout and the agent drive it (`sharing.dra.frontend.DraFrontEnd` is the one).

The rollout publishes the node's inventory through it and reads the claims it has prepared as holders;
the switch between front-ends (`sharing.rollout.switch`) starts, stops and withdraws it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from sharing.devices import Inventory
from sharing.dra.foreign import Foreign
from sharing.dra.fragmentation import Fragmented
from sharing.kube.features import ClusterFeatures
from sharing.model import ClaimHold, NodeState


class DraFrontend(Protocol):
    """The DRA front-end (`sharing.dra`): the kubelet plugin and the publisher of the node's slices."""

    event: Callable[[str, str, str], Awaitable[None]] | None
    """Where it records Events on the Node ((type, reason, message)); set by the agent."""

    async def features(self) -> ClusterFeatures:
        """The gates the cluster's API server has off among those the pool's fields need (asked once)."""
        ...

    async def start(self) -> None:
        """Serve the DRA and registration sockets; publish once an inventory is given."""
        ...

    async def stop(self) -> None:
        """Stop serving (the slices stay until `withdraw`)."""
        ...

    async def leave(self) -> None:
        """The agent is going: withdraw the slices unless another instance serves the node, then stop."""
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

    def foreign(self) -> Sequence[Foreign]:
        """The MIG instances on the dynamic GPUs that the agent did not make."""
        ...

    async def prepared(self) -> tuple[tuple[ClaimHold, ...], str]:
        """The claims prepared on this node and not yet unprepared, with their devices; why that
        cannot be told, or ""."""
        ...
