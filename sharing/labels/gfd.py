"""GPU feature discovery's labels, with GFD's names and value formats, from the observed node.

Pure. Mirrors k8s-device-plugin's internal/lm: full-GPU labels per model (MIG-enabled GPUs count as
that model, unshared: replicas 0), MIG labels per profile (`mixed`) or in place of the GPU labels
(`single`, with GFD's `-MIG-INVALID` when the node cannot be advertised that way), the driver and
CUDA versions, architecture family and compute capability, machine type, GPU mode, MPS and vGPU.
Where GFD picks one of several models at random (its map order), the most common model wins here.
"""

from __future__ import annotations

import re
from collections import Counter

from sharing.devices import GPU_RESOURCE, Device, Inventory
from sharing.mig import Catalog, Profile, device_profile, geometry
from sharing.model import ComputeInstance, DriverInfo, Gpu, GpuInstance, NodeState

PREFIX = "nvidia.com/"
ENGINES = ("copy", "decoder", "encoder", "jpeg", "ofa")
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]")
VALUE_LIMIT = 63
"""The API server's limit on a label value (k8s.io/apimachinery validation.LabelValueMaxLength)."""


def sanitise(*parts: str) -> str:
    """GFD's product naming: drop characters outside [A-Za-z0-9-_. ], whitespace runs become '-'."""
    cleaned = (re.sub(r"\s+", "-", re.sub(r"[^A-Za-z0-9\-_. ]", "", part).strip()) for part in parts)
    return "-".join(c for c in cleaned if c)


def product_value(*parts: str, shared: bool = False) -> str:
    """GFD's product label: the sanitised parts joined, `-SHARED` when shared, at most 63 characters.

    The rule of k8s-device-plugin's `limitProductName` (internal/lm/resource.go, NVIDIA/k8s-device-
    plugin#1880): only the model (the first part) is cut, so `-MIG-<profile>` and `-SHARED` stay
    whole; the cut model loses trailing `-`, `.` and `_` so the value still ends alphanumeric.
    """
    cleaned = [c for c in (sanitise(p) for p in parts) if c] + (["SHARED"] if shared else [])
    full = "-".join(cleaned)
    if len(full) <= VALUE_LIMIT:
        return full
    suffix = "-".join(cleaned[1:])
    room = VALUE_LIMIT - len(suffix) - 1
    if not suffix or room <= 0:
        return full[:VALUE_LIMIT].rstrip("-._")
    return cleaned[0][:room].rstrip("-._") + "-" + suffix


def label_value(text: str) -> str:
    """A valid Kubernetes label value: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends."""
    value = _LABEL_VALUE.sub("", text.replace(" ", "-"))[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def family(major: int, minor: int) -> str:
    """GFD's architecture family of a CUDA compute capability."""
    names = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell",
             12: "blackwell", 13: "rubin"}  # fmt: skip
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return names.get(major, "undefined")


def node_wide_labels(node: NodeState, mps: bool = False) -> dict[str, str]:
    """present, mig.capable, mps.capable, gpu.mode, gpu.machine and (inside a vGPU guest) vgpu.present.

    `mps`: some GPU is shared with MPS. GFD says `mps.capable=true` only then (internal/lm/nvml.go),
    and fails outright when a GPU has MIG on; here that GPU is simply not one of the MPS ones.
    """
    first_class = node.gpus[0].pci_class
    mode = {0x030000: "graphics", 0x030200: "compute"}.get(first_class or 0, "unknown")
    labels = {
        PREFIX + "gpu.present": "true",
        PREFIX + "mig.capable": _bool(any(g.mig_capable for g in node.gpus)),
        PREFIX + "mps.capable": _bool(mps),
        PREFIX + "gpu.mode": mode,
        PREFIX + "gpu.machine": label_value(node.machine or "") or "unknown",
    }
    if node.virtual:
        labels[PREFIX + "vgpu.present"] = "true"
    return labels


def driver_labels(driver: DriverInfo | None) -> dict[str, str]:
    """The driver and CUDA versions under GFD's new and deprecated keys (cuda.driver*, cuda.runtime*)."""
    labels: dict[str, str] = {}
    if driver is None:
        return labels
    parts = driver.version.split(".")
    if 2 <= len(parts) <= 3 and all(label_value(p) == p for p in parts):
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
        labels |= {
            "cuda.driver.major": major, "cuda.driver.minor": minor, "cuda.driver.rev": rev,
            "cuda.driver-version.major": major, "cuda.driver-version.minor": minor,
            "cuda.driver-version.revision": rev, "cuda.driver-version.full": driver.version,
        }  # fmt: skip
    if driver.cuda_version is not None:
        major_n, minor_n = driver.cuda_version // 1000, driver.cuda_version % 1000 // 10
        labels |= {
            "cuda.runtime.major": str(major_n), "cuda.runtime.minor": str(minor_n),
            "cuda.runtime-version.major": str(major_n), "cuda.runtime-version.minor": str(minor_n),
            "cuda.runtime-version.full": f"{major_n}.{minor_n}",
        }  # fmt: skip
    return {PREFIX + k: v for k, v in labels.items()}


def _advertised(inventory: Inventory) -> list[tuple[str, Device]]:
    return [(name, d) for name, devices in inventory.resources for d in devices]


def full_gpu_labels(
    node: NodeState, inventory: Inventory, mps: frozenset[str] = frozenset()
) -> dict[str, str]:
    """`gpu.*` for one model: GPUs with MIG off win over MIG-enabled ones (which count, unshared).

    `mps`: UUIDs of the GPUs shared with MPS; their replicas make `sharing-strategy=mps`, as GFD writes
    it (internal/lm/resource.go), the product `-SHARED` as under time-slicing.
    """
    off = [g for g in node.gpus if not g.mig_enabled]
    pool = off or list(node.gpus)
    counts = Counter(g.product for g in pool)
    model = min(counts, key=lambda name: (-counts[name], name))
    gpus = [g for g in pool if g.product == model]
    count = sum(g.product == model for g in node.gpus)
    first = gpus[0]
    labels = {"product": product_value(model), "count": str(count), "replicas": "0"}
    labels["sharing-strategy"] = "none"
    if off:
        uuids = {g.uuid for g in gpus}
        advertised = [
            (name, d) for name, d in _advertised(inventory) if d.mig_uuid is None and d.gpu_uuid in uuids
        ]
        replicas = max(Counter(d.uuid for _, d in advertised).values(), default=1)
        renamed = any(name != GPU_RESOURCE for name, d in advertised if d.replica is not None)
        shared = replicas > 1
        by_mps = any(d.gpu_uuid in mps for _, d in advertised if d.replica is not None)
        how = "mps" if by_mps else "time-slicing"
        labels |= {
            "product": product_value(model, shared=shared and not renamed),
            "replicas": str(replicas),
            "sharing-strategy": how if shared else "none",
        }
    if first.memory_mib:
        labels["memory"] = str(first.memory_mib)
    if first.compute_capability is not None and first.compute_capability[0] != 0:
        major, minor = first.compute_capability
        labels |= {"family": family(major, minor), "compute.major": str(major), "compute.minor": str(minor)}
    return {f"{PREFIX}gpu.{k}": v for k, v in labels.items()}


def _profile(gpu: Gpu, gi: GpuInstance, catalog: Catalog) -> Profile | None:
    table = geometry(gpu, catalog)
    return None if table is None else table.profile(gi.profile)


MigDevice = tuple[Gpu, GpuInstance, ComputeInstance]
"""A MIG device: its GPU, GPU instance and compute instance."""


def _mig_labels(
    key: str, where: MigDevice, devices: list[tuple[str, Device]], base: str, catalog: Catalog
) -> dict[str, str]:  # fmt: skip
    """The labels of one MIG profile under `key` (`gpu`, `mig-1g.5gb`); `where`: a MIG device of it.

    A compute instance smaller than its GPU instance (`1c.3g.20gb`) has GFD's values for it, read from
    the MIG device's attributes (internal/resource/nvml-mig-device.go `GetAttributes`): the GPU
    instance's memory and engines (its compute instances share them), its own compute slices
    (`slices.ci`) and multiprocessors, the GPU instance's compute slices (`slices.gi`).
    """
    gpu, gi, ci = where
    physical = {d.uuid for _, d in devices}
    replicas = max(Counter(d.uuid for _, d in devices).values(), default=1)
    renamed = any(name != base for name, d in devices if d.replica is not None)
    shared = replicas > 1
    own = device_profile(gi, ci)
    slices = str(gi.profile.split("g.")[0].split(".")[-1])
    labels = {
        "product": product_value(gpu.product, "MIG", own.replace("+", "."), shared=shared and not renamed),
        "count": str(len(physical)),
        "replicas": str(replicas),
        "sharing-strategy": "time-slicing" if shared else "none",
        "slices.gi": slices,
        "slices.ci": slices,
    }
    profile = _profile(gpu, gi, catalog)
    if profile is not None:
        labels |= {"memory": str(profile.memory_mib), "slices.gi": str(profile.compute_slices),
                   "slices.ci": str(profile.compute_slices)}  # fmt: skip
        if profile.multiprocessors is not None:
            labels["multiprocessors"] = str(profile.multiprocessors)
        if profile.engines is not None:
            e = profile.engines
            counts = (e.copy, e.decoder, e.encoder, e.jpeg, e.ofa)
            labels |= {f"engines.{n}": str(c) for n, c in zip(ENGINES, counts, strict=True)}
    if own != gi.profile:  # a part of its GPU instance: its own compute slices and multiprocessors
        labels["slices.ci"] = str(ci.slices)
        labels.pop("multiprocessors", None)
        if ci.multiprocessors is not None:
            labels["multiprocessors"] = str(ci.multiprocessors)
    return {f"{PREFIX}{key}.{k}": v for k, v in labels.items()}


def _mig_devices(node: NodeState) -> dict[str, MigDevice]:
    return {ci.uuid: (gpu, gi, ci) for gpu in node.gpus if gpu.mig_enabled for gi, ci in gpu.mig_devices}


def mixed_labels(node: NodeState, inventory: Inventory, catalog: Catalog) -> dict[str, str]:
    """`mig-<profile>.*` for every MIG profile present (`+` written `.`, as GFD does), a compute
    instance smaller than its GPU instance under its own (`mig-1c.3g.20gb.*`)."""
    migs = _mig_devices(node)
    by_profile: dict[str, list[tuple[str, Device]]] = {}
    for name, device in _advertised(inventory):
        if device.mig_uuid in migs:
            _, gi, ci = migs[device.mig_uuid]
            by_profile.setdefault(device_profile(gi, ci), []).append((name, device))
    labels: dict[str, str] = {}
    for profile, devices in sorted(by_profile.items()):
        where = migs[devices[0][1].mig_uuid or ""]
        base = PREFIX + "mig-" + profile.replace("+", ".")
        labels |= _mig_labels(base.removeprefix(PREFIX), where, devices, base, catalog)
    return labels


def single_labels(node: NodeState, inventory: Inventory, catalog: Catalog) -> dict[str, str]:
    """`gpu.*` from the MIG devices (one profile on every GPU), or GFD's `-MIG-INVALID` labels."""
    enabled = [g for g in node.gpus if g.mig_enabled]
    if not enabled:
        return {}
    profiles = {device_profile(gi, ci) for g in enabled for gi, ci in g.mig_devices}
    valid = len(enabled) == len(node.gpus) and all(g.mig_devices for g in enabled) and len(profiles) == 1
    if not valid:
        invalid = {"product": product_value(enabled[0].product, "MIG", "INVALID"), "count": "0",
                   "replicas": "0", "memory": "0"}  # fmt: skip
        return {f"{PREFIX}gpu.{k}": v for k, v in invalid.items()}
    migs = _mig_devices(node)
    devices = [(name, d) for name, d in _advertised(inventory) if d.mig_uuid in migs]
    if not devices:
        return {}
    return _mig_labels("gpu", migs[devices[0][1].mig_uuid or ""], devices, GPU_RESOURCE, catalog)


def _bool(value: bool) -> str:
    return "true" if value else "false"
