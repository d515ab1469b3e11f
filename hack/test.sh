#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, format, types, layer contracts, generated files, tests.
# Every step runs; the script fails when any step fails (pytest's "no tests ran" counts as failure).
# Extra arguments go to pytest (e.g. `hack/test.sh -k plan`).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=$(hack/venv.sh) || { echo "FAILED: could not create the Python environment" >&2; exit 1; }
export PATH="$venv/bin:$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

failed=()
step() {
  local name=$1; shift
  echo "==> $name" >&2
  "$@" || failed+=("$name")
}

step "ruff check" ruff check .
step "ruff format" ruff format --check .
step "mypy --strict" mypy
step "import contracts" lint-imports --no-cache
step "generated code" hack/gen-proto.sh --check
step "generated presets are up to date" python hack/gen-presets.py --check
# Every Go binary of hack/lab (control plane, kubelet harness, the real node's kubelet, controllers,
# containerd, helm): built once per machine (~25 minutes cold on 2 cores), then reused from the
# cache outside the repository.
bin=""
step "Go-built binaries" eval 'bin=$(hack/build-go.sh)'
if [ -n "$bin" ]; then
  cache=${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}
  export HELM_CACHE_HOME="$cache/helm/cache" HELM_CONFIG_HOME="$cache/helm/config" HELM_DATA_HOME="$cache/helm/data"
  chart=deploy/helm/gpu-sharing
  step "helm lint" "$bin/helm" lint --strict "$chart"
  step "helm lint (the lab's fake driver, CDI)" "$bin/helm" lint --strict "$chart" \
    --set driverRoot=/run/nvidia/driver --set driverRootReadOnly=false \
    --set "deviceListStrategy={envvar,cdi-cri}" --set config.create=true
  step "deploy/ is the chart's default render" env SHARING_HELM="$bin/helm" python hack/gen-deploy.py --check
fi
# tests/node runs on a real single-node Kubernetes (hack/lab; needs root): ~2 minutes warm.
# The tests run in a random order (pytest-randomly; the header prints the seed: replay an order with
# `hack/test.sh --randomly-seed=N`, keep file order with `-p no:randomly`). With CI=true
# a test skipped outside tests/gpu fails (tests/conftest.py): a CI run without root or Go must not
# pass as if it had run the harness, e2e and node tests. No test collected (exit code 5) fails too.
step "pytest" pytest "$@"

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all checks passed" >&2
