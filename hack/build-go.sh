#!/usr/bin/env bash
# Build the Go test tooling (kube-apiserver, etcd, kubelet-harness, and the
# stub-device-plugin the harness tests use as a peer) from the
# wrapper modules in hack/go/, into a cache directory OUTSIDE the repository:
#
#   ${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}/bin/<key>/
#
# <key> names the Kubernetes and etcd versions plus a hash of every input
# (go.mod/go.sum of both modules, the harness sources, the Go version), so an
# edit to the harness gives a new directory and unchanged inputs never
# rebuild. Each binary is also stored under its own, narrower key in
# objs/ and hard-linked into bin/<key>/, so editing the harness does not
# rebuild kube-apiserver.
#
# Prints progress on stderr and the bin directory (one line) on stdout:
#   BIN=$(hack/build-go.sh)
#
# Builds use the committed go.sum (-mod=readonly); GOTOOLCHAIN=local so Go
# never tries to download a toolchain. Needs Go >= 1.26 and the module proxy
# (or a warm module cache).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
k8s_mod="$here/go/k8s"
etcd_mod="$here/go/etcd"

log() { printf '%s\n' "build-go: $*" >&2; }
die() { log "error: $*"; exit 1; }

command -v go >/dev/null 2>&1 || die "'go' not found in PATH; install Go >= 1.26 (https://go.dev/dl/) or point SHARING_KUBE_APISERVER, SHARING_ETCD and SHARING_KUBELET_HARNESS at prebuilt binaries"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum not found (coreutils)"

export GOTOOLCHAIN=local
export CGO_ENABLED=0
# -mod=readonly: use the committed go.sum, never rewrite go.mod.
export GOFLAGS="-mod=readonly -buildvcs=false"

go_version=$(go env GOVERSION) || die "'go env GOVERSION' failed"

# Versions come from the wrapper go.mod files, so bumping them there is enough.
mod_version() { # <go.mod> <module path>
	awk -v m="$2" '($1 == m) { print $2; exit } ($1 == "require" && $2 == m) { print $3; exit }' "$1"
}
k8s_version=$(mod_version "$k8s_mod/go.mod" k8s.io/kubernetes)
etcd_version=$(mod_version "$etcd_mod/go.mod" go.etcd.io/etcd/server/v3)
[ -n "$k8s_version" ] || die "cannot find k8s.io/kubernetes in $k8s_mod/go.mod"
[ -n "$etcd_version" ] || die "cannot find go.etcd.io/etcd/server/v3 in $etcd_mod/go.mod"

hash_files() { # files... -> short content hash (names relative to hack/go)
	(cd "$here/go" && sha256sum "$@" && printf '%s\n' "$go_version") | sha256sum | cut -c1-12
}
harness_files=$(cd "$here/go" && find k8s/kubelet-harness -type f -name '*.go' | LC_ALL=C sort)
stub_files=$(cd "$here/go" && find k8s/stubplugin -type f -name '*.go' | LC_ALL=C sort)
# shellcheck disable=SC2086
k8s_hash=$(hash_files k8s/go.mod k8s/go.sum)
etcd_hash=$(hash_files etcd/go.mod etcd/go.sum)
# shellcheck disable=SC2086
harness_hash=$(hash_files k8s/go.mod k8s/go.sum $harness_files)
# shellcheck disable=SC2086
stub_hash=$(hash_files k8s/go.mod k8s/go.sum $stub_files)
# shellcheck disable=SC2086
all_hash=$(hash_files k8s/go.mod k8s/go.sum etcd/go.mod etcd/go.sum $harness_files $stub_files)

cache=${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}
bin="$cache/bin/k8s-${k8s_version}_etcd-${etcd_version}_${all_hash}"
objs="$cache/objs"

have_all() {
	[ -x "$bin/kube-apiserver" ] && [ -x "$bin/etcd" ] && [ -x "$bin/kubelet-harness" ] && [ -x "$bin/stub-device-plugin" ]
}

# Fast path: everything is there; no lock, no go invocation beyond the above.
if have_all; then
	printf '%s\n' "$bin"
	exit 0
fi

mkdir -p "$bin" "$objs"
# One builder at a time per cache (parallel test sessions on one machine).
exec 9>"$cache/.build.lock"
if ! flock -n 9; then
	log "another build-go.sh is running; waiting for it"
	flock 9
fi

ldflags_k8s() { # version stamping as kubernetes' hack/lib/version.sh does it
	local minor ld="-s -w" kv
	minor=${k8s_version#v1.}
	minor=${minor%%.*}
	for kv in "gitVersion=$k8s_version" gitMajor=1 "gitMinor=$minor" gitTreeState=clean \
		gitCommit=module-build "buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; do
		ld="$ld -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
	done
	printf '%s' "$ld"
}

# build <name> <version> <object key> <module dir> <package> <ldflags> <estimate>
build() {
	local name=$1 version=$2 key=$3 dir=$4 pkg=$5 ld=$6 estimate=$7
	local obj="$objs/$name-$key"
	if [ ! -x "$obj" ]; then
		log "building $name $version ($estimate)…"
		local start=$SECONDS tmp="$obj.tmp.$$"
		# Build into a temporary name and rename: a killed build never leaves
		# a half-written binary under the final name.
		trap 'rm -f "$tmp"' EXIT
		(cd "$dir" && go build -trimpath -ldflags "$ld" -o "$tmp" "$pkg") ||
			die "go build of $name failed (see above)"
		mv -f "$tmp" "$obj"
		trap - EXIT
		log "built $name in $((SECONDS - start))s"
	fi
	if [ ! -x "$bin/$name" ]; then
		ln -f "$obj" "$bin/$name.tmp.$$" 2>/dev/null || cp -f "$obj" "$bin/$name.tmp.$$"
		mv -f "$bin/$name.tmp.$$" "$bin/$name"
	fi
}

build kube-apiserver "$k8s_version" "${k8s_version}_${k8s_hash}" "$k8s_mod" \
	k8s.io/kubernetes/cmd/kube-apiserver "$(ldflags_k8s)" \
	"first run takes ~10 min on 2 cores; ~40 s to relink when only go.mod/go.sum changed"
build etcd "$etcd_version" "${etcd_version}_${etcd_hash}" "$etcd_mod" \
	go.etcd.io/etcd/server/v3 "-s -w" "first run takes ~2 min on 2 cores"
build kubelet-harness "(k8s $k8s_version)" "${k8s_version}_${harness_hash}" "$k8s_mod" \
	./kubelet-harness "$(ldflags_k8s)" "~1-2 min on a cold cache, ~15 s after a harness edit"
build stub-device-plugin "(k8s $k8s_version)" "${k8s_version}_${stub_hash}" "$k8s_mod" \
	./stubplugin "-s -w" "a test peer for the harness: seconds"

have_all || die "internal error: binaries missing in $bin"
printf '%s\n' "$bin"
