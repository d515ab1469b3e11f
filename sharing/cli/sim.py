"""`sharing sim`: create and poke the fake NVIDIA driver's GPUs (init, busy, idle, sensors, xid, reset, lost,
found, latency).

The command writes the state file the fake libnvidia-ml.so.1 (hack/fakedriver) reads; the agent and
every other command reach those GPUs only through that library (--driver-root).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from sharing.cli.common import Subparsers, UsageError
from sharing.errors import BackendError
from sharing.gpu import simstate
from sharing.mig import default_catalog

_GPU_ITEM = re.compile(r"^(?P<product>[^:]+?)(?::(?P<count>\d+))?$")


def register(commands: Subparsers) -> None:
    """Add the command and its subcommands to the CLI."""
    parser = commands.add_parser(
        "sim",
        help="create and change the fake NVIDIA driver's GPUs",
        description="The GPUs of the fake NVIDIA driver (hack/fakedriver), kept in its state file "
        "(<driver root>/var/lib/fake-nvidia/gpus.json).",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=type(parser))

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=help_text)
        sub.add_argument(
            "--sim-state", type=Path, default=None, metavar="PATH", help="state file [SHARING_SIM_STATE]"
        )
        return sub

    init = action("init", "create idle GPUs with MIG off (replaces the state file)")
    init.add_argument(
        "--gpus",
        required=True,
        metavar="LIST",
        help="GPU[:COUNT],... by catalog name, NVML name or PCI id, e.g. A100-SXM4-40GB:2,H200:1,T4:1",
    )
    init.add_argument(
        "--pending-mode-changes",
        action="store_true",
        help="MIG mode changes wait for `sharing sim reset` (as in VMs), not applied at once",
    )
    init.add_argument("--seed", default="sim", help="seed of the UUIDs (same seed, same UUIDs)")
    init.add_argument(
        "--personality",
        choices=simstate.PERSONALITIES,
        default="r580",
        help="the driver branch played: r580 (current) or r535 (lists no MIG profiles while MIG is off)",
    )
    init.add_argument(
        "--unprivileged-processes",
        action="store_true",
        help="process lists in MIG mode answer NO_PERMISSION, as in an unprivileged container",
    )
    init.set_defaults(run=_init)
    busy = action("busy", "run a process on a GPU or MIG device (or change it): what NVML lists there")
    busy.add_argument("--uuid", required=True, help="GPU-... or MIG-... UUID")
    busy.add_argument(
        "--pid", type=int, default=None,
        help="its host PID (default: the device's own stand-in PID, 1000+GPU or 2000+...)",
    )  # fmt: skip
    busy.add_argument(
        "--memory-mib", type=int, default=1, metavar="MIB", help="device memory it uses (default 1)"
    )
    busy.add_argument(
        "--sm", type=int, default=0, metavar="PERCENT", help="percent of the SMs it keeps busy (default 0)"
    )
    busy.set_defaults(run=_busy)
    idle = action("idle", "end the processes of a device (one with --pid)")
    idle.add_argument("--uuid", required=True, help="GPU-... or MIG-... UUID")
    idle.add_argument("--pid", type=int, default=None, help="only this process")
    idle.set_defaults(run=_idle)
    sensors = action("sensors", "set a GPU's power draw and temperature")
    sensors.add_argument("--uuid", required=True, help="GPU-... UUID")
    sensors.add_argument(
        "--power-watts", type=float, default=None, metavar="W", help="power draw (default 60)"
    )
    sensors.add_argument("--temperature", type=int, default=None, metavar="C", help="°C (default 35)")
    sensors.set_defaults(run=_sensors)
    xid = action("xid", "raise an XID on a GPU or MIG device")
    xid.add_argument("--uuid", required=True, help="GPU-... or MIG-... UUID")
    xid.add_argument("--xid", required=True, type=int, help="XID number, e.g. 79 (fallen off the bus)")
    xid.set_defaults(run=_xid)
    reset = action("reset", "reset GPUs: pending MIG mode takes effect, instances are gone")
    reset.add_argument("--uuid", default=None, help="one GPU (default: all)")
    reset.set_defaults(run=_reset)
    for name, help_text in (
        ("lost", "make a GPU fail every NVML read, as a GPU that fell off the bus does"),
        ("found", "make a lost GPU readable again"),
    ):
        lost = action(name, help_text)
        lost.add_argument("--gpu", required=True, type=int, metavar="INDEX", help="GPU index")
        lost.set_defaults(run=_lost, lost=name == "lost")
    latency = action("latency", "make NVML calls take time, as on hardware (seconds per call)")
    latency.add_argument(
        "calls", nargs="*", metavar="FUNCTION=SECONDS",
        help="an exported NVML function and its seconds, e.g. nvmlGpuInstanceDestroy=0.3 (0: none)",
    )  # fmt: skip
    latency.add_argument(
        "--realistic", action="store_true",
        help="the MIG calls' assumed latencies (hack/fakedriver/README.md, \"Latencies\")",
    )  # fmt: skip
    latency.add_argument("--clear", action="store_true", help="no latencies first (every call at once)")
    latency.set_defaults(run=_latency)


def parse_gpus(text: str) -> list[simstate.SimGpuSpec]:
    """`A100-SXM4-40GB:2,T4` -> one spec per GPU; unknown products and bad counts are usage errors."""
    catalog = default_catalog()
    specs = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        match = _GPU_ITEM.match(item)
        if match is None or (match["count"] is not None and int(match["count"]) < 1):
            raise UsageError(f"--gpus: {item!r} is not PRODUCT or PRODUCT:COUNT")
        try:
            spec = simstate.resolve_product(catalog, match["product"])
        except BackendError as err:
            raise UsageError(f"--gpus: {err}") from err
        specs.extend([spec] * int(match["count"] or 1))
    if not specs:
        raise UsageError("--gpus: name at least one GPU")
    return specs


def _init(args: argparse.Namespace) -> int:
    specs = parse_gpus(args.gpus)
    state = simstate.init_state(
        _state(args),
        specs,
        pending_mode_changes=args.pending_mode_changes,
        seed=args.seed,
        personality=args.personality,
        unprivileged_processes=args.unprivileged_processes,
    )
    for gpu in state["gpus"]:
        print(f"GPU {gpu['index']}  {gpu['name']}  {gpu['uuid']}")
    return 0


def _busy(args: argparse.Namespace) -> int:
    try:
        process = simstate.start_process(
            _state(args), args.uuid, args.pid, used_mib=args.memory_mib, sm=args.sm
        )
    except BackendError as err:
        raise UsageError(str(err)) from err
    print(f"{args.uuid}  pid {process.pid}  {process.used_mib} MiB  SM {process.sm} %")
    return 0


def _idle(args: argparse.Namespace) -> int:
    ended = simstate.stop_processes(_state(args), args.uuid, args.pid)
    print(f"{args.uuid}  {ended} process{'es' if ended != 1 else ''} ended")
    return 0


def _sensors(args: argparse.Namespace) -> int:
    try:
        gpu = simstate.set_sensors(
            _state(args), args.uuid, power_watts=args.power_watts, temperature_c=args.temperature
        )
    except BackendError as err:
        raise UsageError(str(err)) from err
    print(f"GPU {gpu['index']}  {gpu.get('powerWatts', 60.0):g} W  {gpu.get('temperatureC', 35)} °C")
    return 0


def _xid(args: argparse.Namespace) -> int:
    simstate.inject_xid(_state(args), args.uuid, args.xid)
    return 0


def _reset(args: argparse.Namespace) -> int:
    for uuid in simstate.reset(_state(args), args.uuid):
        print(f"reset {uuid}")
    return 0


def _lost(args: argparse.Namespace) -> int:
    uuid = simstate.set_lost(_state(args), args.gpu, args.lost)
    print(f"GPU {args.gpu} ({uuid}) {'lost' if args.lost else 'found'}")
    return 0


def _latency(args: argparse.Namespace) -> int:
    wanted: dict[str, float] = dict(simstate.REALISTIC_LATENCIES) if args.realistic else {}
    for item in args.calls:
        name, _, seconds = item.partition("=")
        try:
            wanted[name] = float(seconds)  # "" (no "=") is a ValueError too
        except ValueError:
            wanted[name] = math.nan
        if math.isnan(wanted[name]):
            raise UsageError(f"{item!r} is not FUNCTION=SECONDS (e.g. nvmlGpuInstanceDestroy=0.3)")
    try:
        now = simstate.set_latencies(_state(args), wanted, replace=args.clear)
    except BackendError as err:
        raise UsageError(str(err)) from err
    for name, seconds in now.items():
        print(f"{name}  {seconds:g} s")
    if not now:
        print("no latencies: every call returns at once")
    return 0


def _state(args: argparse.Namespace) -> Path:
    """The state file: --sim-state, else SHARING_SIM_STATE."""
    path: Path | None = args.sim_state
    if path is None and os.environ.get("SHARING_SIM_STATE"):
        path = Path(os.environ["SHARING_SIM_STATE"])
    if path is None:
        raise UsageError("sharing sim needs --sim-state PATH (or SHARING_SIM_STATE)")
    return path
