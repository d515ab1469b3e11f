"""How `nvidia-cuda-mps-control` is run for one GPU: where the driver installs it, its environment.

The agent (`sharing.gpu.mps`) and the MPS keeper (`sharing.gpu.mpskeeper`) both run it, the keeper
only with `-d`; a daemon must get the same environment whichever of the two starts it, since the
agent then talks to it over the pipe directory named here. What each variable means is NVIDIA's
(MPS guide, "Appendix: Environment Variables", https://docs.nvidia.com/deploy/mps/latest/);
`sharing.gpu.mps` says why each is set as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from sharing.devices import PIPE_ENV, pipe_dir
from sharing.errors import BackendError

CONTROL = Path("usr/bin/nvidia-cuda-mps-control")
"""Where the driver installs it, under the driver root."""
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
LIBRARIES = Path("lib/x86_64-linux-gnu")
"""The driver's libraries, relative to the `usr` directory of its root."""


def log_dir(root: Path, gpu: str) -> Path:
    """The host directory of the GPU's daemon log under mpsRoot `root`."""
    return root / gpu / "log"


def control_env(
    root: Path,
    control: Path,
    gpu: str,
    *,
    visible: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The environment of `control` for `gpu`'s daemon under mpsRoot `root`: `visible` for `-d` (the
    daemon serves the GPUs visible when it starts), not for the commands sent to a running one."""
    env = {k: v for k, v in environ.items() if not k.startswith("CUDA_")}
    # The tool loads the driver's libraries (libcuda, libnvidia-ml) from its driver root, which in
    # the agent's container is a mount, not the image's /usr/lib.
    libs = str(control.parent.parent / LIBRARIES)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libs, environ.get("LD_LIBRARY_PATH", "")) if p)
    env[PIPE_ENV] = str(Path(pipe_dir(str(root), gpu)))
    env[LOG_ENV] = str(log_dir(root, gpu))
    if visible:
        env[VISIBLE_ENV] = gpu
    return env


async def run_control(
    control: Path, args: Sequence[str], stdin: str, env: Mapping[str, str], timeout_s: float
) -> tuple[int, str]:
    """Run the control tool; (exit status, output). BackendError when it cannot run in time."""
    try:
        proc = await asyncio.create_subprocess_exec(
            str(control),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env),
        )
    except OSError as err:
        raise BackendError(f"{control} cannot be run: {err}") from err
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate(stdin.encode())
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise BackendError(f"{control} {' '.join(args)} did not finish in {timeout_s:g} s") from None
    return proc.returncode or 0, out.decode("utf-8", "replace")
