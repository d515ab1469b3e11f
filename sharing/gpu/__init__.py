"""GPU backends: the one place the agent touches GPUs, through NVML.

`backend` declares what a backend does, `nvmlapi` the NVML surface it needs, `nvml` implements it
over the real `pynvml` bound to the driver under a driver root, and `open_backend` wires the two by
name. `simstate`/`simspec` write the state of the fake NVIDIA driver (hack/fakedriver) that tests,
the demo and the bench run the same code over.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from sharing.devices import APPLICATION_XIDS
from sharing.errors import BackendError
from sharing.gpu import nvml
from sharing.gpu.backend import MIG_OPERATIONS, GpuBackend, MigSeconds
from sharing.gpu.cdi import build_named_spec, build_spec, write_spec
from sharing.mig import Catalog

__all__ = [
    "BACKENDS",
    "MIG_OPERATIONS",
    "GpuBackend",
    "MigSeconds",
    "build_named_spec",
    "build_spec",
    "open_backend",
    "write_spec",
]

BACKENDS = ("nvml",)


def open_backend(
    kind: str,
    catalog: Catalog,
    *,
    driver_root: Path = Path("/"),
    host_driver_root: Path | None = None,
    ignored_xids: Collection[int] = APPLICATION_XIDS,
    mig_seconds: MigSeconds | None = None,
) -> GpuBackend:
    """The backend called `kind` over the NVIDIA driver under `driver_root` (on the node at
    `host_driver_root`, by default the same path); the time of each MIG operation goes to
    `mig_seconds`."""
    if kind == "nvml":
        return nvml.open_nvml(
            catalog,
            driver_root,
            host_driver_root=host_driver_root,
            ignored_xids=ignored_xids,
            mig_seconds=mig_seconds,
        )
    raise BackendError(f"unknown GPU backend {kind!r} (choose one of: {', '.join(BACKENDS)})")
