"""`sharing mps-keeper`: start MPS control daemons for the agent, so they outlive its container.

The chart runs it as the second container of the agent's pod (`sharing.gpu.mpskeeper` says why).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from sharing import settings
from sharing.cli.common import Subparsers, UsageError


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "mps-keeper",
        help="start MPS control daemons when the agent asks, so they outlive the agent's container",
        description="Every flag falls back to its SHARING_* environment variable, then to its default.",
    )
    settings.add_keeper_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT."""
    try:
        config = settings.keeper_from_args(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    from sharing import logs

    logs.configure(config.log_format)
    asyncio.run(_serve(config))
    return 0


async def _serve(config: settings.KeeperSettings) -> None:
    from sharing.gpu.mpscontrol import CONTROL
    from sharing.gpu.mpskeeper import Keeper, run_keeper

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # PID 1 of its container: a signal without a handler would be ignored (pid_namespaces(7)).
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    keeper = Keeper(config.mps_root, config.driver_root / CONTROL)
    await run_keeper(config.mps_keeper_socket, keeper, stop)
