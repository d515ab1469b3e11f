"""The Kubernetes side of the agent: its one door to the API server (`ApiClient`, over the official
`kubernetes` client, imported only when a client is made), the values it reads, and the watches
that turn changes of the Node and the ConfigMaps into reconcile triggers."""

from sharing.kube.api import (
    ConfigMapObject,
    GoneError,
    KubeClient,
    NodeObject,
    NotFoundError,
    RefusedByBudgetError,
    UnreachableError,
    WatchBrokenError,
    WatchEvent,
)
from sharing.kube.client import ApiClient
from sharing.kube.watch import Watched, watch_configmap, watch_node

__all__ = [
    "ApiClient",
    "ConfigMapObject",
    "GoneError",
    "KubeClient",
    "NodeObject",
    "NotFoundError",
    "RefusedByBudgetError",
    "UnreachableError",
    "WatchBrokenError",
    "WatchEvent",
    "Watched",
    "watch_configmap",
    "watch_node",
]
