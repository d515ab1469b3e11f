"""The agent's settings: one frozen value built from flags, with SHARING_* environment fallbacks.

Precedence is flag > environment > default, so the DaemonSet can set everything through env and a
person debugging on a node can override any of it on the command line.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from sharing.config.frontend import FRONTEND_LABEL, Frontend, parse_frontend
from sharing.devices import (
    APPLICATION_XIDS,
    DEFAULT_MPS_ROOT,
    DeviceIdStrategy,
    DeviceListStrategy,
    Injection,
)
from sharing.store import DEFAULT_JOURNAL

DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything `sharing agent` needs to know, logged once at start-up."""

    node_name: str
    namespace: str = "gpu-sharing"
    configmap: str = "gpu-sharing-config"
    presets_configmap: str = "gpu-sharing-presets"
    """The shipped presets; the user's ConfigMap wins per name. Empty: no presets."""
    default_config: str = "default"
    default_mig_strategy: str = "none"
    """MIG strategy of imported NVIDIA device-plugin configs that name none (NVIDIA's MIG_STRATEGY)."""
    config_label: str = "nvidia.com/device-plugin.config"
    fallback_label: str = "nvidia.com/mig.config"
    frontend: str = "deviceplugin"
    """How the node's devices reach pods: deviceplugin or dra (the label below overrides it per node)."""
    frontend_label: str = FRONTEND_LABEL
    dra: bool = False
    """Serve DRA where a node asks for it (the chart's dra.enabled); on anyway with frontend dra."""
    backend: str = "nvml"
    driver_root: Path = Path("/")
    """Where the NVIDIA driver's files are (NVIDIA's driverRoot): <root>/usr/lib/.../libnvidia-ml.so.1,
    <root>/dev/nvidia*, <root>/proc/driver/nvidia/capabilities."""
    host_driver_root: Path | None = None
    """The node's path of the driver root, for the host paths of the CDI spec (NVIDIA's device plugin
    calls the two nvidiaDriverRoot and containerDriverRoot); None: the same as driver_root."""
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    kubelet_plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    """The DRA front-end's socket and claim checkpoint go in <dir>/gpu.nvidia.com/."""
    kubelet_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    """Where the kubelet's plugin watcher looks for the DRA front-end's registration socket."""
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    journal: Path = DEFAULT_JOURNAL
    kubeconfig: str | None = None
    """None: in-cluster service account."""
    resync_seconds: float = 300.0
    blocked_recheck_seconds: float = 3.0
    drain: bool = False
    """Cordon the Node and evict the pods that block a change (Eviction API), then uncordon."""
    watch_timeout_seconds: int = 300
    ignored_xids: tuple[int, ...] = tuple(sorted(APPLICATION_XIDS))
    allocation_policy: str = "distributed"
    device_list_strategy: str = "envvar"
    """Comma list of envvar, volume-mounts, cdi-annotations, cdi-cri (NVIDIA's names)."""
    device_id_strategy: str = "uuid"
    cdi_spec_dir: Path = Path("/var/run/cdi")
    mps_root: Path = Path(DEFAULT_MPS_ROOT)
    """Host directory of the MPS control daemons' pipes, logs and shared memory (NVIDIA's mpsRoot); the
    agent sees it at the same path."""
    mps_check_seconds: float = 2.0
    """How often every MPS control daemon is asked whether it still answers."""
    mps_keeper_socket: Path | None = None
    """The MPS keeper's socket (`sharing mps-keeper`): the daemons are started there, so they outlive
    the agent's container and pod; None: the agent starts them as its own children."""
    http_port: int = 9402
    """/healthz, /readyz, /metrics and /status; 0: no HTTP server."""
    holders_localhost_only: bool = False
    """Serve /status and the metrics that name pods (slice_owner_info, the slices' usage) to 127.0.0.1
    only."""
    usage_enabled: bool = True
    """Sample what the GPUs and each slice's pod use (docs/metrics.md, "Usage"); off: no NVML call of it."""
    usage_interval_seconds: float = 10.0
    usage_window: float = 24 * 3600.0
    """Seconds of each slice's peak memory and SM p95 (whole hours; flag and env take `24h`, `90m`)."""
    usage_idle_after: float = 30 * 60.0
    """A held slice with no process of its pod for this long is idle (flag and env take `30m`, `2h`)."""
    usage_idle_events: bool = False
    """Record a `SliceIdle` Event on the Node once per pod and slice that becomes idle."""
    host_proc: Path = Path("/proc")
    """The host's /proc (the chart mounts it read-only at /host/proc): each GPU process's cgroup names
    its pod."""
    log_format: str = "auto"

    @property
    def usage_state(self) -> Path:
        """The slices' usage windows, beside the journal (`sharing.usage.store`)."""
        return self.journal.with_name("usage.json")

    @property
    def dra_available(self) -> bool:
        """Whether the agent brings its DRA front-end."""
        return self.dra or self.frontend.strip() == Frontend.DRA.value

    def default_frontend(self) -> Frontend:
        """The front-end of a node without the label; ValueError names a bad one."""
        return parse_frontend(self.frontend)

    def injection(self) -> Injection:
        """The device-list and device-ID strategies; ValueError names a bad one."""
        names = [n.strip() for n in self.device_list_strategy.split(",") if n.strip()]
        valid = ", ".join(s.value for s in DeviceListStrategy)
        try:
            strategies = frozenset(DeviceListStrategy(n) for n in names)
            ids = DeviceIdStrategy(self.device_id_strategy)
        except ValueError:
            raise ValueError(
                f"{self.device_list_strategy!r} / {self.device_id_strategy!r}: the strategies are {valid}, "
                "and the ID strategy uuid or index"
            ) from None
        if not strategies:
            raise ValueError(f"no device-list strategy given (choose from {valid})")
        return Injection(strategies, ids, str(self.mps_root))

    def describe(self) -> dict[str, object]:
        """The settings as plain values (paths as text), for the start-up log line."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {
            k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
            for k, v in values.items()
        }


@dataclass(frozen=True, slots=True)
class KeeperSettings:
    """What `sharing mps-keeper` needs: its socket, and the driver root and MPS root the agent has."""

    mps_keeper_socket: Path
    driver_root: Path = Path("/")
    mps_root: Path = Path(DEFAULT_MPS_ROOT)
    log_format: str = "auto"


# Each setting: its flag is --name-with-dashes, its environment variable SHARING_NAME_IN_CAPITALS.
_OPTIONS: dict[str, str] = {
    "node_name": "this node's name (DaemonSet: from the downward API)",
    "namespace": "namespace of the ConfigMap of named configs",
    "configmap": "name of the user's ConfigMap of named configs",
    "presets_configmap": (
        "name of the ConfigMap of shipped presets ('' for none); the user's configs win per name"
    ),
    "default_config": "config for a node without a label",
    "default_mig_strategy": (
        "MIG strategy (none, single, mixed) of NVIDIA device-plugin configs that set none"
    ),
    "config_label": "node label that names the config",
    "fallback_label": "label used when the first is absent",
    "frontend": "how the devices reach pods: deviceplugin or dra (a node's label overrides it)",
    "frontend_label": "node label that overrides the front-end (deviceplugin or dra)",
    "dra": "the DRA front-end can serve a node whose label asks for it (true/false; on with --frontend dra)",
    "backend": "GPU backend: nvml",
    "driver_root": "where the NVIDIA driver's files are (libnvidia-ml.so.1, /dev/nvidia*): / or its mount",
    "host_driver_root": "the node's path of the driver root, for CDI host paths (default: the driver root)",
    "device_plugin_dir": "the kubelet's device-plugin dir",
    "kubelet_plugins_dir": (
        "the kubelet's plugins dir (the DRA socket and claim checkpoint go in <dir>/gpu.nvidia.com)"
    ),
    "kubelet_registry_dir": "the kubelet's plugin registry dir (the DRA registration socket)",
    "pod_resources_socket": "the PodResources socket",
    "journal": "journal of hardware steps (crash recovery)",
    "kubeconfig": "kubeconfig file (default: in-cluster)",
    "resync_seconds": "reconcile at least this often",
    "blocked_recheck_seconds": "while devices in use block a change, look this often whether they are free",
    "drain": "evict the pods that block a change, cordoning the node meanwhile (true/false)",
    "watch_timeout_seconds": "watch renewal",
    "ignored_xids": "XIDs that do not make a GPU unhealthy",
    "allocation_policy": "replicas: distributed or packed",
    "device_list_strategy": (
        "how containers get devices: envvar, volume-mounts, cdi-annotations, cdi-cri (comma list)"
    ),
    "device_id_strategy": "uuid or index",
    "cdi_spec_dir": "where the CDI spec is written",
    "mps_root": "host directory of the MPS control daemons' pipes and shared memory (NVIDIA's mpsRoot)",
    "mps_check_seconds": "how often the MPS control daemons are asked whether they answer",
    "mps_keeper_socket": (
        "socket of the MPS keeper (sharing mps-keeper) that starts the MPS control daemons (default: "
        "the agent starts them itself, and they end with it)"
    ),
    "http_port": "port of /healthz, /readyz, /metrics (0: none)",
    "holders_localhost_only": (
        "serve /status and the metrics that name the pods holding each GPU slice on localhost only "
        "(true/false)"
    ),
    "usage_enabled": "sample what the GPUs and each slice's pod use (true/false)",
    "usage_interval_seconds": "seconds between two usage samples (at least 1)",
    "usage_window": "span of each slice's peak memory and SM p95: whole hours, 1h to 168h (24h, 90m, 3600)",
    "usage_idle_after": "a held slice with no process of its pod for this long is idle (30m, 2h, 600)",
    "usage_idle_events": "record a SliceIdle Event on the Node once per pod and idle slice (true/false)",
    "host_proc": "where the host's /proc is mounted (each GPU process's cgroup names its pod)",
    "log_format": "auto, json or console",
}

_Kind = type[Settings] | type[KeeperSettings]

_KEEPER_OPTIONS: dict[str, str] = {
    "mps_keeper_socket": "the unix socket to serve (in a directory on the node the agent's pod mounts too)",
    "driver_root": "the driver root the agent has: <root>/usr/bin/nvidia-cuda-mps-control is run",
    "mps_root": "the MPS root the agent has: the daemons' pipes and logs go in <root>/<GPU UUID>/",
    "log_format": "auto, json or console",
}

_EMPTY_ALLOWED = frozenset({"presets_configmap", "default_config"})
"""Settings where an empty value means "none" rather than "not set"."""
MAX_WINDOW_HOURS = 168
"""A week: the usage windows' memory and file stay bounded."""
_DURATION = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[smh]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting; unset flags fall back to the environment, then the default."""
    _add(parser, Settings, _OPTIONS, required="node_name")


def add_keeper_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `sharing mps-keeper`, as `add_arguments`."""
    _add(parser, KeeperSettings, _KEEPER_OPTIONS, required="mps_keeper_socket")


def _add(parser: argparse.ArgumentParser, kind: _Kind, options: Mapping[str, str], *, required: str) -> None:
    for name, help_text in options.items():
        default = kind.__dataclass_fields__[name].default
        shown = "required" if name == required else _shown(default)
        parser.add_argument(
            _flag(name),
            dest=name,
            default=None,
            metavar=name.split("_")[-1].upper(),
            help=f"{help_text} [{_env(name)}; {shown}]",
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return "SHARING_" + name.upper()


def _shown(default: object) -> str:
    if default is None:
        return "default: none"
    if isinstance(default, tuple):
        return "default: " + ",".join(map(str, default))
    return f"default: {default!r}" if default == "" else f"default: {default}"


def from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Settings:
    """Settings from parsed flags and the environment; ValueError names the bad setting."""
    values = _values(args, environ, Settings, _OPTIONS)
    if "node_name" not in values:
        raise ValueError("the node name is required: --node-name or SHARING_NODE_NAME")
    settings = Settings(**values)  # type: ignore[arg-type]
    if settings.backend != "nvml":
        raise ValueError(f"--backend / SHARING_BACKEND: {settings.backend!r} is not nvml")
    if settings.allocation_policy not in ("distributed", "packed"):
        raise ValueError(f"allocation policy {settings.allocation_policy!r} is not distributed or packed")
    if settings.default_mig_strategy not in ("none", "single", "mixed"):
        raise ValueError(
            f"--default-mig-strategy / SHARING_DEFAULT_MIG_STRATEGY: {settings.default_mig_strategy!r} "
            "is not none, single or mixed"
        )
    try:
        settings.default_frontend()
    except ValueError as err:
        raise ValueError(f"--frontend / SHARING_FRONTEND: {err}") from err
    try:
        settings.injection()
    except ValueError as err:
        raise ValueError(f"--device-list-strategy / --device-id-strategy: {err}") from err
    if not 0 <= settings.http_port < 65536:
        raise ValueError(f"--http-port / SHARING_HTTP_PORT: {settings.http_port} is not a port")
    if settings.log_format not in ("auto", "json", "console"):
        raise ValueError(f"log format {settings.log_format!r} is not auto, json or console")
    if not settings.usage_interval_seconds >= 1:
        raise ValueError(
            f"--usage-interval-seconds / SHARING_USAGE_INTERVAL_SECONDS: {settings.usage_interval_seconds:g} "
            "is less than 1 second"
        )
    hours = settings.usage_window / 3600
    if not (1 <= hours <= MAX_WINDOW_HOURS and hours == int(hours)):
        raise ValueError(
            f"--usage-window / SHARING_USAGE_WINDOW: {settings.usage_window:g} s is not a whole number of "
            f"hours from 1h to {MAX_WINDOW_HOURS}h"
        )
    if not settings.usage_idle_after >= 1:
        raise ValueError(
            f"--usage-idle-after / SHARING_USAGE_IDLE_AFTER: {settings.usage_idle_after:g} s is less than 1 s"
        )
    return settings


def parse_duration(text: str) -> float:
    """Seconds of `24h`, `90m`, `30s` or a plain number of seconds; ValueError otherwise."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(text)
    return float(match["number"]) * _UNITS[match["unit"]]


def keeper_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> KeeperSettings:
    """The settings of `sharing mps-keeper`; ValueError names the bad setting."""
    values = _values(args, environ, KeeperSettings, _KEEPER_OPTIONS)
    if "mps_keeper_socket" not in values:
        raise ValueError("the socket is required: --mps-keeper-socket or SHARING_MPS_KEEPER_SOCKET")
    keeper = KeeperSettings(**values)  # type: ignore[arg-type]
    if keeper.log_format not in ("auto", "json", "console"):
        raise ValueError(f"log format {keeper.log_format!r} is not auto, json or console")
    return keeper


def _values(
    args: argparse.Namespace, environ: Mapping[str, str], kind: _Kind, options: Mapping[str, str]
) -> dict[str, object]:
    """The settings given by flag or environment, converted."""
    values: dict[str, object] = {}
    for name in options:
        raw = getattr(args, name, None)
        source = _flag(name)
        if raw is None:
            raw, source = environ.get(_env(name)), _env(name)
        if raw is None and name == "kubeconfig":
            raw, source = environ.get("KUBECONFIG") or None, "KUBECONFIG"
        if raw is None or (raw == "" and name not in _EMPTY_ALLOWED):
            continue
        values[name] = _convert(kind.__dataclass_fields__[name].type, name, raw, source)
    return values


def _convert(kind: object, name: str, raw: str, source: str) -> object:
    try:
        if "Path" in str(kind):
            return Path(raw)
        if name in ("usage_window", "usage_idle_after"):
            return parse_duration(raw)
        if kind == "float":
            return float(raw)
        if kind == "int":
            return int(raw)
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if name == "ignored_xids":
            return tuple(int(x) for x in raw.split(",") if x.strip())

    except ValueError as err:
        raise ValueError(f"{source}: {raw!r} is not a valid {name.replace('_', ' ')}") from err
    return raw
