"""Who holds which device: the kubelet's PodResources, the plugins' own recent Allocates, and NVML.

A device is held when a pod's container has it (PodResources), when a plugin handed it out a moment
ago and the kubelet may not list it yet, or when processes run on it (NVML, part of the
observation). When PodResources cannot be read, nobody can tell which devices pods hold: every
device on the node then counts as held (fail closed), so nothing is destroyed until it can be read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from sharing.errors import SharingError
from sharing.inventory import REPLICA_SEPARATOR
from sharing.model import NodeState
from sharing.serve.podresources import Holding, PodResourcesClient
from sharing.text import bounded


@dataclass(frozen=True, slots=True)
class Holders:
    """What pods and recent allocations hold; `unknown` says why that cannot be told."""

    pods: tuple[Holding, ...] = ()
    recent: frozenset[str] = frozenset()
    """Device IDs a plugin handed out lately (maybe not in PodResources yet)."""
    unknown: str = ""
    """Why PodResources could not be read; non-empty means every device counts as held."""

    def busy_uuids(self, node: NodeState) -> frozenset[str]:
        """UUIDs of the GPUs and MIG devices to treat as in use (replica IDs reduced to their device)."""
        if self.unknown:
            return frozenset(
                {g.uuid for g in node.gpus} | {ci.uuid for g in node.gpus for _, ci in g.mig_devices}
            )
        ids = {i for h in self.pods for i in h.device_ids} | self.recent
        return frozenset(_device(i) for i in ids)

    def pods_holding(self, uuids: Collection[str]) -> tuple[str, ...]:
        """`namespace/pod` of every pod holding one of these devices (or one of their replicas)."""
        wanted = frozenset(uuids)
        return tuple(
            sorted(
                {
                    f"{h.namespace}/{h.pod}"
                    for h in self.pods
                    if any(_device(i) in wanted for i in h.device_ids)
                }
            )
        )


async def read_holders(
    client: PodResourcesClient | None, recent: Callable[[], frozenset[str]] = frozenset
) -> Holders:
    """Ask the kubelet, then the plugins; a client of None means "no kubelet on this node".

    `recent` is read after PodResources answered: an Allocate that returned before the kubelet
    listed its pod is then in one answer or the other.
    """
    if client is None:
        return Holders(recent=recent())
    try:
        pods = await client.holdings()
    except SharingError as err:
        return Holders(recent=recent(), unknown=bounded(str(err)))
    return Holders(pods, recent())


def _device(device_id: str) -> str:
    return device_id.partition(REPLICA_SEPARATOR)[0]
