"""Who holds which device: the kubelet's PodResources, the plugins' own recent Allocates, and NVML.

A device is held when a pod's container has it (PodResources), when a plugin handed it out a moment
ago and the kubelet may not list it yet, or when processes run on it (NVML, part of the
observation). When PodResources cannot be read, nobody can tell which devices pods hold: every
device on the node then counts as held (fail closed), so nothing is destroyed until it can be read.

A readable PodResources is not yet a complete one. Its List names the pods the kubelet's pod
manager knows, each with the devices its device manager records (k8s.io/kubernetes v1.36,
pkg/kubelet/apis/podresources/server_v1.go, `List`: `GetActivePods`/`GetPods`, then `GetDevices`
per container). A starting kubelet serves PodResources beside its sync loop, not after it
(cmd/kubelet/app/server.go, `startKubelet`: `go k.Run(...)`, `go k.ListenAndServePodResources(...)`),
and its pod manager learns the pods only as that loop receives them from the API server
(pkg/kubelet/kubelet.go, `syncLoop` -> `HandlePodAdditions` -> `podManager.AddPod`), so for a while
(longer when the API server is out of reach) List is short. A pod it does list has its devices:
the loop handles no pod before the device manager has started (`syncLoop` skips pod sync until
`updateRuntimeUp` ran `initializeRuntimeDependentModules`, which starts the container manager),
and the device manager's `Start` restores every allocation from its checkpoint first
(pkg/kubelet/cm/devicemanager/manager.go, `Start` -> `readCheckpoint`; `GetDevices` reads that
record). PodResources offers what the device manager has allocated no other way:
`GetAllocatableResources` is every healthy device, allocated or not (`GetAllocatableDevices`); its
checkpoint file has it, by pod UID, stale entries included (sharing.kubelet.podresources reads it
for the forms held while List cannot be believed). So List is trusted only when it names every
pod the API server has bound to this node that has not ended and requests an extended resource
(the pods that can hold a device); until then every device counts as held, and so it does when
the API server cannot be asked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol

from sharing.devices import REPLICA_SEPARATOR, Inventory, forms
from sharing.errors import SharingError
from sharing.model import BoundPod, ClaimHold, Holding, Listing, NodeState
from sharing.text import bounded, listed


@dataclass(frozen=True, slots=True)
class Holders:
    """What pods and recent allocations hold; `unknown` says why that cannot be told."""

    pods: tuple[Holding, ...] = ()
    recent: frozenset[str] = frozenset()
    """Device IDs a plugin handed out lately (maybe not in PodResources yet)."""
    unknown: str = ""
    """Why PodResources could not be read; non-empty means every device counts as held."""
    claims: tuple[ClaimHold, ...] = ()
    """ResourceClaims with devices of our DRA pool allocated (prepared or not): they hold them too."""

    def busy_uuids(self, node: NodeState) -> frozenset[str]:
        """UUIDs of the GPUs and MIG devices to treat as in use (replica IDs reduced to their device)."""
        if self.unknown:
            return frozenset(
                {g.uuid for g in node.gpus} | {ci.uuid for g in node.gpus for _, ci in g.mig_devices}
            )
        ids = {i for h in self.pods for i in h.device_ids} | self.recent
        return frozenset(device_of(i) for i in ids) | {u for c in self.claims for u in c.uuids}

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
        """`namespace/pod` of every pod holding one of these devices (or one of their replicas), then
        `claim namespace/name (pod ...)` of every ResourceClaim allocated one of them."""
        wanted = frozenset(uuids)
        pods = sorted(
            {f"{h.namespace}/{h.pod}" for h in self.pods if any(device_of(i) in wanted for i in h.device_ids)}
        )
        claims = sorted({c.describe() for c in self.claims if c.uuids & wanted})
        return (*pods, *claims)


class HoldingsSource(Protocol):
    """The kubelet's PodResources (sharing.kubelet.podresources.PodResourcesClient)."""

    async def listing(self) -> Listing:
        """Every pod List names, and each container of theirs that holds devices."""
        ...


BoundPods = Callable[[], Awaitable[tuple[BoundPod, ...]]]
"""The API server's pods bound to this node that have not ended (sharing.kube's list_node_pods)."""


async def read_holders(
    client: HoldingsSource | None,
    recent: Callable[[], frozenset[str]] = frozenset,
    bound: BoundPods | None = None,
) -> Holders:
    """Ask the API server (`bound`), the kubelet, then the plugins; a client of None means "no
    kubelet on this node", a `bound` of None "do not check List against the API server".

    The API server is asked first: a pod bound after that and listed by the kubelet is one more in
    List, never one missing. `recent` is read after PodResources answered: an Allocate that returned
    before the kubelet listed its pod is then in one answer or the other.
    """
    if client is None:
        return Holders(recent=recent())
    pods: tuple[BoundPod, ...] = ()
    problem = ""
    if bound is not None:
        try:
            pods = await bound()
        except SharingError as err:
            problem = f"which pods are bound to this node cannot be read from the API server: {err}"
    try:
        listing = await client.listing()
    except SharingError as err:
        return Holders(recent=recent(), unknown=bounded(f"the kubelet's PodResources cannot be read: {err}"))
    holders = Holders(listing.holdings, recent())
    missing = unlisted(pods, listing)
    if missing and not problem:
        problem = (
            f"the kubelet's PodResources does not list pods {listed(missing)}, which the API server has"
            " bound to this node"
            " (a kubelet that is starting answers before it has learned its pods)"
        )
    return replace(holders, unknown=bounded(problem)) if problem else holders


def unlisted(bound: Collection[BoundPod], listing: Listing) -> tuple[str, ...]:
    """`namespace/name` of the pods bound here that can hold devices and that List does not name.

    A pod can hold a device only if it requests an extended resource (a name with a domain, as
    device plugins' are; cpu, memory, hugepages-* and the like have none).
    """
    return tuple(
        sorted(
            name
            for pod in bound
            if any("/" in r for r in pod.resources)
            and (name := f"{pod.namespace}/{pod.name}") not in listing.pods
        )
    )


def device_of(device_id: str) -> str:
    """The GPU or MIG device UUID of a device ID (a replica `X::n` is device `X`)."""
    return device_id.partition(REPLICA_SEPARATOR)[0]
