"""The NVIDIA driver's NVML library, found under the driver root and loaded before pynvml asks for it.

pynvml's nvmlInit opens `libnvidia-ml.so.1` by name (ctypes.CDLL). `preload` loads the one under
the driver root by its path first; the dynamic loader then hands pynvml that library, because it
reuses a loaded object whose SONAME is the name asked for (glibc dlopen). That is what NVIDIA's
go-nvml does with WithLibraryPath, without LD_LIBRARY_PATH or anything else in the agent knowing
which driver it is.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

from sharing.gpu.backend import NvmlUnavailableError

LIBRARY = "libnvidia-ml.so.1"
LIBRARY_DIRS = (
    "", "usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current", "usr/lib/aarch64-linux-gnu/nvidia/current",
    "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu/nvidia/current", "lib/aarch64-linux-gnu/nvidia/current",
)  # fmt: skip
"""Where under the driver root the library is looked for, in order: the NVIDIA container toolkit's
search paths (https://github.com/NVIDIA/nvidia-container-toolkit/blob/main/internal/lookup/library.go,
NewLibraryLocator)."""
_loaded: list[Path] = []


def find_library(driver_root: Path) -> Path:
    """`<driver root>/<lib dir>/libnvidia-ml.so.1`; NvmlUnavailableError names where it looked."""
    for where in LIBRARY_DIRS:
        path = driver_root / where / LIBRARY
        if path.exists():
            return path
    raise NvmlUnavailableError(
        f"no {LIBRARY} under the driver root {driver_root} (looked in "
        f"{', '.join(str(driver_root / d) for d in LIBRARY_DIRS if d)}): is the NVIDIA driver installed, "
        "and --driver-root / SHARING_DRIVER_ROOT where it is (in the chart: driverRoot)?"
    )


def preload(driver_root: Path) -> Path:
    """Load the driver root's NVML library (once per process: another root is an error); its path.

    The path is used as found, not resolved: a library finds its own files from where it was loaded."""
    path = find_library(driver_root.absolute())
    if _loaded and _loaded[0] != path:
        raise NvmlUnavailableError(f"this process already loaded NVML from {_loaded[0]}, not {path}")
    if not _loaded:
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            raise NvmlUnavailableError(f"cannot load {path}: {err}") from err
        _loaded.append(path)
    return path


def name_os_thread(name: bytes) -> None:
    """Name the calling OS thread (prctl PR_SET_NAME), so `top -H` and /proc/PID/task/TID/comm show
    the NVML worker: what NVML costs can be told apart from the rest of the agent."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)
