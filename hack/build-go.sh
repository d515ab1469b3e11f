#!/usr/bin/env bash
# Build every Go binary the lab runs, from the wrapper modules in hack/go/, into a cache directory
# OUTSIDE the repository:
#
#   ${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}/bin/<key>/
#
#   hack/go/k8s         kube-apiserver, kubelet, kube-scheduler, kube-controller-manager,
#                       kube-proxy (k8s.io/kubernetes), the kubelet harness, the stub device
#                       plugin its tests use as a peer, and the pause binary of the pause image
#   hack/go/etcd        etcd
#   hack/go/containerd  containerd, containerd-shim-runc-v2, ctr (containerd 2.x: CDI on by default)
#   hack/go/helm        helm (v3)
#   hack/go/kubectl     kubectl at the default Kubernetes release (k8s.io/kubectl; the machine's own
#                       kubectl may be minors away from the lab's API server, outside kubectl's
#                       skew policy, and an older one's exec races under load)
#   hack/go/prometheus  promtool (Prometheus's rule checker, rule unit tests and TSDB queries), for
#                       the chart's PrometheusRule and Grafana dashboard
#   hack/go/k8s-<minor> another Kubernetes release's five daemons only (kube-apiserver, kubelet,
#                       kube-scheduler, kube-controller-manager, kube-proxy), for
#                       SHARING_K8S_VERSION=<minor> (e.g. 1.34); everything else as for the default
#
# SHARING_K8S_VERSION picks the Kubernetes release of the five daemons: unset, or the minor of
# hack/go/k8s (1.37), is the default; another minor needs hack/go/k8s-<minor>. The test peers (the
# kubelet harness, the stub device plugin, dra-kubelet) always come from hack/go/k8s.
#
# Separate modules keep each dependency graph apart (MVS never mixes etcd's, containerd's or helm's
# versions into Kubernetes'). <key> is a hash of every input (go.mod/go.sum, our Go sources) plus
# the Go version, so unchanged inputs never rebuild. Each binary is also stored under its own,
# narrower key in objs/ and hard-linked into bin/<key>/, so editing the harness does not rebuild
# kube-apiserver. Without Go, a bin directory built from the same inputs by any Go is used.
#
# Prints progress on stderr (a heartbeat every 30 s during long builds) and the bin directory (one
# line) on stdout:   BIN=$(hack/build-go.sh)
# `--test-tools` builds what only the tests run too: promtool (hack/go/prometheus, ~6 min cold), so
# the demo's first run does not wait for it. The test command asks for it.
# Exit code 3: Go is missing and nothing matching is cached.
#
# Builds use the committed go.sum (-mod=readonly); GOTOOLCHAIN=local so Go never tries to download
# a toolchain. Needs Go >= 1.26 and the module proxy (or a warm module cache).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
gomods="$here/go"

log() { printf '%s\n' "build-go: $*" >&2; }
die() { log "error: $*"; exit 1; }

command -v sha256sum >/dev/null 2>&1 || die "sha256sum not found (coreutils)"

export GOTOOLCHAIN=local
export CGO_ENABLED=0
# -mod=readonly: use the committed go.sum, never rewrite go.mod.
export GOFLAGS="-mod=readonly -buildvcs=false"

# Versions come from the wrapper go.mod files, so bumping them there is enough.
mod_version() { # <go.mod> <module path>
	awk -v m="$2" '($1 == m) { print $2; exit } ($1 == "require" && $2 == m) { print $3; exit }' "$1"
}
k8s_version=$(mod_version "$gomods/k8s/go.mod" k8s.io/kubernetes)
[ -n "$k8s_version" ] || die "cannot find k8s.io/kubernetes in hack/go/k8s/go.mod"
# The module the five Kubernetes daemons come from: hack/go/k8s, or hack/go/k8s-<minor>.
k8s_mod=k8s
wanted=${SHARING_K8S_VERSION:-}
wanted=${wanted#v}
if [ -n "$wanted" ] && [ "$wanted" != "$(echo "${k8s_version#v}" | cut -d. -f1,2)" ]; then
	k8s_mod="k8s-$(echo "$wanted" | cut -d. -f1,2)"
	if [ ! -f "$gomods/$k8s_mod/go.mod" ]; then
		others=$(cd "$gomods" && ls -d k8s-* 2>/dev/null | sed 's/^k8s-//' | paste -sd, -)
		die "SHARING_K8S_VERSION=$SHARING_K8S_VERSION: no hack/go/$k8s_mod (the default is $(echo "${k8s_version#v}" | cut -d. -f1,2); others: ${others:-none})"
	fi
fi
kube_version=$(mod_version "$gomods/$k8s_mod/go.mod" k8s.io/kubernetes)
etcd_version=$(mod_version "$gomods/etcd/go.mod" go.etcd.io/etcd/server/v3)
containerd_version=$(mod_version "$gomods/containerd/go.mod" github.com/containerd/containerd/v2)
helm_version=$(mod_version "$gomods/helm/go.mod" helm.sh/helm/v3)
kubectl_lib=$(mod_version "$gomods/kubectl/go.mod" k8s.io/kubectl)
kubectl_version="v1.${kubectl_lib#v0.}" # k8s.io/kubectl v0.37.2 is kubectl v1.37.2
prometheus_version=$(mod_version "$gomods/prometheus/go.mod" github.com/prometheus/prometheus)
for v in k8s_version etcd_version containerd_version helm_version kubectl_lib prometheus_version; do
	[ -n "${!v}" ] || die "cannot find the version behind \$$v in hack/go/*/go.mod"
done

go_version=""
if command -v go >/dev/null 2>&1; then
	go_version=$(go env GOVERSION) || die "'go env GOVERSION' failed"
fi

hash_files() { # files (relative to hack/go)... -> short content hash
	(cd "$gomods" && sha256sum "$@") | sha256sum | cut -c1-12
}
go_files() { (cd "$gomods" && find "$1" -type f -name '*.go' | LC_ALL=C sort); }
mods="k8s/go.mod k8s/go.sum etcd/go.mod etcd/go.sum containerd/go.mod containerd/go.sum helm/go.mod helm/go.sum"
mods="$mods kubectl/go.mod kubectl/go.sum prometheus/go.mod prometheus/go.sum"
sources="$(go_files k8s/kubelet-harness) $(go_files k8s/stubplugin) $(go_files k8s/dra-kubelet) $(go_files k8s/pause)"
sources="$sources $(go_files kubectl)"
[ "$k8s_mod" = k8s ] || mods="$mods $k8s_mod/go.mod $k8s_mod/go.sum"
# shellcheck disable=SC2086
inputs_hash=$(hash_files $mods $sources)
go_hash=$(printf '%s' "$go_version" | sha256sum | cut -c1-8)

cache=${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}
prefix="$cache/bin/k8s-${kube_version}_etcd-${etcd_version}_containerd-${containerd_version}_${inputs_hash}"
bin="${prefix}_go-${go_hash}"
objs="$cache/objs"
names="kube-apiserver etcd kubelet-harness stub-device-plugin dra-kubelet kubelet kube-scheduler kube-controller-manager kube-proxy pause containerd containerd-shim-runc-v2 ctr helm kubectl"
test_tools=false
for arg in "$@"; do
	case $arg in
		--test-tools) test_tools=true ;;
		*) die "unknown argument '$arg' (only --test-tools)" ;;
	esac
done
$test_tools && names="$names promtool"

have_all() { # <dir>
	local n
	for n in $names; do [ -x "$1/$n" ] || return 1; done
}

# Fast path: everything is there; no lock, no go invocation beyond the above.
if [ -n "$go_version" ] && have_all "$bin"; then
	printf '%s\n' "$bin"
	exit 0
fi
if [ -z "$go_version" ]; then
	for dir in "$prefix"_go-*; do
		if have_all "$dir"; then
			printf '%s\n' "$dir"
			exit 0
		fi
	done
	log "'go' not found in PATH and no binaries built from these inputs are cached in $cache/bin;"
	log "install Go >= 1.26, or point SHARING_KUBE_APISERVER, SHARING_ETCD, SHARING_KUBELET_HARNESS,"
	log "SHARING_KUBELET, SHARING_KUBE_SCHEDULER, SHARING_KUBE_CONTROLLER_MANAGER, SHARING_KUBE_PROXY,"
	log "SHARING_CONTAINERD, SHARING_CONTAINERD_SHIM, SHARING_CTR, SHARING_HELM, SHARING_PROMTOOL,"
	log "SHARING_PAUSE and"
	log "SHARING_STUB_DEVICE_PLUGIN, SHARING_DRA_KUBELET at prebuilt binaries"
	exit 3
fi

mkdir -p "$bin" "$objs"
# One builder at a time per cache (parallel test sessions on one machine).
exec 9>"$cache/.build.lock"
if ! flock -n 9; then
	log "another build-go.sh is running; waiting for it"
	flock 9
fi

ldflags_k8s() { # <version>: version stamping as kubernetes' hack/lib/version.sh does it
	local minor ld="-s -w" kv
	minor=${1#v1.}
	minor=${minor%%.*}
	for kv in "gitVersion=$1" gitMajor=1 "gitMinor=$minor" gitTreeState=clean \
		gitCommit=module-build "buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; do
		ld="$ld -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
	done
	printf '%s' "$ld"
}

heartbeat_pid=""
stop_heartbeat() { [ -z "$heartbeat_pid" ] || kill "$heartbeat_pid" 2>/dev/null || true; heartbeat_pid=""; }
trap stop_heartbeat EXIT

# build <name> <version> <object key> <module dir> <package> <ldflags> <estimate>
build() {
	local name=$1 version=$2 key=$3 dir=$4 pkg=$5 ld=$6 estimate=$7
	local obj="$objs/$name-$key"
	if [ ! -x "$obj" ]; then
		log "building $name $version ($estimate)…"
		local start=$SECONDS tmp="$obj.tmp.$$"
		# A line every 30 s, so a long cold build is visibly alive (CI logs, a waiting demo).
		(while sleep 30; do log "… still building $name ($((SECONDS - start))s)"; done) &
		heartbeat_pid=$!
		# Build into a temporary name and rename: a killed build never leaves a half-written
		# binary under the final name.
		if ! (cd "$dir" && go build -trimpath -ldflags "$ld" -o "$tmp" "$pkg"); then
			rm -f "$tmp"
			die "go build of $name failed (see above)"
		fi
		stop_heartbeat
		mv -f "$tmp" "$obj"
		log "built $name in $((SECONDS - start))s"
	fi
	if [ ! -x "$bin/$name" ]; then
		ln -f "$obj" "$bin/$name.tmp.$$" 2>/dev/null || cp -f "$obj" "$bin/$name.tmp.$$"
		mv -f "$bin/$name.tmp.$$" "$bin/$name"
	fi
}

k8s_hash=$(hash_files "$k8s_mod/go.mod" "$k8s_mod/go.sum")_$go_hash
# shellcheck disable=SC2046
harness_hash=$(hash_files k8s/go.mod k8s/go.sum $(go_files k8s/kubelet-harness))_$go_hash
# shellcheck disable=SC2046
stub_hash=$(hash_files $(go_files k8s/stubplugin))_$go_hash
# shellcheck disable=SC2046
dra_kubelet_hash=$(hash_files k8s/go.mod k8s/go.sum $(go_files k8s/dra-kubelet))_$go_hash
# shellcheck disable=SC2046
pause_hash=$(hash_files $(go_files k8s/pause))_$go_hash
etcd_hash=$(hash_files etcd/go.mod etcd/go.sum)_$go_hash
containerd_hash=$(hash_files containerd/go.mod containerd/go.sum)_$go_hash
helm_hash=$(hash_files helm/go.mod helm/go.sum)_$go_hash
kubectl_hash=$(hash_files kubectl/go.mod kubectl/go.sum $(go_files kubectl))_$go_hash
prometheus_hash=$(hash_files prometheus/go.mod prometheus/go.sum)_$go_hash
k8s_ld=$(ldflags_k8s "$k8s_version")
kube_ld=$(ldflags_k8s "$kube_version")
k8s=k8s.io/kubernetes/cmd

build kube-apiserver "$kube_version" "${kube_version}_$k8s_hash" "$gomods/$k8s_mod" "$k8s/kube-apiserver" "$kube_ld" \
	"~10 min on 2 cores from an empty Go cache; ~1 min to relink when only go.mod/go.sum changed"
build etcd "$etcd_version" "${etcd_version}_$etcd_hash" "$gomods/etcd" go.etcd.io/etcd/server/v3 "-s -w" \
	"~2 min from an empty Go cache"
build kubelet-harness "(k8s $k8s_version)" "${k8s_version}_$harness_hash" "$gomods/k8s" ./kubelet-harness "$k8s_ld" \
	"~1-2 min on a cold cache, ~15 s after a harness edit"
build stub-device-plugin "(k8s $k8s_version)" "${k8s_version}_$stub_hash" "$gomods/k8s" ./stubplugin "-s -w" \
	"a test peer for the harness: seconds"
build dra-kubelet "(k8s $k8s_version)" "${k8s_version}_$dra_kubelet_hash" "$gomods/k8s" ./dra-kubelet "$k8s_ld" \
	"the kubelet's DRA plugin registration and client, a test peer for DRA plugins: ~2 min cold, seconds after"
build kubelet "$kube_version" "${kube_version}_$k8s_hash" "$gomods/$k8s_mod" "$k8s/kubelet" "$kube_ld" \
	"~4 min from an empty Go cache, ~1 min after kube-apiserver"
build kube-scheduler "$kube_version" "${kube_version}_$k8s_hash" "$gomods/$k8s_mod" "$k8s/kube-scheduler" "$kube_ld" "~10-45 s"
build kube-controller-manager "$kube_version" "${kube_version}_$k8s_hash" "$gomods/$k8s_mod" "$k8s/kube-controller-manager" \
	"$kube_ld" "~1-2 min"
build kube-proxy "$kube_version" "${kube_version}_$k8s_hash" "$gomods/$k8s_mod" "$k8s/kube-proxy" "$kube_ld" "~10-60 s"
build pause "(static)" "$pause_hash" "$gomods/k8s" ./pause "-s -w" "seconds"
ctrd_ld="-s -w -X github.com/containerd/containerd/v2/version.Version=${containerd_version#v}"
for name in containerd containerd-shim-runc-v2 ctr; do
	build "$name" "$containerd_version" "${containerd_version}_$containerd_hash" "$gomods/containerd" \
		"github.com/containerd/containerd/v2/cmd/$name" "$ctrd_ld" "~1-3 min from an empty Go cache"
done
build helm "$helm_version" "${helm_version}_$helm_hash" "$gomods/helm" helm.sh/helm/v3/cmd/helm \
	"-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version" "~3 min from an empty Go cache"
build kubectl "$kubectl_version" "${kubectl_version}_$kubectl_hash" "$gomods/kubectl" . "$(ldflags_k8s "$kubectl_version")" \
	"~30 s after the Kubernetes binaries, ~3 min from an empty Go cache"
# Prometheus tags v3.X.Y as module version v0.3XX.Y; promtool --version prints the module's.
$test_tools && build promtool "$prometheus_version" "${prometheus_version}_$prometheus_hash" "$gomods/prometheus" \
	github.com/prometheus/prometheus/cmd/promtool \
	"-s -w -X github.com/prometheus/common/version.Version=${prometheus_version#v}" "~6 min from an empty Go cache"

have_all "$bin" || die "internal error: binaries missing in $bin"
printf '%s\n' "$bin"
