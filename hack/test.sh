#!/usr/bin/env bash
# The whole test suite, as CI runs it: lint, format, types, layer contracts, generated files, tests.
# Every step runs and prints how long it took; the script fails when any step fails (pytest's "no
# tests ran" counts as failure).
#
#   hack/test.sh                 everything (CI runs this)
#   hack/test.sh --quick         lint, types, contracts, unit and fakedriver tests (for iterating)
#   hack/test.sh --under-load[=N]
#                                everything with N CPU-bound processes beside it for the whole run
#                                (default: one per core); also SHARING_TEST_LOAD=N. A GPU node is
#                                never idle: a race that shows only under load is a bug.
#   hack/test.sh --repeat N [--under-load] [PATHS]
#                                the flake hunt (hack/flakes.py): the tiers that start processes
#                                (fakedriver, integration, e2e, node, cluster, skew; or PATHS) N times, each in a
#                                fresh random order with the soak on new seeds; prints per test how
#                                many runs it failed, the seeds that replay each failure and its log.
#
# Other arguments go to pytest (`hack/test.sh -k plan`, `hack/test.sh --randomly-seed=N`). The tests
# run on SHARING_TEST_WORKERS workers (pytest-xdist; default two more than the cores, as the tests
# often wait on the processes they start: on 2 cores, 3 workers left them idle 30 % of the run): each real node's tests on one of them, the rest wherever a
# worker is free. SHARING_TEST_WORKERS=0 runs them in one process.
# SHARING_TEST_TIMEOUT_SCALE stretches every deadline of the tests (hack/lab/deadlines.py); under load
# it defaults to 3.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

quick=false
load=${SHARING_TEST_LOAD:-0}
repeat=0
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=true ;;
    --under-load) load=$(nproc) ;;
    --under-load=*) load=${1#--under-load=} ;;
    --repeat) repeat=${2:-}; shift ;;
    --repeat=*) repeat=${1#--repeat=} ;;
    *) args+=("$1") ;;
  esac
  shift
done
case $load in '' | *[!0-9]*) echo "--under-load=N: N must be a number, not '$load'" >&2; exit 2 ;; esac
case $repeat in '' | *[!0-9]*) echo "--repeat N: N must be a number, not '$repeat'" >&2; exit 2 ;; esac
if $quick && [ "$repeat" -gt 0 ]; then echo "--repeat runs the tiers that start processes; --quick runs none" >&2; exit 2; fi

started=$SECONDS
hogs=()
stop_load() {
  [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null
  hogs=()
}
trap stop_load EXIT
trap 'stop_load; exit 130' INT TERM
if [ "$load" -gt 0 ]; then
  export SHARING_TEST_TIMEOUT_SCALE=${SHARING_TEST_TIMEOUT_SCALE:-3}
  for _ in $(seq "$load"); do
    # A CPU-bound loop at normal priority, as a data loader beside the agent is.
    sh -c 'while :; do :; done' &
    hogs+=("$!")
  done
  echo "==> under load: $load CPU-bound processes beside the tests (deadlines x$SHARING_TEST_TIMEOUT_SCALE)" >&2
fi

workers=${SHARING_TEST_WORKERS:-$(($(nproc) + 2))}
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers")

venv=$(hack/venv.sh) || { echo "FAILED: could not create the Python environment" >&2; exit 1; }
export PATH="$venv/bin:$PATH" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# The tests start several hundred Python processes from this checkout (agents, `sharing` commands,
# the harnesses): each would compile every module it imports again (0.75 s of CPU for the CLI's,
# 0.48 s with the bytecode kept). Kept outside the checkout, as the rest of the cache; Python checks
# each file's source before it uses its bytecode.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$(dirname "$venv")/pycache"  # beside the venv, in the cache

failed=()
cache=${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}
step() {
  local name=$1 t0=$SECONDS; shift
  echo "==> $name" >&2
  "$@" || failed+=("$name")
  echo "<== $name: $((SECONDS - t0)) s" >&2
}

if [ "$repeat" -gt 0 ]; then
  # The hunt: the binaries the tiers run, then hack/flakes.py, with the load (if any) for all of it.
  step "Go-built binaries" hack/build-go.sh --test-tools >/dev/null
  step "Go-built binaries (Kubernetes 1.34)" env SHARING_K8S_VERSION=1.34 hack/build-go.sh >/dev/null
  out="$cache/flakes/$(date +%Y%m%d-%H%M%S)"
  echo "==> the hunt's logs: $out" >&2
  step "pytest x $repeat" python hack/flakes.py --runs "$repeat" --out "$out" --workers "$workers" -- "${args[@]}"
  stop_load
  echo "==> $((SECONDS - started)) s in all" >&2
  [ ${#failed[@]} -eq 0 ] || { echo "FAILED: ${failed[*]}" >&2; exit 1; }
  echo "no test failed in $repeat runs" >&2
  exit 0
fi

step "ruff check" ruff check .
step "ruff format" ruff format --check .
step "mypy --strict" mypy
step "import contracts" lint-imports --no-cache
step "generated code" hack/gen-proto.sh --check
step "generated presets are up to date" python hack/gen-presets.py --check
if $quick; then
  step "pytest (unit, fakedriver)" pytest tests/unit tests/fakedriver "${parallel[@]}" --durations=10 "${args[@]}"
else
  # Every Go binary of hack/lab (control plane, kubelet harness, the real node's kubelet,
  # controllers, containerd, helm, kubectl) and the tests' promtool: built once per machine (about
  # 18 minutes cold on 2 cores, promtool 7 of them), then reused from the cache outside the repository.
  bin=""
  step "Go-built binaries" eval 'bin=$(hack/build-go.sh --test-tools)'
  # tests/skew's other release: the five Kubernetes daemons of 1.34 (about 9 more minutes cold).
  step "Go-built binaries (Kubernetes 1.34)" env SHARING_K8S_VERSION=1.34 hack/build-go.sh
  if [ -n "$bin" ]; then
    export HELM_CACHE_HOME="$cache/helm/cache" HELM_CONFIG_HOME="$cache/helm/config" HELM_DATA_HOME="$cache/helm/data"
    chart=deploy/helm/gpu-sharing
    step "helm lint" "$bin/helm" lint --strict "$chart"
    step "helm lint (the lab's fake driver, CDI)" "$bin/helm" lint --strict "$chart" \
      --set driverRoot=/run/nvidia/driver --set driverRootReadOnly=false \
      --set "deviceListStrategy={envvar,cdi-cri}" --set config.create=true
    step "helm lint (monitoring: ServiceMonitor, PrometheusRule, dashboard)" "$bin/helm" lint --strict "$chart" \
      --set metrics.serviceMonitor.enabled=true --set metrics.prometheusRule.enabled=true \
      --set metrics.dashboard.enabled=true
    step "deploy/ is the chart's default render" env SHARING_HELM="$bin/helm" python hack/gen-deploy.py --check
  fi
  # The tests run in a random order (pytest-randomly; the header prints the seed: replay an order
  # with `hack/test.sh --randomly-seed=N`, keep file order with `-p no:randomly`). With CI=true a
  # test skipped outside tests/gpu fails (tests/conftest.py): a CI run without root or Go must not
  # pass as if it had run the harness, e2e and node tests. No test collected (exit code 5) fails too.
  step "pytest" pytest "${parallel[@]}" --durations=30 "${args[@]}"
fi
stop_load

echo "==> $((SECONDS - started)) s in all" >&2
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "all checks passed" >&2
