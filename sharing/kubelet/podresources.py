"""A client of the kubelet's PodResources API: which pods hold which device IDs, and what is allocatable.

The agent uses it to mark devices busy before planning, so it never destroys an instance a pod
uses, to name the pods that block a change, and to confirm that the kubelet has taken devices
about to be destroyed out of what it hands out. The kubelet sends one entry per device and NUMA
node, so answers are aggregated.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc

from sharing.errors import PluginError
from sharing.kubelet.api import podresources_v1_pb2 as api
from sharing.kubelet.api import podresources_v1_pb2_grpc as api_grpc
from sharing.model import Holding, Listing
from sharing.store.files import read_capped
from sharing.text import bounded

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
CHECKPOINT = "kubelet_internal_checkpoint"
"""The device manager's record of its allocations, in the device-plugin directory."""
CHECKPOINT_LIMIT = 64 << 20


def devices_by_resource(entries: Iterable[api.ContainerDevices]) -> dict[str, frozenset[str]]:
    """{resource: device IDs} from ContainerDevices entries, de-duplicated."""
    found: dict[str, set[str]] = {}
    for entry in entries:
        found.setdefault(entry.resource_name, set()).update(entry.device_ids)
    return {name: frozenset(ids) for name, ids in found.items()}


def recorded_allocations(plugin_dir: Path) -> tuple[Holding, ...]:
    """The allocations the kubelet's device manager recorded in its checkpoint, () when there is none.

    The device manager writes it after every allocation and device update and restores from it at
    start, before PodResources knows any pod (k8s.io/kubernetes v1.36,
    pkg/kubelet/cm/devicemanager/manager.go, `allocateContainerResources` -> `writeCheckpoint`,
    `Start` -> `readCheckpoint`; the format is checkpoint/checkpoint.go, `checkpointData`). It names
    pods by UID only, and keeps a pod that has gone until the next write: only the forms held count
    (the pod is `uid <UID>`). PluginError when it cannot be read.
    """
    path = plugin_dir / CHECKPOINT
    try:
        raw = read_capped(path, CHECKPOINT_LIMIT)
        if raw is None:
            return ()
        if len(raw) > CHECKPOINT_LIMIT:
            raise ValueError(f"larger than {CHECKPOINT_LIMIT >> 20} MiB")
        entries = json.loads(raw)["Data"]["PodDeviceEntries"] or ()
        return tuple(
            Holding(
                "",
                f"uid {e['PodUID']}",
                str(e["ContainerName"]),
                str(e["ResourceName"]),
                frozenset(str(i) for ids in (e["DeviceIDs"] or {}).values() for i in ids),
            )
            for e in entries
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise PluginError(f"the kubelet's checkpoint {path} cannot be read: {bounded(str(err))}") from err


class PodResourcesClient:
    """Asks the kubelet's PodResources v1 service; every call has a deadline."""

    def __init__(self, socket: Path = DEFAULT_SOCKET, timeout: float = 5.0) -> None:
        self.socket = socket
        self.timeout = timeout

    async def in_use(self) -> dict[str, frozenset[str]]:
        """{resource: device IDs held by the containers of active pods}."""
        found: dict[str, set[str]] = {}
        for holding in await self.holdings():
            found.setdefault(holding.resource, set()).update(holding.device_ids)
        return {name: frozenset(ids) for name, ids in found.items()}

    async def holdings(self) -> tuple[Holding, ...]:
        """Every container of an active pod that holds devices, one entry per resource."""
        return (await self.listing()).holdings

    async def listing(self) -> Listing:
        """Every pod List names (with devices or not), and its containers' devices per resource."""
        async with self._stub("List") as stub:
            response: api.ListPodResourcesResponse = await stub.List(
                api.ListPodResourcesRequest(), timeout=self.timeout
            )
        return Listing(
            frozenset(f"{pod.namespace}/{pod.name}" for pod in response.pod_resources),
            tuple(
                Holding(pod.namespace, pod.name, container.name, resource, ids)
                for pod in response.pod_resources
                for container in pod.containers
                for resource, ids in devices_by_resource(container.devices).items()
            ),
        )

    async def allocatable(self) -> dict[str, frozenset[str]]:
        """{resource: healthy device IDs the kubelet can hand out}."""
        async with self._stub("GetAllocatableResources") as stub:
            response: api.AllocatableResourcesResponse = await stub.GetAllocatableResources(
                api.AllocatableResourcesRequest(), timeout=self.timeout
            )
        return devices_by_resource(response.devices)

    @contextlib.asynccontextmanager
    async def _stub(self, method: str) -> AsyncIterator[Any]:
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
                yield api_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
        except grpc.aio.AioRpcError as err:
            raise PluginError(
                f"PodResources {method} on {self.socket} failed: {err.code().name}: {err.details()}"
                " (is the kubelet running and its pod-resources socket mounted?)"
            ) from err
