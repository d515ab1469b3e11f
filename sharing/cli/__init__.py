"""The `sharing` command line: wiring only, one module per command.

It speaks to people: errors are one clear line (never a traceback), `--json` where scripts read the
output, tables and pictures where people do. Exit codes: 0 done, 1 the answer is "no" (infeasible,
invalid, could not apply), 2 usage errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from sharing import __version__
from sharing.cli import agent, apply, export, mpskeeper, plan, profiles, recommend, sim, status, validate
from sharing.cli.common import UsageError
from sharing.errors import SharingError

COMMANDS = (profiles, plan, validate, export, apply, status, recommend, sim, agent, mpskeeper)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The parser with every command registered."""
    about = "Share NVIDIA GPUs in Kubernetes: MIG, time-slicing and MPS."
    parser = _Parser(prog="sharing", description=about)
    parser.add_argument("--version", action="version", version=f"sharing {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return the exit code."""
    try:
        args = build_parser().parse_args(argv)
        code: int = args.run(args)
        return code
    except UsageError as err:
        print(f"sharing: error: {err}", file=sys.stderr)
        return 2
    except SharingError as err:
        print(f"sharing: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 1
    except Exception as err:  # the last line of defence: never a traceback at a user
        if os.environ.get("SHARING_DEBUG"):
            traceback.print_exc()
        print(
            f"sharing: internal error: {type(err).__name__}: {err} (set SHARING_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return 70
