#!/usr/bin/env bash
# The main job: a real single-node Kubernetes (containerd, kubelet, scheduler, ... in private
# namespaces), the fake NVIDIA driver (2x A100 + 2x H100), the agent installed with its Helm chart, the
# slices in `kubectl describe node demo-gpu-node`, and a pod running with a MIG slice.
#   hack/demo.sh --nodes 3  three nodes, each its own GPUs and config: the first as above, then
#                           4x A100-SXM4-80GB (all-1g) and 2x L4 + 1x H200 (all-balanced)
#   hack/demo.sh            run until Ctrl-C
#   hack/demo.sh --detach   return once the pod runs (last line: export KUBECONFIG=...)
#   hack/demo.sh --down     stop a detached demo
#   hack/demo.sh --dra      then switch the node to DRA: claims for a GPU and a MIG device, and
#                           nvidia.com/mig-1g.5gb limits through the DeviceClass (ResourceSlices printed)
#   hack/demo.sh --k8s 1.34 the cluster on Kubernetes 1.34 instead of 1.37 (= SHARING_K8S_VERSION=1.34;
#                           what each release supports: docs/versions.md)
# The first run builds the Go binaries and the images; later runs reuse them from
# ~/.cache/gpu-sharing. Each phase prints how long it took (README quotes them). Needs root.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/hack/venv.sh")
export PATH="$venv/bin:$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec python "$root/hack/demo.py" "$@"
