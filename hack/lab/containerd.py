"""containerd 2.x (built from its Go module) as the real node's container runtime, with CDI on.

Its config (version 4, as ``containerd config default`` of 2.4 writes) keeps every path private to
the node: root under the state dir, state and sockets under the node's tmpfs ``/run``, CNI configs in
the state dir, no imports from ``/etc``. Two settings are this machine's: ``restrict_oom_score_adj``
(no CAP_SYS_RESOURCE here, so runc must not lower ``oom_score_adj``) and cgroupfs rather than
systemd. CDI specs are read from ``/etc/cdi`` and ``/var/run/cdi`` (the agent's hostPath).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lab.binaries import Binaries
from lab.errors import ClusterError
from lab.netns import Namespaces
from lab.process import Process, wait_until

SOCKET = "/run/containerd/containerd.sock"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
CLUSTER_CIDR = "10.244.0.0/16"


def pod_cidr(member: int) -> str:
    """The pod subnet of the cluster's node ``member``: each node its own part of ``CLUSTER_CIDR``."""
    return f"10.244.{member}.0/24"


CNI_BIN = "/usr/lib/cni"  # Debian's containernetworking-plugins


def config(root: Path, cni_conf: Path) -> str:
    """The containerd config of the node."""
    return f"""version = 4
root = '{root}'
state = '/run/containerd'
imports = []

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'

  [plugins.'io.containerd.cri.v1.runtime']
    restrict_oom_score_adj = true
    cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '/usr/sbin/runc'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{CNI_BIN}']
      conf_dir = '{cni_conf}'

  [plugins.'io.containerd.server.v1.grpc']
    address = '{SOCKET}'
"""


def cni_config(subnet: str) -> str:
    """A bridge with host-local addresses in ``subnet`` and port mapping. Traffic leaving the pod
    subnet is masqueraded as the node's address, so a pod on one node reaches the API server on
    another (through the `kubernetes` Service) and the answer finds its way back without routes
    to every node's pods."""
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "gpu-sharing-node",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": subnet}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        },
        indent=2,
    )


def process(bins: Binaries, ns: Namespaces, state: Path, cgroup_procs: tuple[Path, ...]) -> Process:
    """The containerd process, its config written under ``state``."""
    cni = state / "cni"
    cni.mkdir(parents=True, exist_ok=True)
    (cni / "10-bridge.conflist").write_text(cni_config(pod_cidr(ns.member)))
    path = state / "containerd.toml"
    path.write_text(config(state / "containerd", cni))
    # The runc shim is looked up on PATH.
    env = {**os.environ, "PATH": f"{bins.directory}:/usr/sbin:/usr/bin:/sbin:/bin"}
    return Process(
        "containerd",
        [str(bins.containerd), f"--config={path}"],
        state / "logs" / "containerd.log",
        detached=True,
        launcher=ns.launcher,
        cgroup_procs=cgroup_procs,
        env=env,
    )


def wait_ready(proc: Process, ns: Namespaces, bins: Binaries) -> None:
    """Until ``ctr version`` answers on the node's socket."""
    wait_until(lambda: ctr(ns, bins, "version", check=False) == 0, proc, "containerd's socket", 30)


def ctr(ns: Namespaces, bins: Binaries, *args: str, check: bool = True) -> int:
    """``ctr`` against the node's containerd (namespace k8s.io, where the kubelet's images live)."""
    done = ns.run(str(bins.ctr), f"--address={SOCKET}", "--namespace=k8s.io", *args, check=False)
    if check and done.returncode != 0:
        raise ClusterError(f"ctr {' '.join(args)}: {done.stderr.strip()}")
    return done.returncode


def import_image(ns: Namespaces, bins: Binaries, archive: Path) -> None:
    """Import a docker-archive tarball; the kubelet then finds it by name and never pulls."""
    ctr(ns, bins, "images", "import", str(archive))
