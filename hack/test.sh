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
# kube-apiserver, etcd and the kubelet harness for the integration tests: built once per machine
# (the first build takes ~15 minutes on 2 cores), then reused from the cache outside the repo.
step "Go-built test binaries" hack/build-go.sh
step "pytest" pytest "$@"

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all checks passed" >&2
