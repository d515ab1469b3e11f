"""Generated protobuf and gRPC stubs for the kubelet APIs (device plugin v1beta1, PodResources v1,
DRA plugin v1, plugin registration v1, DRA resource health v1alpha1).

Do not edit: `hack/gen-proto.sh` writes everything here but this file from `proto/`, and
`hack/gen-proto.sh --check` (run by hack/test.sh) fails when the stubs are stale. Only
`sharing.deviceplugin`, `sharing.dra` and `sharing.kubelet` import this package.
"""
