"""What MPS asks of each GPU: the limits its control daemon enforces for the config in effect (pure).

A rule with `sharing: mps` shares a whole GPU (MIG off; `unchanged` rules of converted NVIDIA
configs on GPUs without MIG too) between `replicas` clients of one MPS
server. The daemon's defaults are per client: `set_default_active_thread_percentage` (NVIDIA's
device plugin sets `100 / replicas`) and `set_default_device_pinned_mem_limit` (`memory /
replicas`), both overridable per rule (`MpsLimits`). NVIDIA: k8s-device-plugin v0.20.0,
cmd/mps-control-daemon/mps/daemon.go `Start`; man page nvidia-cuda-mps-control(1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sharing.config import MigMode, Sharing, SharingConfig, identity
from sharing.mig import Catalog
from sharing.model import Gpu, GpuUuid, NodeState


@dataclass(frozen=True, slots=True)
class MpsSettings:
    """What one control daemon enforces: its clients' default limits."""

    replicas: int
    """The clients the GPU's limits were divided among (1 for the daemon of a claim's MIG device:
    the claim's limits are its own)."""
    active_thread_percentage: int
    pinned_memory_mib: int


def mps_settings(config: SharingConfig | None, gpu: Gpu, catalog: Catalog) -> MpsSettings | None:
    """The daemon settings `config` asks of `gpu`; None when the GPU is not shared with MPS."""
    if config is None or gpu.mig_enabled:
        return None
    rule = config.rule_matching(identity(gpu, catalog))
    if rule is None or rule.sharing is not Sharing.MPS or rule.mig is MigMode.ENABLED:
        return None
    replicas = rule.replicas.for_kind("gpu")
    if replicas < 1:
        return None
    threads = rule.mps.active_thread_percentage
    memory = rule.mps.pinned_memory_mib
    return MpsSettings(
        replicas=replicas,
        active_thread_percentage=threads if threads is not None else max(1, 100 // replicas),
        pinned_memory_mib=memory if memory is not None else max(1, gpu.memory_mib // replicas),
    )


def mps_layout(
    node: NodeState,
    config: SharingConfig | None,
    catalog: Catalog,
    per_gpu: Mapping[GpuUuid, SharingConfig | None] | None = None,
) -> dict[GpuUuid, MpsSettings]:
    """{GPU: settings} for every GPU shared with MPS; `per_gpu` overrides the config per GPU."""
    found = {}
    for gpu in node.gpus:
        cfg = per_gpu[gpu.uuid] if per_gpu is not None and gpu.uuid in per_gpu else config
        settings = mps_settings(cfg, gpu, catalog)
        if settings is not None:
            found[gpu.uuid] = settings
    return found


DEFAULT_MPS_ROOT = "/run/nvidia/mps"
"""NVIDIA's default mpsRoot (`mps.root` of its Helm chart, `--mps-root` of its device plugin)."""
CONTAINER_ROOT = "/mps"
"""Where a client container sees its GPU's pipe directory: /mps/<uuid>/pipe (NVIDIA: /mps/<resource>/pipe)."""
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
SHM_PATH = "/dev/shm"


@dataclass(frozen=True, slots=True)
class ClientEdits:
    """What a container needs to be a client of a GPU's MPS server.

    NVIDIA's device plugin hands out the same (internal/plugin/mps.go `updateReponse`): the pipe
    directory mounted and named in `CUDA_MPS_PIPE_DIRECTORY`, and the shared memory of the MPS
    servers at /dev/shm; not the log directory.
    """

    env: tuple[tuple[str, str], ...]
    mounts: tuple[tuple[str, str], ...]
    """(container path, host path) pairs, read-write."""


def pipe_dir(root: str, gpu: str) -> str:
    """The host directory of a GPU's control pipe under mpsRoot."""
    return f"{root.rstrip('/')}/{gpu}/pipe"


def client_edits(root: str, gpu: str) -> ClientEdits:
    """The env and mounts of a client of `gpu`'s daemon under mpsRoot `root` (`gpu`: the UUID the
    daemon serves, a GPU's or an on-demand MIG device's)."""
    inside = f"{CONTAINER_ROOT}/{gpu}/pipe"
    return ClientEdits(
        env=((PIPE_ENV, inside),),
        mounts=((inside, pipe_dir(root, gpu)), (SHM_PATH, f"{root.rstrip('/')}/shm")),
    )
