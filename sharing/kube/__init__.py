"""The Kubernetes side of the agent: its one door to the API server (`ApiClient`, over the official
`kubernetes` client, imported only when a client is made), the values it reads, the watches that
turn changes of the Node and the ConfigMaps into reconcile triggers, the ConfigMaps parsed into
named configs (`sources`, remembering the last one applied in `sharing.store`), what the agent
writes on its Node (`publish`: labels, annotations, the state label, Events; the label values
themselves are computed by the pure `sharing.labels`), and the node's ResourceSlices for the DRA
front-end (`resourceslices`: the pool kept exactly as wanted)."""

from sharing.kube.api import (
    ConfigMapObject,
    ForbiddenError,
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
from sharing.kube.publish import NodePublisher
from sharing.kube.resourceslices import SlicePublisher
from sharing.kube.sources import ConfigSources
from sharing.kube.watch import Watched, watch_configmap, watch_node

__all__ = [
    "ApiClient",
    "ConfigMapObject",
    "ConfigSources",
    "ForbiddenError",
    "GoneError",
    "KubeClient",
    "NodeObject",
    "NodePublisher",
    "NotFoundError",
    "RefusedByBudgetError",
    "SlicePublisher",
    "UnreachableError",
    "WatchBrokenError",
    "WatchEvent",
    "Watched",
    "watch_configmap",
    "watch_node",
]
