"""GPU backends: the one place the agent touches GPUs, through NVML or through simulated NVML.

`backend` declares what a backend does, `nvmlapi` the NVML surface it needs, `nvml` implements it
over anything with that surface (the real `pynvml`, or `simnvml` over a state file), and
`open_backend` wires the two by name.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from sharing.devices import APPLICATION_XIDS
from sharing.errors import BackendError
from sharing.gpu import nvml, simnvml, simstate
from sharing.gpu.backend import GpuBackend
from sharing.gpu.cdi import build_spec, write_spec
from sharing.gpu.devfiles import DriverFiles
from sharing.mig import Catalog

__all__ = ["BACKENDS", "GpuBackend", "build_spec", "open_backend", "write_spec"]

BACKENDS = ("nvml", "sim")


def open_backend(
    kind: str,
    catalog: Catalog,
    *,
    sim_state: Path | None = None,
    ignored_xids: Collection[int] = APPLICATION_XIDS,
) -> GpuBackend:
    """The backend called `kind` (`nvml` or `sim`); `sim` needs the path of its state file."""
    if kind == "nvml":
        return nvml.open_nvml(catalog, ignored_xids=ignored_xids)
    if kind == "sim":
        if sim_state is None:
            raise BackendError(
                "the simulated backend needs a state file: pass --sim-state PATH "
                "(create one with `sharing sim init --sim-state PATH --gpus A100-SXM4-40GB:2`)"
            )
        path = sim_state

        def machine() -> str | None:
            found = simstate.read(path).get("machine")
            return found if isinstance(found, str) else None

        return nvml.NvmlBackend(
            simnvml.SimNvml(sim_state),
            catalog,
            event_poll_s=0.5,
            ignored_xids=ignored_xids,
            machine=machine,
            device_files=DriverFiles(sim_state.parent),
        )
    raise BackendError(f"unknown GPU backend {kind!r} (choose one of: {', '.join(BACKENDS)})")
