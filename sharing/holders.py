"""Who holds which device: the kubelet's PodResources, the plugins' own recent Allocates, and NVML.

A device is held when a pod's container has it (PodResources), when a plugin handed it out a moment
ago and the kubelet may not list it yet, or when processes run on it (NVML, part of the
observation). When PodResources cannot be read, nobody can tell which devices pods hold: every
device on the node then counts as held (fail closed), so nothing is destroyed until it can be read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from sharing.errors import SharingError
from sharing.inventory import REPLICA_SEPARATOR, Inventory, forms
from sharing.model import Holding, NodeState
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
        return frozenset(device_of(i) for i in ids)

    def reoffered(self, inventory: Inventory) -> frozenset[str]:
        """UUIDs of held devices that `inventory` offers in a form the kubelet does not know is taken.

        A device held as `X` may be offered only as `X` under the same resource; one held as replica
        `X::n` only as replicas that still include `X::n` under that resource (more replicas add
        time-slicing, as the config asks). Anything else lets the kubelet give a second pod what the
        first one holds: `X::0` beside a pod that holds `X` for itself, `X` beside its replicas, or
        `X::n` again under a new name. A device offered in no form is not reoffered.
        """
        offered = forms(inventory)
        held = [(h.resource, i) for h in self.pods for i in h.device_ids] + [(None, i) for i in self.recent]
        found = set()
        for resource, device_id in held:
            uuid = device_of(device_id)
            entries = offered.get(uuid)
            if not entries:
                continue
            same = {i for name, i in entries if resource is None or name == resource}
            if REPLICA_SEPARATOR in device_id:
                ok = device_id in same and all(REPLICA_SEPARATOR in i for _, i in entries)
            else:
                ok = same == {device_id} == {i for _, i in entries} and len(entries) == 1
            if not ok:
                found.add(uuid)
        return frozenset(found)

    def pods_holding(self, uuids: Collection[str]) -> tuple[str, ...]:
        """`namespace/pod` of every pod holding one of these devices (or one of their replicas)."""
        wanted = frozenset(uuids)
        return tuple(
            sorted(
                {
                    f"{h.namespace}/{h.pod}"
                    for h in self.pods
                    if any(device_of(i) in wanted for i in h.device_ids)
                }
            )
        )


class HoldingsSource(Protocol):
    """The kubelet's PodResources (sharing.serve.podresources.PodResourcesClient)."""

    async def holdings(self) -> tuple[Holding, ...]:
        """Every container of an active pod that holds devices."""
        ...


async def read_holders(
    client: HoldingsSource | None, recent: Callable[[], frozenset[str]] = frozenset
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


def device_of(device_id: str) -> str:
    """The GPU or MIG device UUID of a device ID (a replica `X::n` is device `X`)."""
    return device_id.partition(REPLICA_SEPARATOR)[0]
