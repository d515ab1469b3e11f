"""The document of `sharing export --json`, and back: the GPUs as observed, with the agent's status (pure).

Per GPU its identity, MIG mode, instances (GPU and compute instance ids, placement, MIG UUID, busy)
and, where the driver reported them, its MIG profiles and placements; beside them the status the
node's agent served at the time (`/status`: every slice, who holds it, what its pod used over the
window and its right size), or null where no agent answered. `read_export` turns a document back
into the observed GPUs and the status, so `sharing recommend` gives offline, on a file taken from
a node, what it gives in the agent's pod. A document that is not one this code writes is an
ExportError naming the path of the first wrong value.
"""

from __future__ import annotations

from typing import Any

from sharing.errors import ExportError
from sharing.mig import Product, Profile, device_profile
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState


def export_document(state: NodeState, status: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON value of `sharing export --json`."""
    return {"gpus": [_gpu(g) for g in state.gpus], "status": status}


def read_export(document: Any) -> tuple[NodeState, dict[str, Any] | None]:
    """The GPUs and the status of an exported document; ExportError says what is wrong where."""
    top = _object(document, "")
    gpus = tuple(_read_gpu(g, f"gpus[{i}]") for i, g in enumerate(_list(top, "gpus", "")))
    status = top.get("status")
    if status is not None and not isinstance(status, dict):
        raise ExportError("status: expected the agent's status (an object) or null")
    return NodeState(gpus), status


def _gpu(gpu: Gpu) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "product": gpu.product,
        "memoryMiB": gpu.memory_mib,
        "migCapable": gpu.mig_capable,
        "migEnabled": gpu.mig_enabled,
        "migPending": gpu.mig_pending,
        "pciDeviceId": None if gpu.pci_device_id is None else f"0x{gpu.pci_device_id:08X}",
        "instances": _instances(gpu),
        "profiles": None if gpu.profiles is None else _profiles(gpu.profiles),
    }


def _instances(gpu: Gpu) -> list[dict[str, Any]]:
    """One row per MIG device; a half-built GPU instance (no compute instance yet) has one without."""
    rows: list[dict[str, Any]] = []
    for gi in gpu.instances:
        where = {"profile": gi.profile, "start": gi.start, "size": gi.size, "gpuInstance": gi.id}
        for ci in gi.compute_instances:
            rows.append(
                {
                    **where,
                    # The MIG device's own profile (`1c.3g.20gb` for a compute instance smaller than its
                    # GPU instance); the GPU instance's stays in `gpuInstanceProfile`.
                    "profile": device_profile(gi, ci),
                    "gpuInstanceProfile": gi.profile,
                    "computeInstance": ci.id,
                    "computeSlices": ci.slices,
                    "uuid": ci.uuid,
                    "busy": ci.busy,
                    "migIndex": ci.mig_index,
                }
            )
        if not gi.compute_instances:
            rows.append(
                {
                    **where,
                    "gpuInstanceProfile": gi.profile,
                    "computeInstance": None,
                    "uuid": None,
                    "busy": False,
                    "migIndex": None,
                }
            )
    return rows


def _profiles(product: Product) -> dict[str, Any]:
    return {
        "slots": product.slots,
        "computeSlices": product.compute_slices,
        "profiles": [
            {
                "name": p.name,
                "id": p.id,
                "enum": p.enum,
                "computeSlices": p.compute_slices,
                "size": p.size,
                "maxCount": p.max_count,
                "memoryMiB": p.memory_mib,
                "placements": list(p.placements),
                "multiprocessors": p.multiprocessors,
            }
            for p in product.profiles
        ],
    }


def _read_gpu(value: Any, path: str) -> Gpu:
    gpu = _object(value, path)
    product = _text(gpu, "product", path)
    pci = gpu.get("pciDeviceId")
    try:
        pci_id = None if pci is None else int(str(pci), 16)
    except ValueError:
        raise ExportError(f"{path}.pciDeviceId: {pci!r} is not a PCI id like 0x20B010DE") from None
    instances: dict[int, GpuInstance] = {}
    for i, row in enumerate(_list(gpu, "instances", path)):
        where = f"{path}.instances[{i}]"
        _object(row, where)
        gi_id = _int(row, "gpuInstance", where)
        # The GPU instance's profile (a document of before `gpuInstanceProfile` named it `profile`).
        gi_profile = "gpuInstanceProfile" if "gpuInstanceProfile" in row else "profile"
        gi = instances.get(gi_id) or GpuInstance(
            gi_id, _text(row, gi_profile, where), _int(row, "start", where), _int(row, "size", where)
        )
        if row.get("uuid") is not None:
            slices = row.get("computeSlices")
            ci = ComputeInstance(
                _int(row, "computeInstance", where),
                MigUuid(_text(row, "uuid", where)),
                _bool(row, "busy", where),
                row.get("migIndex") if isinstance(row.get("migIndex"), int) else None,
                slices=slices if isinstance(slices, int) else None,
            )
            gi = GpuInstance(gi.id, gi.profile, gi.start, gi.size, (*gi.compute_instances, ci))
        instances[gi_id] = gi
    table = gpu.get("profiles")
    return Gpu(
        index=_int(gpu, "index", path),
        uuid=GpuUuid(_text(gpu, "uuid", path)),
        product=product,
        memory_mib=_int(gpu, "memoryMiB", path),
        mig_capable=_bool(gpu, "migCapable", path),
        mig_enabled=_bool(gpu, "migEnabled", path),
        mig_pending=_bool(gpu, "migPending", path),
        instances=tuple(sorted(instances.values(), key=lambda g: g.start)),
        busy=any(ci.busy for gi in instances.values() for ci in gi.compute_instances),
        pci_device_id=pci_id,
        profiles=None
        if table is None
        else _read_profiles(table, product, _int(gpu, "memoryMiB", path), path),
    )


def _read_profiles(value: Any, name: str, memory_mib: int, path: str) -> Product:
    where = f"{path}.profiles"
    table = _object(value, where)
    profiles = []
    for i, row in enumerate(_list(table, "profiles", where)):
        at = f"{where}.profiles[{i}]"
        _object(row, at)
        placements = _list(row, "placements", at)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in placements):
            raise ExportError(f"{at}.placements: expected slot numbers")
        sms = row.get("multiprocessors")
        profiles.append(
            Profile(
                name=_text(row, "name", at),
                enum=_int(row, "enum", at),
                id=_int(row, "id", at),
                compute_slices=_int(row, "computeSlices", at),
                size=_int(row, "size", at),
                max_count=_int(row, "maxCount", at),
                memory_mib=_int(row, "memoryMiB", at),
                placements=tuple(placements),
                multiprocessors=sms if isinstance(sms, int) else None,
                source="the driver, as exported",
            )
        )
    return Product(
        name=name,
        nvml_names=(name,),
        pci_device_ids=(),
        memory_mib=memory_mib,
        slots=_int(table, "slots", where),
        compute_slices=_int(table, "computeSlices", where),
        profiles=tuple(profiles),
        origin="driver",
        source="the driver, as exported",
        placements_source="the driver, as exported",
    )


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ExportError(
            f"{path or 'the document'}: expected an object (is it `sharing export --json` output?)"
        )
    return value


def _list(value: dict[str, Any], key: str, path: str) -> list[Any]:
    found = value.get(key)
    if not isinstance(found, list):
        raise ExportError(f"{_at(path, key)}: expected a list")
    return found


def _text(value: dict[str, Any], key: str, path: str) -> str:
    found = value.get(key)
    if not isinstance(found, str):
        raise ExportError(f"{_at(path, key)}: expected a string")
    return found


def _int(value: dict[str, Any], key: str, path: str) -> int:
    found = value.get(key)
    if isinstance(found, bool) or not isinstance(found, int) or found < 0:
        raise ExportError(f"{_at(path, key)}: expected a whole number")
    return found


def _bool(value: dict[str, Any], key: str, path: str) -> bool:
    found = value.get(key)
    if not isinstance(found, bool):
        raise ExportError(f"{_at(path, key)}: expected true or false")
    return found


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
