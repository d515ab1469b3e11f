"""Names the DRA front-end shares with NVIDIA's DRA driver, and the device names of our pool.

A claim written for NVIDIA's driver (kubernetes-sigs/dra-driver-nvidia-gpu) must work unchanged, so
the driver name, the DeviceClass names and the attribute names are NVIDIA's. Device names are DNS
labels (resource.k8s.io/v1 `Device.name`) that round-trip to the inventory's devices.
"""

from __future__ import annotations

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
