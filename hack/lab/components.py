"""The real node's Kubernetes daemons: kubelet, kube-scheduler, kube-controller-manager, kube-proxy.

The flags and the kubelet config are what this machine needs (facts in the module's comments):
cgroup v1 allowed, cgroupfs under the node's own cgroup root, no swap check, images never garbage
collected (they are imported, nothing can pull them again), eviction relaxed, no DNS add-on, and
kube-proxy touching no global sysctl. Leader election is off: there is one of each.
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.binaries import Binaries
from lab.containerd import CLUSTER_CIDR, SOCKET
from lab.controlplane import SERVICE_RANGE, ControlPlane


def kubelet_config(cp: ControlPlane, cgroup_root: str, state: Path, pod_cidr: str) -> Path:
    """Write the KubeletConfiguration (JSON is YAML) and return its path."""
    resolv = state / "resolv.conf"
    resolv.write_text("# no cluster DNS on this node\n")
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this machine has cgroup v1 only
        "failSwapOn": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{cgroup_root}",
        "containerRuntimeEndpoint": f"unix://{SOCKET}",
        "authentication": {
            "x509": {"clientCAFile": str(cp.ca_path)},
            "webhook": {"enabled": True},
            "anonymous": {"enabled": False},
        },
        "authorization": {"mode": "Webhook"},
        # Images are imported, never pulled: garbage collecting one would break the next pod.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "resolvConf": str(resolv),
        # Capacity changes from device plugins reach the Node within ~2 s (default 10 s).
        "nodeStatusUpdateFrequency": "2s",
        "serializeImagePulls": False,
        "podCIDR": pod_cidr,
    }
    path = state / "kubelet-config.yaml"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def kubelet_args(bins: Binaries, node: str, address: str, config: Path, kubeconfig: Path) -> list[str]:
    return [
        str(bins.kubelet),
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node}",
        f"--node-ip={address}",
        "--root-dir=/var/lib/kubelet",
        "--v=1",
    ]


def scheduler_args(bins: Binaries, kubeconfig: Path) -> list[str]:
    return [
        str(bins.kube_scheduler),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        # No health/metrics port: tests read pods and claims, and a fixed port (10259) is taken by the
        # scheduler of any other control plane on the machine ("If 0, don't serve HTTPS at all").
        "--secure-port=0",
    ]


def controller_manager_args(bins: Binaries, cp: ControlPlane, kubeconfig: Path) -> list[str]:
    return [
        str(bins.kube_controller_manager),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        # Each controller with its own ServiceAccount, tokens signed with the API server's key.
        "--use-service-account-credentials",
        f"--root-ca-file={cp.ca_path}",
        f"--service-account-private-key-file={cp.dir / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_RANGE}",
    ]


def proxy_args(bins: Binaries, node: str, kubeconfig: Path) -> list[str]:
    return [
        str(bins.kube_proxy),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node}",
        "--proxy-mode=iptables",
        f"--cluster-cidr={CLUSTER_CIDR}",
        # Zero: leave the host-wide conntrack sysctls alone (they are not per network namespace).
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
    ]
