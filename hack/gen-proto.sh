#!/usr/bin/env bash
# Regenerates the kubelet API stubs in sharing/kubelet/api/ from proto/sharing/kubelet/api/*.proto
# (messages, .pyi stubs, gRPC services). Protos live under proto/<package path> and protoc runs with
# -I proto, so generated imports are absolute (`from sharing.kubelet.api import ...`).
#   hack/gen-proto.sh          write the stubs
#   hack/gen-proto.sh --check  fail (exit 1) when the committed stubs differ from fresh ones
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -z "${VIRTUAL_ENV:-}" ] && ! python -c 'import grpc_tools' 2>/dev/null; then
  PATH="$(hack/venv.sh)/bin:$PATH"
fi
out=sharing/kubelet/api
check=false
case "${1:-}" in
  --check) check=true ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m grpc_tools.protoc -I proto \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  proto/sharing/kubelet/api/*.proto

generated() { (cd "$1" && find . -name '*_pb2*.py' -o -name '*_pb2*.pyi' | sort); }

if $check; then
  if ! diff -u <(generated "$tmp/$out") <(generated "$out") >&2 ||
     ! diff -ru --exclude=__init__.py --exclude=__pycache__ "$tmp/$out" "$out" >&2; then
    echo "FAILED: $out is stale; run hack/gen-proto.sh and commit the result" >&2
    exit 1
  fi
  echo "$out is up to date" >&2
  exit 0
fi
mkdir -p "$out"
find "$out" \( -name '*_pb2*.py' -o -name '*_pb2*.pyi' \) -delete
cp "$tmp/$out"/*_pb2*.py* "$out/"
echo "wrote $(generated "$out" | wc -l) files to $out" >&2
