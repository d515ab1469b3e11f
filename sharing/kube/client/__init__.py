"""The Kubernetes API over the official `kubernetes` client: the agent's one door to the API server.

The agent needs little: its own Node (labels, watched), one ConfigMap (watched), label patches and
Events on the Node, and for the DRA front-end ResourceClaims and the node's ResourceSlices. The
calls block, so callers run them in threads (`sharing.kube.watch` does). `transport` holds the
official client (imported only when a client is made) and turns answers into JSON and statuses into
errors; each API group reads its JSON into frozen values: `nodes` (the Node, Events, pods,
ConfigMaps), `claims` (ResourceClaims), `slices` (ResourceSlices).
"""

from sharing.kube.client.claims import ClaimCalls
from sharing.kube.client.nodes import NodeCalls
from sharing.kube.client.slices import SliceCalls, resource_slice, slice_body


class ApiClient(NodeCalls, ClaimCalls, SliceCalls):
    """KubeClient from a kubeconfig file or in-cluster."""


__all__ = ["ApiClient", "resource_slice", "slice_body"]
