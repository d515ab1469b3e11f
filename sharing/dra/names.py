"""Names the DRA front-end shares with NVIDIA's DRA driver, and the device names of our pool.

A claim written for NVIDIA's driver (kubernetes-sigs/dra-driver-nvidia-gpu) must work unchanged, so
the driver name, the DeviceClass names and the attribute names are NVIDIA's. Device names are DNS
labels (resource.k8s.io/v1 `Device.name`) that round-trip to the inventory's devices.
"""

from __future__ import annotations

from dataclasses import replace

from sharing.devices.inventory import Device

DRIVER = "gpu.nvidia.com"
"""The driver name: ResourceSlice `spec.driver`, allocation results' `driver`, the registration name."""
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"


def device_name(device: Device) -> str:
    """`gpu-0` for GPU 0, `gpu-0-mig-1` for its MIG device 1, `-replica-<n>` appended for replica n."""
    gpu, _, mig = device.index.partition(":")
    name = f"gpu-{gpu}" + (f"-mig-{mig}" if mig else "")
    return name if device.replica is None else f"{name}-replica-{device.replica}"


def pool_device_name(device: Device) -> str:
    """The name a device has in the pool: replicas are shares of one device (consumable capacity,
    `allowMultipleAllocations`), so every replica of a device has its device's name."""
    return device_name(replace(device, replica=None))


CDI_KIND = f"k8s.{DRIVER}/claim"
"""The CDI kind of the per-claim specs; device names are `<claim UID>-<device name>`, so a runtime's
cached spec of a deleted claim never matches a new one (the Go helper's advice, k8s.io/
dynamic-resource-allocation kubeletplugin/draplugin.go; NVIDIA's driver and dra-example-driver name
theirs the same way)."""

PLUGIN_TYPE = "DRAPlugin"
"""PluginInfo.type of a DRA driver (k8s.io/kubelet pkg/apis/pluginregistration/v1/constants.go)."""
DRA_SERVICE = "v1.DRAPlugin"
"""The DRA service version the kubelet looks for in supported_versions (k8s.io/kubelet
pkg/apis/dra/v1/types.go, DRAPluginService)."""
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
"""The health service's gRPC name, which the Go helper adds to supported_versions when a driver serves
it (k8s.io/dynamic-resource-allocation v0.36.3 kubeletplugin/draplugin.go) and the kubelet looks for
before it opens NodeWatchResources (k8s.io/kubernetes pkg/kubelet/cm/dra/plugin, pickHealthService)."""
SUPPORTED_VERSIONS = (DRA_SERVICE, HEALTH_SERVICE)


def dra_socket(instance: str) -> str:
    """The DRA service's socket of one agent process, in `<kubelet plugins dir>/<driver>/`.

    Each instance has its own sockets, as the Go helper's `RollingUpdate` option makes them
    (k8s.io/kubernetes pkg/kubelet/pluginmanager/pluginwatcher/README.md, "Seamless Upgrade"): with
    one name for all, a new instance unlinks and binds the name while the kubelet unregisters the
    old one, and a failed registration backs off for the next instance too (the kubelet's plugin
    manager keys its exponential backoff, up to 2 min, by the socket's path)."""
    return f"dra-{instance}.sock"


def registration_socket(instance: str) -> str:
    """The registration socket of one agent process, in the kubelet's plugins_registry dir."""
    return f"{DRIVER}-{instance}-reg.sock"


LEGACY_SOCKETS = ("dra.sock", f"{DRIVER}-reg.sock")
"""The names every instance used before they had their own (removed when nothing answers there)."""
CHECKPOINT = "claims.json"
"""The checkpoint of prepared claims, beside the DRA socket."""


def claim_cdi_name(claim_uid: str, device: str) -> str:
    """The CDI device name of a claim's device (without the kind)."""
    return f"{claim_uid}-{device}"


def claim_cdi_file(claim_uid: str) -> str:
    """The file name of a claim's CDI spec in the CDI spec directory."""
    return f"{CDI_KIND.replace('/', '-')}_{claim_uid}.json"


def profile_slug(profile: str) -> str:
    """A MIG profile as a DNS-label part: `1g.5gb` -> `1g-5gb`, `1g.10gb+me` -> `1g-10gb-me`."""
    return profile.lower().replace(".", "-").replace("+", "-")


def ondemand_device_name(gpu_index: int, profile: str, start: int) -> str:
    """The device of an on-demand MIG slice of `profile` placed at memory slice `start` of GPU `gpu_index`."""
    return f"gpu-{gpu_index}-mig-{profile_slug(profile)}-at-{start}"


def parse_ondemand_name(name: str) -> tuple[int, str, int] | None:
    """(GPU index, profile slug, placement start) of an on-demand device name, or None for any other."""
    head, sep, start = name.rpartition("-at-")
    gpu, mig, slug = head.partition("-mig-")
    if not (sep and mig and gpu.startswith("gpu-") and start.isdigit() and gpu[4:].isdigit() and slug):
        return None
    return int(gpu[4:]), slug, int(start)
