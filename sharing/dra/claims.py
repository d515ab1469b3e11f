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
GPU is shared on this node is the node's sharing config, not the claim's, so what would change it per
claim (MPS, a time-slice interval) is refused with a message that says so, as is any field NVIDIA's
strict decoder would refuse too (unknown keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sharing.devices import Device, Inventory
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


def check_config(claim: ResourceClaimObject, chosen: Sequence[Chosen]) -> None:
    """ClaimError when an opaque config entry for our driver is not one this driver accepts."""
    for i, config in enumerate(claim.config):
        if config.driver != DRIVER:
            continue
        where = f"claim {claim_ref(claim)}: status.allocation.devices.config[{i}].opaque.parameters"
        kind = _check_parameters(config.parameters, where)
        for c in _applies_to(config, chosen):
            is_mig = c.device.mig_uuid is not None
            if config.requests and is_mig != (kind == MIG_CONFIG):
                wanted, what = (MIG_CONFIG, "a MIG device") if is_mig else (GPU_CONFIG, "a whole GPU")
                raise ClaimError(
                    f"{where}: a {kind} for request {c.result.request!r}, whose device "
                    f"{c.result.device} is {what}: use kind {wanted}"
                )


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


def _check_parameters(parameters: Mapping[str, Any], where: str) -> str:
    """The config's kind once its shape is one this driver accepts; ClaimError naming the field if not."""
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
        return str(kind)
    where = f"{where}.sharing"
    if not isinstance(sharing, Mapping):
        raise ClaimError(f"{where}: expected an object, got {_shown(sharing)}")
    _known(sharing, {"strategy", "timeSlicingConfig", "mpsConfig"}, where)
    strategy = sharing.get("strategy")
    if strategy == MPS or "mpsConfig" in sharing:
        raise ClaimError(
            f"{where}: MPS is not chosen per claim on this driver: the node's sharing config decides how "
            "its GPUs are shared; remove sharing (or use strategy TimeSlicing)"
        )
    if strategy != TIME_SLICING:
        raise ClaimError(f"{where}.strategy: {_shown(strategy)} is not {TIME_SLICING} or {MPS}")
    slicing = sharing.get("timeSlicingConfig")
    if slicing is None:
        return str(kind)
    if kind == MIG_CONFIG:
        raise ClaimError(f"{where}.timeSlicingConfig: a MIG device has no time-slice interval; remove it")
    if not isinstance(slicing, Mapping):
        raise ClaimError(f"{where}.timeSlicingConfig: expected an object, got {_shown(slicing)}")
    _known(slicing, {"interval"}, f"{where}.timeSlicingConfig")
    interval = slicing.get("interval", "Default")
    if interval != "Default":
        raise ClaimError(
            f"{where}.timeSlicingConfig.interval: {_shown(interval)}: this driver leaves the time-slice "
            "interval at the GPU driver's default; remove it or set it to Default"
        )
    return str(kind)


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
