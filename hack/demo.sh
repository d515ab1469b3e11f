#!/usr/bin/env bash
# The main job: a local control plane, a simulated GPU node (2x A100 + 2x H100), the agent, and
# `kubectl describe node demo-gpu-node` showing MIG slices and time-sliced GPUs.
#   hack/demo.sh            run until Ctrl-C
#   hack/demo.sh --detach   return once the slices are visible (last line: export KUBECONFIG=...)
#   hack/demo.sh --down     stop a detached demo
# The first run builds kube-apiserver, etcd and the kubelet harness from Go modules (minutes);
# later runs reuse them from ~/.cache/gpu-sharing. The kubelet harness needs root.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/hack/venv.sh")
export PATH="$venv/bin:$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec python "$root/hack/demo.py" "$@"
