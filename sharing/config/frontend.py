"""Which front-end serves a node's GPUs: the device plugins or DRA, chosen per node.

Pure. The agent's setting (`--frontend`, `SHARING_FRONTEND`, the chart's `frontend`) is the default;
the Node label `nvidia.com/gpu-sharing.frontend=dra|deviceplugin` overrides it for one node. A label
with any other value is refused with a message that names it: the node keeps the front-end it has.
A node's GPUs are served by one front-end, never both: the same GPU advertised as an extended
resource and in a ResourceSlice could be handed out twice (KEP-5004: "One node in a cluster cannot
have both extended resource backed by DRA, and same named extended resource backed by device plugin
at the same time", https://github.com/kubernetes/enhancements/tree/master/keps/sig-scheduling/5004-dra-extended-resource).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

FRONTEND_LABEL = "nvidia.com/gpu-sharing.frontend"


class Frontend(enum.Enum):
    """How the node's devices reach pods."""

    DEVICE_PLUGIN = "deviceplugin"
    """One device-plugin server per resource, `nvidia.com/...` extended resources."""
    DRA = "dra"
    """A DRA kubelet plugin and the node's ResourceSlices (driver gpu.nvidia.com)."""


def parse_frontend(value: str) -> Frontend:
    """The front-end a value names; ValueError says which values there are."""
    try:
        return Frontend(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is not a front-end: deviceplugin or dra") from None


@dataclass(frozen=True, slots=True)
class FrontendChoice:
    """The front-end a node asks for, where that comes from, or why the label is refused."""

    frontend: Frontend | None
    """None: the label is invalid; the node keeps the front-end it has."""
    source: str
    """`label nvidia.com/gpu-sharing.frontend` or `setting`."""
    error: str = ""


def choose_frontend(
    labels: Mapping[str, str], default: Frontend, *, label: str = FRONTEND_LABEL
) -> FrontendChoice:
    """The label's front-end when it is set, else the setting's."""
    value = labels.get(label)
    if value is None or value == "":
        return FrontendChoice(default, "setting")
    source = f"label {label}"
    try:
        return FrontendChoice(parse_frontend(value), source)
    except ValueError as err:
        return FrontendChoice(None, source, f"node label {label}={value}: {err}")
