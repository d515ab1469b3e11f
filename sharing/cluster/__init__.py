"""The Kubernetes side of the agent, over the client `sharing.kube` (adapter).

`sources` watches the two ConfigMaps and parses them into named configs (remembering the last one
applied, `sharing.store`); `publish` writes the Node's labels, annotations and state label and records
its Events (the label values themselves are computed by the pure `sharing.labels`).
"""

from sharing.cluster.publish import NodePublisher
from sharing.cluster.sources import ConfigSources

__all__ = ["ConfigSources", "NodePublisher"]
