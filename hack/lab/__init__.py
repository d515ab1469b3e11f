"""The lab: every cluster the project's tests, demo and benchmarks run, built from real parts.

Two ways to run the agent against real Kubernetes code, sharing one control plane:

- fast (tests/integration, tests/e2e, hack/bench): ``ControlPlane`` (etcd + kube-apiserver on
  127.0.0.1) plus ``KubeletHarness`` (the kubelet's own device manager, no containers);
- real (tests/node, hack/demo.sh): ``RealNode``: the same control plane inside a private network
  and mount namespace, with containerd 2.x, kubelet, kube-scheduler, kube-controller-manager and
  kube-proxy; the agent runs as its DaemonSet pod, installed with the Helm chart.

Modules, in the order a node comes up: ``binaries`` (hack/build-go.sh), ``packages`` (apt),
``images`` (pause, toolbox, the agent), ``cgroups`` and ``netns`` (isolation), ``certs`` and
``kubeconfig``, ``etcd`` and ``controlplane``, ``containerd``, ``components`` (kubelet and the controllers),
``node`` (putting it together, up and down), ``helm`` (the chart), ``harness`` (the fast path)
and ``stubplugin`` (a Go device plugin as a test peer);
``python -m lab`` is the command line. Only the standard library and ``cryptography`` are used;
the harness and the real node need root.
"""

from lab.binaries import Binaries, binaries, default_kubernetes_version, kubernetes_version
from lab.controlplane import ControlPlane, NodeNetwork
from lab.errors import AdmissionError, BinariesUnavailable, ClusterError
from lab.harness import HarnessClient, KubeletHarness
from lab.node import RealNode
from lab.stubplugin import StubDevicePlugin

__all__ = [
    "AdmissionError",
    "Binaries",
    "BinariesUnavailable",
    "ClusterError",
    "ControlPlane",
    "HarnessClient",
    "KubeletHarness",
    "NodeNetwork",
    "RealNode",
    "StubDevicePlugin",
    "binaries",
    "default_kubernetes_version",
    "kubernetes_version",
]
