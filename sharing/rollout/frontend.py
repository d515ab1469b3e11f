"""The DRA front-end as the rollout and the agent drive it (`sharing.dra.frontend.DraFrontEnd` is the one).

The rollout publishes the node's inventory through it and reads the claims it has prepared as holders;
the switch between front-ends (`sharing.rollout.switch`) starts, stops and withdraws it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from sharing.devices import Inventory
from sharing.dra.foreign import Foreign
from sharing.dra.fragmentation import GpuRoom
from sharing.kube.features import ClusterFeatures
from sharing.model import ClaimAllocation, ClaimHold, NodeState
from sharing.store import PreparedClaim


class DraFrontend(Protocol):
    """The DRA front-end (`sharing.dra`): the kubelet plugin and the publisher of the node's slices."""

    node_claims: Callable[[], Awaitable[tuple[ClaimAllocation, ...]]] | None
    """Where it asks which claims hold devices of the pool (`sharing.kube.podclaims`); set by the agent."""

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

    async def settled(self) -> None:
        """Return once no scheduling cycle that read the pool before its last withdrawal can still
        write an allocation of a withdrawn device."""
        ...

    def room(self) -> Sequence[GpuRoom]:
        """Per dynamic GPU: the largest profile it can still take and its stranded compute."""
        ...

    def foreign(self) -> Sequence[Foreign]:
        """The MIG instances on the dynamic GPUs that the agent did not make."""
        ...

    def recorded(self) -> Sequence[PreparedClaim]:
        """The claims prepared on this node as the plugin's checkpoint records them (for `sharing
        status`)."""
        ...

    async def prepared(self) -> tuple[tuple[ClaimHold, ...], str]:
        """The claims prepared on this node and not yet unprepared, with their devices; why that
        cannot be told, or ""."""
        ...
