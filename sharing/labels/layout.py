"""The text of the `nvidia.com/gpu-sharing.layout` annotation: one line per GPU (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from sharing.devices import Inventory
from sharing.model import NodeState


def layout(node: NodeState, inventory: Inventory, in_effect: Mapping[str, str | None]) -> str:
    """One line per GPU: what it is, the config in effect on it, its MIG instances and what it offers."""
    offered: dict[str, dict[str, int]] = {}
    for resource, devices in inventory.resources:
        for device in devices:
            per_gpu = offered.setdefault(device.gpu_uuid, {})
            per_gpu[resource] = per_gpu.get(resource, 0) + 1
    lines = []
    for gpu in node.gpus:
        config = in_effect.get(gpu.uuid) or "as found"
        parts = []
        if gpu.mig_enabled:
            parts.append(
                "MIG " + (" ".join(f"{gi.profile}@{gi.start}" for gi in gpu.instances) or "on, no instances")
            )
        parts.append(
            ", ".join(f"{r} x{n}" for r, n in sorted(offered.get(gpu.uuid, {}).items())) or "nothing"
        )
        lines.append(f"GPU {gpu.index} {gpu.product} [{config}]: " + "; ".join(parts))
    lines += [f"GPU {u.index}: cannot be read ({u.error})" for u in node.unreadable]
    return "\n".join(lines)
