"""Which config applies to this node (DESIGN.md "Selection"): node labels + parsed configs -> an answer.

Pure, and every outcome is a value: a config, "leave the GPUs as they are" (no label and no
`default`: not a failure), or a failure whose reason names the config and its errors, so the agent
can keep the last good state, set the state label to `failed` and say why in an Event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sharing.config import CONFIGMAP, ConfigSet, Problem
from sharing.config.spec import SharingConfig

CONFIG_LABEL = "nvidia.com/device-plugin.config"
"""The default label whose value names the node's config (configurable)."""
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
"""mig-manager's label, honoured when the primary label is absent."""
DEFAULT_CONFIG = "default"


@dataclass(frozen=True, slots=True)
class Selected:
    """Apply this config; `source` says why it was chosen (`label KEY=VALUE` or `default`)."""

    config: SharingConfig
    source: str


@dataclass(frozen=True, slots=True)
class Unmanaged:
    """No config applies: leave the GPUs as they are and advertise them as they are."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The node asks for a config that does not exist or is invalid: keep the last good state."""

    name: str
    reason: str
    problems: tuple[Problem, ...] = ()


Selection = Selected | Unmanaged | Failed


def select_config(
    labels: Mapping[str, str],
    configs: ConfigSet,
    *,
    label: str = CONFIG_LABEL,
    fallback: str = MIG_CONFIG_LABEL,
    default: str = DEFAULT_CONFIG,
) -> Selection:
    """The config for a node with these labels; an empty label value counts as absent.

    Without a label, the config named `default` applies (NVIDIA's `config.default`), if there is one.
    """
    for key in dict.fromkeys((label, fallback)):
        name = labels.get(key, "")
        if name:
            return _lookup(name, configs, f"label {key}={name}")
    if default and (default in configs.names or default in configs.invalid or CONFIGMAP in configs.invalid):
        return _lookup(default, configs, "default")
    return Unmanaged(f"no {label} label and no config named {default!r}: GPUs are left as they are")


def _lookup(name: str, configs: ConfigSet, source: str) -> Selection:
    problems = configs.errors_for(name)
    config = configs.get(name)
    if config is not None and not problems:
        return Selected(config, source)
    if problems:
        shown = "; ".join(str(p) for p in problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        return Failed(name, f"config {name!r} ({source}) is invalid: {shown}", problems)
    available = ", ".join(configs.names) or "none"
    return Failed(
        name, f"config {name!r} ({source}) does not exist in the ConfigMap (valid configs: {available})"
    )
