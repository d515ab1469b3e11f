"""`sharing agent`: run the node agent (what the DaemonSet runs)."""

from __future__ import annotations

import argparse
import asyncio
import signal

from sharing import settings
from sharing.cli.common import Subparsers, UsageError


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "agent",
        help="run the node agent: partition GPUs, serve device plugins, label the Node",
        description="Every flag falls back to its SHARING_* environment variable, then to its default.",
    )
    settings.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT; SIGHUP reconciles at once."""
    try:
        config = settings.from_args(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    from sharing import logs

    logs.configure(config.log_format)
    asyncio.run(_serve(config))
    return 0


async def _serve(config: settings.Settings) -> None:
    # Imported here: the other commands should not pay for grpc and the kubernetes client.
    from sharing import __version__
    from sharing.agent import Agent
    from sharing.deviceplugin import AllocationPolicy, Fleet, FleetSettings
    from sharing.gpu import open_backend
    from sharing.kube import ApiClient
    from sharing.kubelet import PodResourcesClient
    from sharing.mig import default_catalog
    from sharing.ops import Metrics

    catalog = default_catalog()
    config.journal.parent.mkdir(parents=True, exist_ok=True)
    kube = ApiClient(config.kubeconfig)
    metrics = Metrics(__version__)
    backend = open_backend(
        config.backend,
        catalog,
        driver_root=config.driver_root,
        host_driver_root=config.host_driver_root,
        ignored_xids=config.ignored_xids,
        mig_seconds=metrics.mig_operation,
    )
    fleet = Fleet(
        FleetSettings(
            plugin_dir=config.device_plugin_dir,
            policy=AllocationPolicy(config.allocation_policy),
            injection=config.injection(),
            ignored_xids=frozenset(config.ignored_xids),
        )
    )
    dra = claim_mps = None
    if config.dra_available:
        from sharing.dra import DraPaths, OnDemand
        from sharing.dra.frontend import DraFrontEnd
        from sharing.gpu.mps import MpsDaemons
        from sharing.gpu.mpscontrol import CONTROL
        from sharing.store import Journal

        # The daemons of on-demand MIG devices claims share with MPS (the agent's own serve whole GPUs).
        claim_mps = MpsDaemons(
            config.mps_root,
            config.driver_root / CONTROL,
            backend.set_compute_mode,
            keeper=config.mps_keeper_socket,
        )

        dra = DraFrontEnd(
            kube=kube,
            node_name=config.node_name,
            files=backend.device_files,
            cdi_dir=config.cdi_spec_dir,
            catalog=catalog,
            paths=DraPaths(config.kubelet_plugins_dir, config.kubelet_registry_dir),
            recorder=metrics,
            # The rollout's journal file: its lock keeps a prepare's instance step and a GPU change apart.
            ondemand=OnDemand(backend, Journal(config.journal), mps=claim_mps),
            gpu_health=lambda: fleet.health,
            kubelet_socket=fleet.settings.kubelet_socket,
        )
    agent = Agent(
        config,
        kube=kube,
        backend=backend,
        fleet=fleet,
        catalog=catalog,
        pod_resources=PodResourcesClient(config.pod_resources_socket),
        dra=dra,
        metrics=metrics,
        claim_mps=claim_mps,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, agent.trigger)
    await agent.run(stop)
