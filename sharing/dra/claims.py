"""What a ResourceClaim asks of this node: which of its allocation results are ours, the devices they
name looked up among ours, its opaque config checked. Pure: a claim and the inventory in, devices or a
`ClaimError` that says why out.

The kubelet hands the plugin only a claim's namespace, name and UID; the plugin reads the claim and
uses the allocation results whose driver is its own (dra/v1 api.proto, NodePrepareResources; the Go
helper, k8s.io/dynamic-resource-allocation kubeletplugin/draplugin.go). A result for our driver in
another pool, or naming a device this node does not have, is refused: a device the hardware lacks is
never handed out.

Opaque config (`status.allocation.devices.config[].opaque` with our driver) is NVIDIA's
`resource.nvidia.com/v1beta1` API, so a claim written for NVIDIA's DRA driver reads the same here
(https://github.com/kubernetes-sigs/dra-driver-nvidia-gpu/blob/main/site/content/docs/reference/api.md):
`GpuConfig` for whole GPUs, `MigDeviceConfig` for MIG devices, each with an optional `sharing`. How a
GPU the node's config partitions is shared is that config's business, not the claim's, so what would
change it per claim (MPS on a whole GPU or on a MIG device the config makes, a time-slice interval) is
refused with a message that says so, as is any field NVIDIA's strict decoder would refuse too (unknown
keys). A MIG device made on demand for the claim (`sharing.dra.ondemand`) is the claim's alone, so its
sharing is the claim's to choose: `strategy: MPS` with NVIDIA's `mpsConfig` (api/nvidia.com/resource/
v1beta1/sharing.go `MpsConfig`: `defaultActiveThreadPercentage`, `defaultPinnedDeviceMemoryLimit`,
`defaultPerDevicePinnedMemoryLimit`) gets the device an MPS control daemon of its own, whose defaults
are those limits (`MpsRequest`). The limits are checked as NVIDIA's driver checks them (a percentage of
1 to 100, a memory limit of at least one MiB, cmd/gpu-kubelet-plugin/device_state.go and sharing.go
`Normalize`), and a container is the client of one daemon, so MPS is asked for one MIG device a claim.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

from sharing.devices import Device, Inventory, MpsSettings
from sharing.dra.names import CDI_KIND, DRIVER, claim_cdi_name, parse_ondemand_name, pool_device_name
from sharing.errors import PluginError
from sharing.kube.api import AllocatedConfig, AllocatedDevice, ResourceClaimObject
from sharing.store import PreparedDevice
from sharing.text import bounded

CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG = "GpuConfig"
MIG_CONFIG = "MigDeviceConfig"
TIME_SLICING = "TimeSlicing"
MPS = "MPS"
MPS_FIELDS = {
    "defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit", "defaultPerDevicePinnedMemoryLimit",
    "multiUser",
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
"""A Kubernetes quantity without exponent or fractional suffixes (k8s.io/apimachinery pkg/api/resource
quantity.go: binary suffixes Ki..Ei, decimal k..E)."""
_MULTIPLIERS = {
    None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


class ClaimError(PluginError):
    """A claim this node cannot prepare; the message goes to the kubelet, which puts it on the pod."""


@dataclass(frozen=True, slots=True)
class ClaimKey:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class Chosen:
    """An allocation result of our driver and the inventory device it names."""

    result: AllocatedDevice
    device: Device


@dataclass(frozen=True, slots=True)
class MpsRequest:
    """What a claim's `mpsConfig` asks of the MPS control daemon of its on-demand MIG device: its
    clients' default limits, None where the claim sets none."""

    active_thread_percentage: int | None = None
    pinned_memory_mib: int | None = None
    memory_path: str = ""
    """Where the memory limit was written (for the message when the device is smaller)."""

    def settings(self, ref: str, device: str, profile: str, memory_mib: int) -> MpsSettings:
        """The daemon's defaults on a device of `memory_mib`: what is not limited is the whole device
        (every thread, all its memory); ClaimError when the limit is more memory than the device has."""
        memory = self.pinned_memory_mib
        if memory is not None and memory > memory_mib:
            raise ClaimError(
                f"claim {ref}: {self.memory_path}: {memory} MiB is more than the {memory_mib} MiB of its "
                f"{profile} device {device}"
            )
        # One claim, one set of limits: its daemon's defaults are the claim's own, not a share of them.
        threads = self.active_thread_percentage
        return MpsSettings(1, 100 if threads is None else threads, memory_mib if memory is None else memory)


def claim_ref(claim: ResourceClaimObject) -> str:
    """`namespace/name` of the claim, as messages name it."""
    return f"{claim.namespace}/{claim.name}"


def select(claim: ResourceClaimObject, pool: str, devices: Mapping[str, Device]) -> tuple[Chosen, ...]:
    """The claim's results for our driver, each with the device `devices` ({DRA name: device}) has.

    ClaimError when the claim is not allocated, a result of our driver is for another pool, or it
    names a device this node does not have. On-demand devices (made at prepare) are left out: see
    `ondemand_results`.
    """
    if not claim.allocated:
        raise ClaimError(f"claim {claim_ref(claim)} is not allocated yet (no status.allocation)")
    chosen = []
    for i, result in enumerate(claim.results):
        if result.driver != DRIVER:
            continue
        where = f"claim {claim_ref(claim)}: status.allocation.devices.results[{i}]"
        if result.pool != pool:
            raise ClaimError(
                f"{where}: device {bounded(result.device, 80)} of pool {bounded(result.pool, 80)} is not "
                f"on this node (pool {pool})"
            )
        if parse_ondemand_name(result.device) is not None:
            continue
        device = devices.get(result.device)
        if device is None:
            raise ClaimError(
                f"{where}: device {bounded(result.device, 80)} is not one this node has now "
                f"(it has {_listing(devices)}); the claim was allocated from an out-of-date ResourceSlice: "
                "delete the claim (or its pod) so that it is allocated again"
            )
        chosen.append(Chosen(result, device))
    return tuple(chosen)


def devices_by_name(inventory: Inventory) -> Mapping[str, Device]:
    """{pool device name: device} of everything the node offers (a replicated device once: its
    replicas are shares of it)."""
    found: dict[str, Device] = {}
    for _, devices in inventory.resources:
        for d in devices:
            found.setdefault(pool_device_name(d), d)
    return found


def prepared_device(uid: str, chosen: Chosen) -> PreparedDevice:
    """A chosen device as claim `uid` gets it (and the checkpoint keeps it)."""
    return PreparedDevice(
        # The kubelet matches a container's `resources.claims[].request` against these, so a
        # prioritized list's `<request>/<subrequest>` is named by its request, as the Go helper
        # names it (kubeletplugin/draplugin.go, stripSubrequestNames).
        requests=(chosen.result.request.partition("/")[0],),
        pool=chosen.result.pool,
        device=chosen.result.device,
        uuid=chosen.device.uuid,
        gpu_uuid=chosen.device.gpu_uuid,
        cdi_ids=(f"{CDI_KIND}={claim_cdi_name(uid, chosen.result.device)}",),
        share_id=chosen.result.share_id,
        admin_access=chosen.result.admin_access,
    )


def ondemand_results(claim: ResourceClaimObject) -> tuple[AllocatedDevice, ...]:
    """The claim's results of our driver that name an on-demand MIG device (a slice to make)."""
    return tuple(r for r in claim.results if r.driver == DRIVER and parse_ondemand_name(r.device) is not None)


def check_config(claim: ResourceClaimObject, chosen: Sequence[Chosen]) -> dict[str, MpsRequest]:
    """{device name: what its MPS daemon is asked} of the claim's on-demand MIG devices shared with MPS;
    ClaimError when an opaque config entry for our driver is not one this driver accepts."""
    mps: dict[str, MpsRequest] = {}
    for i, config in enumerate(claim.config):
        if config.driver != DRIVER:
            continue
        where = f"claim {claim_ref(claim)}: status.allocation.devices.config[{i}].opaque.parameters"
        kind, request = _check_parameters(config.parameters, where)
        for c in _applies_to(config, chosen):
            is_mig = c.device.mig_uuid is not None
            if config.requests and is_mig != (kind == MIG_CONFIG):
                wanted, what = (MIG_CONFIG, "a MIG device") if is_mig else (GPU_CONFIG, "a whole GPU")
                raise ClaimError(
                    f"{where}: a {kind} for request {c.result.request!r}, whose device "
                    f"{c.result.device} is {what}: use kind {wanted}"
                )
            if request is None or not is_mig:
                continue
            if parse_ondemand_name(c.result.device) is None:
                raise ClaimError(
                    f"{where}.sharing: MPS is served on MIG devices made on demand for the claim (`mig: "
                    f"dynamic`); {c.result.device} is a MIG device the node's config makes, shared as that "
                    "config says: remove sharing (or use strategy TimeSlicing)"
                )
            mps[c.result.device] = request
    if len(mps) > 1:
        raise ClaimError(
            f"claim {claim_ref(claim)}: MPS is asked for {len(mps)} MIG devices ({', '.join(sorted(mps))}), "
            "but a container is the client of one MPS control daemon and each MIG device has its own: "
            "ask for one MIG device in a claim shared with MPS"
        )
    return mps


def _applies_to(config: AllocatedConfig, chosen: Sequence[Chosen]) -> Iterable[Chosen]:
    """The results a config entry is for: all when it names no request; a request name also covers its
    subrequests (`<request>/<subrequest>`, resource/v1 DeviceAllocationConfiguration.requests)."""
    if not config.requests:
        return chosen
    return (
        c
        for c in chosen
        if any(c.result.request == r or c.result.request.startswith(r + "/") for r in config.requests)
    )


def _check_parameters(parameters: Mapping[str, Any], where: str) -> tuple[str, MpsRequest | None]:
    """The config's kind and what it asks of MPS (None: no MPS) once its shape is one this driver
    accepts; ClaimError naming the field if not."""
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if api_version != CONFIG_API_VERSION or kind not in (GPU_CONFIG, MIG_CONFIG):
        raise ClaimError(
            f"{where}: apiVersion {_shown(api_version)}, kind {_shown(kind)} is not a config of driver "
            f"{DRIVER}: use apiVersion {CONFIG_API_VERSION} with kind {GPU_CONFIG} (whole GPUs) or "
            f"{MIG_CONFIG} (MIG devices)"
        )
    _known(parameters, {"apiVersion", "kind", "sharing"}, where)
    sharing = parameters.get("sharing")
    if sharing is None:
        return str(kind), None
    where = f"{where}.sharing"
    if not isinstance(sharing, Mapping):
        raise ClaimError(f"{where}: expected an object, got {_shown(sharing)}")
    _known(sharing, {"strategy", "timeSlicingConfig", "mpsConfig"}, where)
    strategy = sharing.get("strategy")
    if strategy not in (TIME_SLICING, MPS):
        raise ClaimError(f"{where}.strategy: {_shown(strategy)} is not {TIME_SLICING} or {MPS}")
    if kind == MIG_CONFIG and "timeSlicingConfig" in sharing:
        raise ClaimError(f"{where}.timeSlicingConfig: a MIG device has no time-slice interval; remove it")
    if strategy == MPS:
        if kind == GPU_CONFIG:
            raise ClaimError(
                f"{where}: MPS is not chosen per claim for whole GPUs on this driver: the node's sharing "
                "config decides how its GPUs are shared; remove sharing (or use strategy TimeSlicing)"
            )
        if "timeSlicingConfig" in sharing:  # NVIDIA's words (sharing.go GetMpsConfig)
            raise ClaimError(
                f"{where}.timeSlicingConfig: cannot use TimeSlicingConfig with the 'MPS' strategy"
            )
        return str(kind), _mps_request(sharing.get("mpsConfig"), f"{where}.mpsConfig")
    if "mpsConfig" in sharing:  # NVIDIA's words (sharing.go GetTimeSlicingConfig)
        raise ClaimError(f"{where}.mpsConfig: cannot use MpsConfig with the 'TimeSlicing' strategy")
    slicing = sharing.get("timeSlicingConfig")
    if slicing is None:
        return str(kind), None
    if not isinstance(slicing, Mapping):
        raise ClaimError(f"{where}.timeSlicingConfig: expected an object, got {_shown(slicing)}")
    _known(slicing, {"interval"}, f"{where}.timeSlicingConfig")
    interval = slicing.get("interval", "Default")
    if interval != "Default":
        raise ClaimError(
            f"{where}.timeSlicingConfig.interval: {_shown(interval)}: this driver leaves the time-slice "
            "interval at the GPU driver's default; remove it or set it to Default"
        )
    return str(kind), None


def _mps_request(config: object, where: str) -> MpsRequest:
    """NVIDIA's `MpsConfig` for one MIG device; none given: a daemon without limits."""
    if config is None:
        return MpsRequest()
    if not isinstance(config, Mapping):
        raise ClaimError(f"{where}: expected an object, got {_shown(config)}")
    _known(config, MPS_FIELDS, where)
    threads = config.get("defaultActiveThreadPercentage")
    if threads is not None and (type(threads) is not int or not 1 <= threads <= 100):
        raise ClaimError(
            f"{where}.defaultActiveThreadPercentage: {_shown(threads)} is not a whole percentage "
            "from 1 to 100"
        )
    multi = config.get("multiUser", False)
    if multi is not False:
        raise ClaimError(
            f"{where}.multiUser: {_shown(multi)}: this driver starts MPS control daemons in single-user "
            "mode, as it does for the node's MPS GPUs: run the claim's containers as one user and remove it"
        )
    memory_path = f"{where}.defaultPinnedDeviceMemoryLimit"
    memory = None
    if config.get("defaultPinnedDeviceMemoryLimit") is not None:
        memory = _mib(config["defaultPinnedDeviceMemoryLimit"], memory_path)
    per_device = config.get("defaultPerDevicePinnedMemoryLimit")
    if per_device is not None:
        if not isinstance(per_device, Mapping):
            raise ClaimError(
                f"{where}.defaultPerDevicePinnedMemoryLimit: expected an object, got {_shown(per_device)}"
            )
        for key, value in per_device.items():
            path = f"{where}.defaultPerDevicePinnedMemoryLimit.{bounded(str(key), 60)}"
            if key != "0":
                why = (
                    "the MIG device is made at prepare, so its UUID is not known when the claim is written"
                    if not str(key).isdigit()
                    else "the daemon serves one device"
                )
                raise ClaimError(f"{path}: {why}: key the limit by device index 0")
            memory, memory_path = _mib(value, path), path  # it overrides the default (sharing.go Normalize)
    return MpsRequest(threads, memory, memory_path if memory is not None else "")


def _mib(value: object, where: str) -> int:
    """A memory limit (a Kubernetes quantity: `4Gi`, `512Mi`, `1G`, or bytes) in whole MiB, as NVIDIA's
    driver hands it to the daemon (sharing.go `Megabyte`: bytes / 1024 / 1024, at least 1)."""
    text = str(value) if type(value) is int else value
    match = _QUANTITY.match(text) if isinstance(text, str) else None
    if match is None:
        raise ClaimError(f"{where}: {_shown(value)} is not a memory size such as 4Gi, 512Mi or 1G")
    size = (Decimal(match[1]) * _MULTIPLIERS[match[2]]).to_integral_value(ROUND_CEILING)
    mib = int(size) // 2**20
    if mib < 1:
        raise ClaimError(f"{where}: {_shown(value)} is less than 1Mi (value set too low)")
    return mib


def _known(obj: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise ClaimError(
            f"{where}: unknown field {bounded(unknown[0], 60)!r} (known: {', '.join(sorted(allowed))})"
        )


def _shown(value: object) -> str:
    return "none" if value is None else bounded(repr(value), 80)


def _listing(devices: Mapping[str, Device]) -> str:
    names = sorted(devices)
    if not names:
        return "no devices"
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")
