#!/usr/bin/env bash
# The main job, for now: plan a MIG layout change on an A100 with one busy instance.
# (The full demo — local control plane, simulated GPU node, the agent, `kubectl describe node` —
# replaces this once the agent lands.)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/hack/venv.sh")
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
set -x
"$venv/bin/python" -m sharing plan --gpu A100-SXM4-40GB --want 3g.20gb=1,2g.10gb=1,1g.5gb=2 --have 3g.20gb@4,1g.5gb@0:busy
