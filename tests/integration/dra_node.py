"""The DRA kubelet plugin of one node as its own process, over the fake driver, for the on-demand tests.

What the agent wires for a dynamic node: the NVML backend under `--driver-root` (the real pynvml over
the fake driver), the claims through the agent's API client, the apply journal, the MPS control
daemons of on-demand MIG devices under `--mps-root` (started by this process: without the agent's MPS
keeper a daemon still outlives it, in a session of its own), and the health of the GPUs folded from
the backend's XID events. It prints `serving` once both sockets are up and
stops on SIGTERM; the tests kill it (SIGKILL, or the fake driver's SHARING_SIM_CRASH_AFTER) to play
an agent that dies. pynvml loads one libnvidia-ml.so.1 per process, so each node is a process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

from sharing.devices import HealthState, Inventory
from sharing.dra import DraPaths, DraPlugin, OnDemand
from sharing.gpu.mps import MpsDaemons
from sharing.gpu.mpscontrol import CONTROL
from sharing.gpu.nvml import open_nvml
from sharing.kube import ApiClient
from sharing.mig.catalog import default_catalog
from sharing.model import NodeState
from sharing.store import Journal


async def serve(args: argparse.Namespace) -> None:
    backend = open_nvml(default_catalog(), Path(args.driver_root))
    kube = ApiClient(args.kubeconfig)
    health = HealthState()
    plugin = DraPlugin(
        node_name=args.node,
        claims=kube,
        inventory=Inventory,
        node=lambda: NodeState(()),
        files=backend.device_files,
        cdi_dir=Path(args.cdi_dir),
        paths=DraPaths(Path(args.plugins_dir), Path(args.registry_dir)),
        health_resend_s=0.5,
        ondemand=OnDemand(
            backend,
            Journal(Path(args.journal)),
            mps=MpsDaemons(Path(args.mps_root), Path(args.driver_root) / CONTROL, backend.set_compute_mode),
        ),
        gpu_health=lambda: health,
    )

    async def follow() -> None:
        nonlocal health
        async for event in backend.health_events():
            health = health.apply(event)
            plugin.refresh()

    await plugin.start()
    watcher = asyncio.create_task(follow())
    print("serving", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await plugin.stop()
    await backend.close()
    kube.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    flags = (
        "driver-root",
        "kubeconfig",
        "node",
        "plugins-dir",
        "registry-dir",
        "cdi-dir",
        "journal",
        "mps-root",
    )
    for flag in flags:
        parser.add_argument(f"--{flag}", required=True)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
