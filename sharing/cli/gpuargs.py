"""The flags every command that touches GPUs shares: which backend, and where the driver is.

Flag > environment (SHARING_BACKEND, SHARING_DRIVER_ROOT) > default (nvml, /), as in the agent's settings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from sharing.cli.common import UsageError
from sharing.gpu import BACKENDS, GpuBackend, open_backend
from sharing.mig import default_catalog
from sharing.model import NodeState


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """--backend and --driver-root."""
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help="GPU backend: nvml (the default) [SHARING_BACKEND]"
    )
    parser.add_argument(
        "--driver-root",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the NVIDIA driver's files are (libnvidia-ml.so.1, /dev/nvidia*) "
        "[SHARING_DRIVER_ROOT; default: /]",
    )


def backend_kind(args: argparse.Namespace) -> str:
    """The chosen backend name."""
    kind: str = args.backend or os.environ.get("SHARING_BACKEND") or "nvml"
    if kind not in BACKENDS:
        raise UsageError(f"SHARING_BACKEND={kind!r} is not one of: {', '.join(BACKENDS)}")
    return kind


def driver_root(args: argparse.Namespace) -> Path:
    """The driver root: --driver-root, else SHARING_DRIVER_ROOT, else /."""
    path: Path | None = args.driver_root
    return path or Path(os.environ.get("SHARING_DRIVER_ROOT") or "/")


def open_from_args(args: argparse.Namespace) -> GpuBackend:
    """The backend the flags and environment name."""
    return open_backend(backend_kind(args), default_catalog(), driver_root=driver_root(args))


def observe_from_args(args: argparse.Namespace) -> NodeState:
    """The GPUs as the backend the arguments name reads them, once (the backend closed after)."""

    async def observe() -> NodeState:
        backend = open_from_args(args)
        try:
            return await backend.observe()
        finally:
            await backend.close()

    return asyncio.run(observe())
