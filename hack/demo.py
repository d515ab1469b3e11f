"""The demo: a real Kubernetes (one node, or three with --nodes 3) with the fake NVIDIA driver, the
agent installed with its Helm chart, and a pod that gets a MIG slice.

Run through hack/demo.sh. It builds (or reuses) the Go binaries and the images, starts node
`demo-gpu-node` (etcd, kube-apiserver, containerd 2.x, kubelet, scheduler, controller-manager,
kube-proxy in private namespaces; the fake driver under its driver root /run/nvidia/driver with
2x A100-SXM4-40GB + 2x H100 80GB HBM3), labels it with a preset, installs the chart (DaemonSet
`gpu-sharing` in namespace `gpu-sharing`: the real pynvml over the node's libnvidia-ml.so.1), waits
for the slices on the Node, and starts a pod that requests `nvidia.com/mig-1g.5gb: 1`.
With --nodes 3 two more nodes join it, each with its own GPUs and its own config label (the one
DaemonSet on all three): `demo-gpu-node-2` with 4x A100-SXM4-80GB split `all-1g`, and
`demo-gpu-node-3`, a node that mixes GPUs without MIG (2x L4) with one H200, split `all-balanced`
(the L4s offered whole, as `mig: disabled`).
With --dra the node is then switched to the DRA front-end (the chart's `dra.enabled`, the node's label
`nvidia.com/gpu-sharing.frontend=dra`): the pool's ResourceSlices are printed, and three pods get
their devices through claims: a whole GPU (class gpu.nvidia.com), a MIG device (class mig.nvidia.com,
CEL on its profile), and `nvidia.com/mig-1g.5gb: 1` in `resources.limits`, served through the
profile's DeviceClass (its extendedResourceName).
With --k8s 1.34 the cluster runs Kubernetes 1.34 (SHARING_K8S_VERSION; docs/versions.md says what
each release supports).
Without --detach it stays up until Ctrl-C; --down stops what a detached run left running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab import images
from lab.binaries import K8S_VERSION_ENV, binaries, default_kubernetes_version, kubernetes_version
from lab.errors import ClusterError
from lab.helm import NAMESPACE, RELEASE, Helm, lab_values
from lab.node import RealNode

INDEX = int(os.environ.get("SHARING_DEMO_INDEX", "0"))
"""The demo's subnet, 10.(200+INDEX).0.0/24: another index lets a second checkout run its own demo."""
NAME, NODE = "demo" if INDEX == 0 else f"demo{INDEX}", "demo-gpu-node"
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
PRESET = "a100-mig-h100-time-sliced"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
# What the preset gives on this node: each A100 2x 1g.5gb + 2g.10gb + 3g.20gb, each H100 4 replicas.
EXPECTED = {
    "nvidia.com/mig-1g.5gb": "4",
    "nvidia.com/mig-2g.10gb": "2",
    "nvidia.com/mig-3g.20gb": "2",
    "nvidia.com/gpu": "8",
}
# The nodes that join with --nodes: name, GPUs (`sharing sim init --gpus`), config label, what it gives.
JOINING = (
    (f"{NODE}-2", "A100-SXM4-80GB:4", "all-1g", {"nvidia.com/mig-1g.10gb": "28"}),
    (
        f"{NODE}-3",
        "L4:2,H200:1",
        "all-balanced",
        {
            "nvidia.com/gpu": "2",
            "nvidia.com/mig-1g.18gb": "2",
            "nvidia.com/mig-2g.35gb": "1",
            "nvidia.com/mig-3g.71gb": "1",
        },
    ),
)
STATE_LABEL = "nvidia.com/mig.config.state"
POD = """apiVersion: v1
kind: Pod
metadata: {name: mig-demo, namespace: default}
spec:
  restartPolicy: Never
  containers:
    - name: main
      image: localhost/toolbox:1
      imagePullPolicy: IfNotPresent
      command: [sleep, "1000000"]
      resources:
        limits: {nvidia.com/mig-1g.5gb: 1}
"""


def say(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def phase(name: str, doing: str) -> Iterator[None]:
    """Say what starts, then how long it took (the README quotes these)."""
    say(doing)
    started = time.monotonic()
    yield
    say(f"{name}: {time.monotonic() - started:.0f} s")


def wait(what: str, check: object, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.5)


def export(node: RealNode) -> dict[str, Any]:
    """`sharing export --json` in the agent's pod on node NODE (`exec ds/...` picks any node's)."""
    pods = node.kubectl(
        "-n", NAMESPACE, "get", "pods", "-l", "app.kubernetes.io/name=gpu-sharing",
        f"--field-selector=spec.nodeName={NODE}", "-o", "name", check=True,
    ).stdout.split()  # fmt: skip
    exported = node.kubectl("-n", NAMESPACE, "exec", pods[0], "--", "sharing", "export", "--json", check=True)
    return dict(json.loads(exported.stdout))


def up(nodes: int = 1) -> RealNode:
    with phase(
        "Go binaries", "building or reusing the Go binaries (the first build: about 11 minutes on 2 cores)"
    ):
        bins = binaries()
    with phase("images", "building or reusing the images: pause, toolbox, the agent from deploy/Dockerfile"):
        archives = images.all_images(bins)
    with phase(
        f"node {NODE} Ready",
        f"starting node {NODE}: etcd, kube-apiserver, containerd, kubelet, scheduler, controllers,"
        " kube-proxy",
    ):
        node = RealNode(NAME, NODE, index=INDEX).up(archives)
    say(f"the node's logs: {node.logs()}")
    layout = {NODE: (PRESET, EXPECTED)} | {n: (c, e) for n, _, c, e in JOINING[: nodes - 1]}
    for name, gpus, _, _ in JOINING[: nodes - 1]:
        with phase(f"node {name} Ready", f"node {name} joins with {gpus}: containerd, kubelet, kube-proxy"):
            node.join(name, gpus, archives)

    def kubectl(*args: str) -> str:
        return node.kubectl(*args, check=True).stdout

    for name, (preset, _) in layout.items():
        say(f"labelling {name} with {CONFIG_LABEL}={preset}")
        kubectl("label", "node", name, f"{CONFIG_LABEL}={preset}", "--overwrite")
    say("installing the agent with its Helm chart (deploy/helm/gpu-sharing), driverRoot /run/nvidia/driver")
    Helm(node.kubeconfig).upgrade_install(lab_values())
    started = time.monotonic()

    def sliced(name: str, expected: dict[str, str]) -> bool:
        n = json.loads(kubectl("get", "node", name, "-o", "json"))
        labels, capacity = n["metadata"].get("labels", {}), n["status"].get("allocatable", {})
        return labels.get(STATE_LABEL) == "success" and expected.items() <= capacity.items()

    for name, (_, expected) in layout.items():
        wait(f"the slices on Node {name}", lambda name=name, e=expected: sliced(name, e))  # type: ignore[misc]
    say(f"slices visible on every Node {time.monotonic() - started:.0f}s after the install")
    if nodes > 1:
        print(kubectl("get", "nodes", "-L", f"{STATE_LABEL},{CONFIG_LABEL}"))
    for name in layout:
        print(kubectl("describe", "node", name))
    with phase("pod mig-demo Running", "starting pod mig-demo with limits nvidia.com/mig-1g.5gb: 1"):
        node.kubectl("apply", "-f", "-", input=POD, check=True)
        wait(
            "pod mig-demo Running",
            lambda: kubectl("get", "pod", "mig-demo", "-o", "jsonpath={.status.phase}") == "Running",
            60,
        )
    print(kubectl("get", "pods", "-A", "-o", "wide"))
    env = kubectl("exec", "mig-demo", "--", "env")
    visible = next(
        (line for line in env.splitlines() if line.startswith("NVIDIA_VISIBLE_DEVICES=")), "(none)"
    )
    exported = export(node)
    where = {
        i["uuid"]: f"GPU {g['index']} ({g['product']}), MIG {i['profile']} at slice {i['start']}"
        for g in exported["gpus"]
        for i in g["instances"]
    }
    uuid = visible.partition("=")[2]
    found = where.get(uuid, "not a MIG device of this node?!")
    print(f"pod mig-demo sees {visible}\n  = {found}, per `sharing export` in the agent's pod")
    return node


FRONTEND_LABEL = "nvidia.com/gpu-sharing.frontend"
EXTENDED_RESOURCE_DEFAULT_ON = 36
"""The minor from which DRAExtendedResource is on by default (k8s.io/kubernetes
pkg/features/kube_features.go)."""
DRA_OBJECTS = """apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: whole-gpu, namespace: default}
spec:
  devices:
    requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: small-mig, namespace: default}
spec:
  devices:
    requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}}]
"""
DRA_POD = """apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  restartPolicy: Never
  {claims}
  containers:
    - name: main
      image: localhost/toolbox:1
      imagePullPolicy: IfNotPresent
      command: [sleep, "1000000"]
      resources: {resources}
"""


def dra(node: RealNode) -> None:
    """Switch the node to DRA and show three pods served through claims."""

    def kubectl(*args: str) -> str:
        return node.kubectl(*args, check=True).stdout

    say("deleting pod mig-demo: a node switches front-ends once nothing the old one handed out is held")
    kubectl("delete", "pod", "mig-demo", "--timeout=60s")
    say("upgrading the chart with dra.enabled (DeviceClasses, RBAC, the kubelet's plugin dirs mounted)")
    Helm(node.kubeconfig).upgrade_install(lab_values(dra={"enabled": True}))
    say(f"labelling {NODE} with {FRONTEND_LABEL}=dra")
    kubectl("label", "node", NODE, f"{FRONTEND_LABEL}=dra", "--overwrite")

    def pool() -> list[dict[str, object]]:
        items = json.loads(kubectl("get", "resourceslices", "-o", "json"))["items"]
        return [d for s in items if s["spec"].get("nodeName") == NODE for d in s["spec"].get("devices", [])]

    started = time.monotonic()
    wait("the node's ResourceSlices", lambda: len(pool()) >= 6)
    say(f"ResourceSlices published {time.monotonic() - started:.0f}s after the label")
    print(kubectl("get", "resourceslices", "-o", "yaml"))
    print(kubectl("get", "deviceclasses"))
    node.kubectl("apply", "-f", "-", input=DRA_OBJECTS, check=True)
    pods = {
        "gpu-claim-demo": (
            "resourceClaims: [{name: gpu, resourceClaimName: whole-gpu}]",
            "{claims: [{name: gpu}]}",
        ),
        "mig-claim-demo": (
            "resourceClaims: [{name: mig, resourceClaimName: small-mig}]",
            "{claims: [{name: mig}]}",
        ),
        "mig-limits-demo": ("", "{limits: {nvidia.com/mig-1g.5gb: 1}}"),
    }
    release = kubernetes_version()
    if int(release.split(".")[1]) < EXTENDED_RESOURCE_DEFAULT_ON:
        say(f"no pod mig-limits-demo: Kubernetes {release} has no extended resources through DRA "
            "(feature gate DRAExtendedResource, on by default from 1.36)")  # fmt: skip
        del pods["mig-limits-demo"]
    for name, (claims, resources) in pods.items():
        say(f"starting pod {name}: {claims or resources}")
        node.kubectl(
            "apply",
            "-f",
            "-",
            input=DRA_POD.format(name=name, claims=claims, resources=resources),
            check=True,
        )
    for name in pods:
        try:
            wait(
                f"pod {name} Running",
                lambda name=name: kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}") == "Running",
                90,
            )
        except ClusterError:
            print(kubectl("describe", "pod", name), file=sys.stderr)
            raise
    print(kubectl("get", "resourceclaims", "-o", "wide"))
    exported = export(node)
    where = {g["uuid"]: f"GPU {g['index']} ({g['product']}), the whole GPU" for g in exported["gpus"]}
    where |= {
        i["uuid"]: f"GPU {g['index']} ({g['product']}), MIG {i['profile']} at slice {i['start']}"
        for g in exported["gpus"]
        for i in g["instances"]
        if i["uuid"]
    }
    for name in pods:
        env = kubectl("exec", name, "--", "env").splitlines()
        seen = [line.partition("=")[2] for line in env if line.startswith("GPU_SHARING_DEVICE_")]
        for uuid in seen:
            print(f"pod {name} sees {uuid}\n  = {where.get(uuid, 'not a device of this node?!')}")
    print(kubectl("get", "resourceclaim", "small-mig", "-o", "yaml"))


def main() -> int:
    parser = argparse.ArgumentParser(description="gpu-sharing demo on a real Kubernetes")
    parser.add_argument(
        "--nodes",
        type=int,
        choices=range(1, len(JOINING) + 2),
        default=1,
        help="how many nodes: 3 adds a node of A100 80GB and a node mixing L4s and an H200",
    )
    parser.add_argument(
        "--k8s",
        metavar="MINOR",
        help=f"the cluster's Kubernetes release: {default_kubernetes_version()} by default, or another "
        "the lab builds (1.34: hack/go/k8s-1.34); the same as SHARING_K8S_VERSION",
    )
    parser.add_argument("--detach", action="store_true", help="return once the pod runs with its slice")
    parser.add_argument("--down", action="store_true", help="stop a detached demo")
    parser.add_argument(
        "--dra", action="store_true", help="then switch the node to DRA and run pods through claims"
    )
    args = parser.parse_args()
    if args.k8s:  # every binary the lab asks for below is of that release
        os.environ[K8S_VERSION_ENV] = args.k8s
    if args.down:
        try:
            node = RealNode.load(NAME)
        except FileNotFoundError:
            print("no demo is running")
            return 0
        node.down()
        say("demo stopped")
        return 0
    # Ctrl-C (or SIGTERM) anywhere below ends in a clean `down`, even when started in the
    # background of a script (which would otherwise leave SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = time.monotonic()
    try:
        node = up(args.nodes)
        if args.dra:
            dra(node)
        say(f"the demo is up: {time.monotonic() - started:.0f} s in all")
        if not args.detach:
            # From here on a stop signal waits for `sigwait` below instead of raising wherever the
            # code is: a KeyboardInterrupt raised between two statements outside the `try` that
            # downs the node (right after the "runs until Ctrl-C" line, say) left it all running.
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    except (ClusterError, subprocess.CalledProcessError, KeyboardInterrupt) as err:
        detail = getattr(err, "stderr", None) or err or "interrupted"
        print(f"demo failed: {detail}", file=sys.stderr)
        if Path(RealNode(NAME, NODE).state_file).exists():
            RealNode.load(NAME).down()
        return 1
    hints = f"""Try next (in another shell, after the export below):
  kubectl get nodes -L {STATE_LABEL},{CONFIG_LABEL}  # each node's config and its state
  kubectl label node {NODE} {CONFIG_LABEL}=all-1g --overwrite          # 7 x 1g on every GPU
  kubectl label node {NODE} {CONFIG_LABEL}=all-replicas-4 --overwrite  # MIG off, 4 replicas each
  kubectl -n {NAMESPACE} edit configmap gpu-sharing-config                 # your configs: applied live
  kubectl -n {NAMESPACE} exec ds/{RELEASE} -- sharing export               # the GPUs as the agent sees them
  kubectl -n {NAMESPACE} logs ds/{RELEASE}                                 # the agent's log"""
    if args.detach:
        print(f"{hints}\nstop it with: hack/demo.sh --down\nexport KUBECONFIG={node.kubeconfig}")
        return 0
    try:
        print(f"{hints}\nexport KUBECONFIG={node.kubeconfig}\nThe demo runs until Ctrl-C.", flush=True)
        signal.sigwait(STOP_SIGNALS)  # still blocked: a second Ctrl-C cannot cut `down` short either
    finally:
        started = time.monotonic()
        node.down()
        say(f"demo stopped in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
