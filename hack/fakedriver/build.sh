#!/usr/bin/env bash
# Build the fake NVIDIA driver (hack/fakedriver/README.md) into a cache directory OUTSIDE the
# repository and print its driver root (one line on stdout; progress on stderr):
#
#   ROOT=$(hack/fakedriver/build.sh)
#   ROOT=$(hack/fakedriver/build.sh --install DIR)   # also copy usr/ into DIR (a node's driver
#                                                    # root; the state goes in DIR/var/lib/fake-nvidia)
#   ${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}/fakedriver/<key>/
#     usr/lib/x86_64-linux-gnu/libnvidia-ml.so.<version>   the fake NVML (+ libnvidia-ml.so.1 link)
#     usr/lib/x86_64-linux-gnu/libcuda.so.<version>        stand-in (+ libcuda.so.1 link)
#     usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.<version>  stand-in (+ .so.1 link)
#     usr/bin/nvidia-smi                                   stand-in over the fake NVML
#     usr/bin/nvidia-cuda-mps-control                      MPS control daemon stand-in (src/mpsctl.c)
#
# <key> hashes the sources, this script, and the versions of NVIDIA's header and of jansson, so
# unchanged inputs never rebuild. The header is NVIDIA's own nvml.h from the PyPI package
# nvidia-nvml-dev; jansson (JSON) is built from Debian's source package (apt-get source) as a position-independent
# static library and linked in, so the library needs nothing but libc in any container. Both are
# pinned by SHA-256 and kept in <cache>/fakedriver/deps/. On a machine without a C toolchain it
# installs gcc, make and cmake with apt-get (CI runs it on a fresh machine).
set -euo pipefail

install=""
case ${1:-} in
--install) install=${2:?"--install needs a directory"} ;;
"") ;;
*) printf '%s\n' "usage: $0 [--install DIR]" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
log() { printf '%s\n' "fakedriver: $*" >&2; }
die() { log "error: $*"; exit 1; }

NVML_DEV_VERSION=13.4.92
NVML_DEV_WHEEL=nvidia_nvml_dev-$NVML_DEV_VERSION-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
NVML_DEV_SHA256=90b65cebefd02a1e695675177c9d7886f48322906ce5c03398e8cb27cc5ad2d6
JANSSON_VERSION=2.14
# The Debian source package whose upstream tarball that is (Debian 12).
JANSSON_SOURCE=jansson=2.14-2
JANSSON_SHA256=c739578bf6b764aa0752db9a2fdadcfe921c78f1228c7ec0bb47fa804c55d17b
# The version the library files are named after, as the driver's installer names them.
DRIVER_VERSION=580.65.06

cache=${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}/fakedriver
key=$( { cd "$here" && sha256sum build.sh src/*; echo "$NVML_DEV_VERSION $JANSSON_VERSION $DRIVER_VERSION"; } \
	| sha256sum | cut -c1-12)
root=$cache/$key
# Copies, not links: a container that mounts DIR sees whole files. Replaced by rename, so a
# process that has the library loaded keeps its copy.
done_with() { # <built root>
	if [ -n "$install" ]; then
		mkdir -p "$install/usr/lib/x86_64-linux-gnu" "$install/usr/bin"
		local f
		for f in "$1"/usr/lib/x86_64-linux-gnu/* "$1"/usr/bin/*; do
			local to=$install/${f#"$1"/}
			cp -P "$f" "$to.tmp.$$" && mv -f "$to.tmp.$$" "$to"
		done
		printf '%s\n' "$(cd "$install" && pwd)"
	else
		printf '%s\n' "$1"
	fi
	exit 0
}
[ ! -f "$root/.complete" ] || done_with "$root"

mkdir -p "$cache/deps"
exec 9>"$cache/.build.lock" # one builder at a time per cache
flock 9
[ ! -f "$root/.complete" ] || done_with "$root"

need=()
for tool in gcc make cmake; do command -v "$tool" >/dev/null 2>&1 || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
	command -v apt-get >/dev/null 2>&1 || die "missing ${need[*]} and no apt-get to install them"
	log "installing ${need[*]} (apt-get)"
	packages=()
	for tool in "${need[@]}"; do case $tool in gcc) packages+=(gcc libc6-dev) ;; *) packages+=("$tool") ;; esac; done
	sudo=""
	[ "$(id -u)" = 0 ] || sudo=sudo
	$sudo apt-get update -qq >&2 && $sudo apt-get install -y -qq "${packages[@]}" >&2 || die "apt-get install failed"
fi

verify() { # <file> <sha256>
	[ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ] || { rm -f "$1"; die "$1: SHA-256 mismatch (expected $2)"; }
}

# NVIDIA's nvml.h: every signature, struct and constant of the library comes from it.
header=$cache/deps/nvml-$NVML_DEV_VERSION/nvml.h
if [ ! -f "$header" ]; then
	log "downloading nvidia-nvml-dev $NVML_DEV_VERSION (NVIDIA's nvml.h) with pip"
	tmp=$(mktemp -d)
	pip=("$("$repo/hack/venv.sh")/bin/python" -m pip)
	"${pip[@]}" download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
		"nvidia-nvml-dev==$NVML_DEV_VERSION" -d "$tmp" >&2 \
		|| die "pip download nvidia-nvml-dev==$NVML_DEV_VERSION failed"
	verify "$tmp/$NVML_DEV_WHEEL" "$NVML_DEV_SHA256"
	mkdir -p "$(dirname "$header")"
	"${pip[0]}" -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("nvidia/cu13/include/nvml.h"))' \
		"$tmp/$NVML_DEV_WHEEL" >"$header.tmp"
	mv "$header.tmp" "$header"
	rm -rf "$tmp"
fi

# jansson's source, by package name with apt: the machine's own Debian sources as deb-src entries,
# in a private apt state (the machine's apt configuration is left as it is).
fetch_jansson() { # <dir>
	local apt=$1/apt parts
	parts=$apt/sources.list.d
	mkdir -p "$parts" "$apt/lists/partial" "$apt/cache/archives/partial"
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[ -f "$f" ] && sed -n 's/^deb \(.*debian.*\)$/deb-src \1/p' "$f"
	done >"$parts/src.list"
	for f in /etc/apt/sources.list.d/*.sources; do
		[ -f "$f" ] && sed 's/^Types: deb$/Types: deb-src/' "$f" >"$parts/$(basename "$f")"
	done
	local opts=(-o "Dir::Etc::SourceList=$parts/src.list" -o "Dir::Etc::SourceParts=$parts"
		-o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "APT::Sandbox::User=root")
	apt-get "${opts[@]}" -qq update >&2 || die "apt-get update (deb-src) failed"
	(cd "$1" && apt-get "${opts[@]}" -qq source --download-only "$JANSSON_SOURCE" >&2) \
		|| die "apt-get source $JANSSON_SOURCE failed"
}

jansson=$cache/deps/jansson-$JANSSON_VERSION
if [ ! -f "$jansson/lib/libjansson.a" ]; then
	log "building jansson $JANSSON_VERSION (static, position-independent)"
	tmp=$(mktemp -d)
	fetch_jansson "$tmp"
	verify "$tmp/jansson_$JANSSON_VERSION.orig.tar.gz" "$JANSSON_SHA256"
	tar -xzf "$tmp/jansson_$JANSSON_VERSION.orig.tar.gz" -C "$tmp"
	cmake -S "$tmp/jansson-$JANSSON_VERSION" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release \
		-DCMAKE_POSITION_INDEPENDENT_CODE=ON -DCMAKE_C_FLAGS=-fvisibility=hidden \
		-DJANSSON_BUILD_SHARED_LIBS=OFF -DJANSSON_BUILD_DOCS=OFF -DJANSSON_WITHOUT_TESTS=ON \
		-DJANSSON_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$jansson.tmp" >&2 \
		&& cmake --build "$tmp/build" --target install -j2 >&2 || die "jansson build failed"
	rm -rf "$jansson"
	mv "$jansson.tmp" "$jansson"
	rm -rf "$tmp"
fi

log "building the fake driver into $root"
rm -rf "$root.tmp"
mkdir -p "$root.tmp/usr/lib/x86_64-linux-gnu" "$root.tmp/usr/bin"
out=$root.tmp/usr/lib/x86_64-linux-gnu
# -Wno-format-truncation: snprintf cuts paths past PATH_MAX on purpose (no such path could be opened).
cflags=(-O2 -g -Wall -Wextra -Wno-format-truncation -fPIC -fvisibility=hidden -I"$(dirname "$header")" -I"$jansson/include")
# -fvisibility=hidden and --exclude-libs: the library exports exactly the NVML symbols (FAKE_EXPORT).
gcc "${cflags[@]}" -shared -Wl,-soname,libnvidia-ml.so.1 -Wl,--exclude-libs,ALL -Wl,-z,defs \
	-o "$out/libnvidia-ml.so.$DRIVER_VERSION" "$here"/src/{state,device,usage,gpm,mig,compute,events,files,mps}.c \
	"$jansson/lib/libjansson.a" -lpthread
for name in libcuda libnvidia-ptxjitcompiler; do
	gcc "${cflags[@]}" -shared -Wl,-soname,$name.so.1 -o "$out/$name.so.$DRIVER_VERSION" "$here/src/stub.c"
done
for name in libnvidia-ml libcuda libnvidia-ptxjitcompiler; do
	ln -s "$name.so.$DRIVER_VERSION" "$out/$name.so.1"
done
for tool in nvidia-smi:smi nvidia-cuda-mps-control:mpsctl; do
	gcc "${cflags[@]}" -o "$root.tmp/usr/bin/${tool%%:*}" "$here/src/${tool#*:}.c" -L"$out" -l:libnvidia-ml.so.1 \
		-Wl,-rpath,'$ORIGIN/../lib/x86_64-linux-gnu'
done
touch "$root.tmp/.complete"
rm -rf "$root"
mv "$root.tmp" "$root"
done_with "$root"
