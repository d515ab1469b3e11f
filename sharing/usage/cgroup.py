"""Which pod and container a host process belongs to, from its `/proc/<pid>/cgroup` (pure).

NVML names processes by host PID (the driver is not PID-namespace aware). The kubelet puts each pod
in a cgroup named after its UID and the runtime each container in one named after its ID, under
either cgroup driver and either cgroup version (a line per v1 hierarchy, `0::` for v2):

- cgroupfs: `/kubepods/besteffort/pod<uid>/<container id>` (`/kubepods/pod<uid>/...` for a
  Guaranteed pod; under the kubelet's `cgroupRoot` when it has one, as on the lab's nodes);
- systemd: `/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid with _>.slice/
  cri-containerd-<container id>.scope` (`crio-`, `docker-` for other runtimes).

Read from another cgroup namespace the path may start with `/..`; the pod's and the container's
names are found wherever they are on the path. NVIDIA's dcgm-exporter finds the UID the same way
(internal/pkg/transformation/pidmapper.go and its test cases, with both layouts). A pod UID is a
UUID, or for a static pod the 32 hex digits of its config hash (the kubelet's own UID for it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_POD = re.compile(
    r"^(?:kubepods-(?:besteffort-|burstable-|guaranteed-)?)?pod"
    r"(?P<uid>[0-9a-f]{8}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{12})(?:\.slice)?$"
)
_CONTAINER = re.compile(r"^(?:(?:cri-containerd|crio|docker|containerd)-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True, slots=True)
class PodProcess:
    """A process's pod (its UID as the API server writes it) and container (its ID, if in one)."""

    pod_uid: str
    container_id: str | None


def pod_of(cgroup: str) -> PodProcess | None:
    """The pod and container of a `/proc/<pid>/cgroup` text; None when the process is no pod's."""
    found: PodProcess | None = None
    for line in cgroup.splitlines():
        path = line.split(":", 2)[2] if line.count(":") >= 2 else ""
        segments = path.split("/")
        for i, segment in enumerate(segments):
            pod = _POD.match(segment)
            if pod is None:
                continue
            uid = _uid(pod["uid"])
            container = _CONTAINER.match(segments[i + 1]) if i + 1 < len(segments) else None
            here = PodProcess(uid, container["id"] if container else None)
            if here.container_id is not None:
                return here
            found = found or here
            break
    return found


def _uid(raw: str) -> str:
    """The UID as the API server writes it: systemd's `_` are `-`; 32 bare digits stay as they are."""
    return raw.replace("_", "-")
