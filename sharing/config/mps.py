"""MPS sharing in a config: the per-replica limits as written, and what each GPU of the node allows.

An MPS control daemon serves a bounded number of clients per GPU: 48 from compute capability 7.5,
16 before (NVIDIA/k8s-device-plugin cmd/mps-control-daemon/mps/device.go, `maxClients`; its test
"pre-volta clients" gives CC 7.0 16). NVIDIA's plugin leaves that check to the daemon, which then
crash-loops while the plugin never registers; here it is part of parsing the config for the node's
GPUs, so a config asking too much is refused before anything is advertised and the node keeps its
last good state. MPS shares whole GPUs only (NVIDIA's README: "the only supported resource available
for MPS are `nvidia.com/gpu` resources and only with full GPUs"; internal/plugin/mps.go refuses MIG
devices with "sharing using MPS is not supported for MIG devices").
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sharing.config.document import describe
from sharing.config.node import NodeGpu
from sharing.config.problems import Report, key
from sharing.config.schema import integer
from sharing.config.spec import MigMode, MpsLimits, Sharing

if TYPE_CHECKING:
    from sharing.config.check import DraftRule

MAX_CLIENTS = 48
"""MPS clients per GPU from compute capability 7.5 (device.go `maxClients`)."""
MAX_CLIENTS_BEFORE_7_5 = 16
"""MPS clients per GPU below compute capability 7.5, V100 (7.0) included."""
LIMIT_KEYS = ("activeThreadPercentage", "pinnedMemoryLimit")
NO_MIG = "sharing using MPS is not supported for MIG devices"
"""NVIDIA's message (internal/plugin/mps.go getMPSOptions)."""
_MEMORY = re.compile(r"^([1-9][0-9]{0,9})(Mi|Gi|Ti)$")
_UNITS = {"Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}


def max_clients(capability: tuple[int, int]) -> int:
    """The most MPS clients a GPU of this compute capability serves."""
    return MAX_CLIENTS if capability >= (7, 5) else MAX_CLIENTS_BEFORE_7_5


def memory_mib(report: Report, path: str, value: object) -> int | None:
    """A pinned-memory limit written `512Mi`, `10Gi` or `1Ti`, in MiB."""
    match = _MEMORY.match(value) if isinstance(value, str) else None
    if match is None:
        report.error(path, f"expected a size like 512Mi, 10Gi or 1Ti, got {describe(value)}")
        return None
    return int(match[1]) * _UNITS[match[2]]


def read_limits(report: Report, rule: DraftRule, path: str, found: dict[str, object]) -> None:
    """`activeThreadPercentage` (1-100) and `pinnedMemoryLimit` of one MPS rule or resource."""
    threads, memory = None, None
    if "activeThreadPercentage" in found:
        rule.thread_path = key(path, "activeThreadPercentage")
        threads = integer(report, rule.thread_path, found["activeThreadPercentage"], low=1, high=100)
    if "pinnedMemoryLimit" in found:
        rule.memory_path = key(path, "pinnedMemoryLimit")
        memory = memory_mib(report, rule.memory_path, found["pinnedMemoryLimit"])
    rule.mps = MpsLimits(active_thread_percentage=threads, pinned_memory_mib=memory)


def _gpu(target: NodeGpu) -> str:
    index = target.identity.index
    return target.name if index is None else f"GPU {index} ({target.name})"


def check_mps(report: Report, name: str, rule: DraftRule, targets: list[NodeGpu] | None) -> None:
    """An MPS rule on its GPUs: whole GPUs only, at most the GPU's client cap, memory that fits.

    `targets` None (offline, any GPU): only what no GPU allows, more than 48 clients, is an error.
    """
    if rule.sharing is not Sharing.MPS:
        return
    if rule.mig is MigMode.ENABLED:
        report.error(rule.mig_path, f"{NO_MIG}: this rule enables MIG (MPS shares whole GPUs; "
                     "use mig: disabled)", config=name)  # fmt: skip
        return
    replicas, replicas_path = rule.replicas.get("gpu", (rule.replicas_default, rule.path))
    if targets is None:
        if replicas > MAX_CLIENTS:
            report.error(replicas_path, f"maximum allowed replicas exceeded: {replicas} > {MAX_CLIENTS}: no "
                         f"GPU serves more than {MAX_CLIENTS} MPS clients", config=name)  # fmt: skip
        return
    for target in targets:
        if target.mig_enabled:
            if rule.mig is MigMode.UNCHANGED:  # `disabled` turns MIG off before the daemon starts
                report.error(rule.sharing_path or rule.path, f"{NO_MIG}: {_gpu(target)} has MIG enabled",
                             config=name)  # fmt: skip
            continue
        capability = target.compute_capability
        if capability is not None and replicas > max_clients(capability):
            cap = max_clients(capability)
            major, minor = capability
            report.error(
                replicas_path,
                f"maximum allowed replicas exceeded: {replicas} > {cap}: {_gpu(target)}, compute "
                f"capability {major}.{minor}, serves at most {cap} MPS clients ({MAX_CLIENTS} from 7.5, "
                f"{MAX_CLIENTS_BEFORE_7_5} before)",
                config=name,
            )
        limit = rule.mps.pinned_memory_mib
        if limit is not None and target.memory_mib is not None and limit > target.memory_mib:
            report.error(rule.memory_path, f"{limit} MiB is more than the {target.memory_mib} MiB of "
                         f"{_gpu(target)}", config=name)  # fmt: skip
