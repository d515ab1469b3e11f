"""The Kubernetes releases people run, on real nodes (hack/lab), one node per setup:

- a 1.34 kubelet under the default (1.37) control plane, served by the device plugins: the version
  skew a managed cluster has mid-upgrade (the kubelet may be three minors behind the API server,
  https://kubernetes.io/releases/version-skew-policy/#kubelet);
- a whole 1.34 cluster served through DRA: what 1.34 has (DRA itself is GA there) works, what it
  lacks (partitionable devices, off by default: `mig: dynamic`) is refused by name.

Each module brings its node up and down (module-scoped), so the two never run at once and share one
subnet: index SHARING_TEST_SKEW_INDEX (12 unless told; 1 is tests/node's, 10 tests/cluster's). The
tests use the helpers of tests/cluster (the same operator's view: kubectl, the API, pods by node).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lab
import pytest
from lab import images
from lab.helm import Helm, lab_values

from tests.cluster.conftest import CONFIG_LABEL, Cluster
from tests.conftest import SKEW_RELEASE

OLD = SKEW_RELEASE
"""The oldest release a managed cluster still commonly runs (hack/go/k8s-1.34)."""


def skew_index() -> int:
    return int(os.environ.get("SHARING_TEST_SKEW_INDEX", "12"))


def server_version(cluster: Cluster) -> str:
    """The API server's release, as `kubectl version` shows it."""
    return str(json.loads(cluster.kubectl("version", "-o", "json"))["serverVersion"]["gitVersion"])


@contextmanager
def one_node(
    cluster_binaries: lab.Binaries,
    node_name: str,
    gpus: str,
    configs: dict[str, str],
    config: str,
    *,
    k8s: str | None = None,
    kubelet: str | None = None,
    labels: dict[str, str] | None = None,
    **values: Any,
) -> Iterator[Cluster]:
    """A one-node cluster of these releases, labelled, with the chart installed; down after."""
    if os.geteuid() != 0:
        pytest.skip("the real node needs root (namespaces, cgroups, mounts)")
    archives = images.all_images(cluster_binaries)
    index = skew_index()
    node = lab.RealNode(f"skew{index}", node_name, index=index, gpus=gpus, k8s=k8s, kubelet=kubelet)
    node.up(archives)
    try:
        more = [f"{k}={v}" for k, v in (labels or {}).items()]
        node.kubectl("label", "node", node_name, f"{CONFIG_LABEL}={config}", *more, check=True)
        helm = Helm(node.kubeconfig, binary=node.bins.helm)
        helm.upgrade_install(lab_values(configs, **values))
        yield Cluster(node, helm)
    finally:
        node.down()
