"""The flags every command that touches GPUs shares: which backend, and the simulator's state file.

Flag > environment (SHARING_BACKEND, SHARING_SIM_STATE) > default (nvml), as in the agent's settings.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sharing.cli.common import UsageError
from sharing.gpu import BACKENDS, GpuBackend, open_backend
from sharing.mig import default_catalog


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """--backend and --sim-state."""
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="GPU backend: nvml (real GPUs, the default) or sim [SHARING_BACKEND]",
    )
    parser.add_argument(
        "--sim-state",
        type=Path,
        default=None,
        metavar="PATH",
        help="state file of the simulated GPUs, for --backend sim [SHARING_SIM_STATE]",
    )


def backend_kind(args: argparse.Namespace) -> str:
    """The chosen backend name."""
    kind: str = args.backend or os.environ.get("SHARING_BACKEND") or "nvml"
    if kind not in BACKENDS:
        raise UsageError(f"SHARING_BACKEND={kind!r} is not one of: {', '.join(BACKENDS)}")
    return kind


def sim_state(args: argparse.Namespace) -> Path | None:
    """The simulator's state file, if one was given."""
    path: Path | None = args.sim_state
    if path is None and os.environ.get("SHARING_SIM_STATE"):
        path = Path(os.environ["SHARING_SIM_STATE"])
    return path


def open_from_args(args: argparse.Namespace) -> GpuBackend:
    """The backend the flags and environment name."""
    kind = backend_kind(args)
    state = sim_state(args)
    if kind == "sim" and state is None:
        raise UsageError("--backend sim needs --sim-state PATH (or SHARING_SIM_STATE)")
    return open_backend(kind, default_catalog(), sim_state=state)
