"""The MPS control daemons: one `nvidia-cuda-mps-control -d` per GPU the config shares with MPS.

Per GPU, as NVIDIA documents the start of a daemon for one GPU (MPS guide, "Starting and Stopping
MPS on Linux", https://docs.nvidia.com/deploy/mps/latest/: `export CUDA_VISIBLE_DEVICES=0;
nvidia-smi -i 0 -c EXCLUSIVE_PROCESS; nvidia-cuda-mps-control -d`): the GPU goes to exclusive-process
compute mode (through NVML, `nvmlDeviceSetComputeMode`), then the daemon starts with
`CUDA_VISIBLE_DEVICES=<GPU UUID>` (UUIDs are what NVIDIA recommends: "Appendix: Environment
Variables") and its own `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY` under
`<mpsRoot>/<uuid>/{pipe,log}` (several daemons run side by side when each has its own pipe and log
directories: the MPS guide, "Quick Start"). Its client defaults are piped into
`nvidia-cuda-mps-control` on stdin: `set_default_active_thread_percentage N` and
`set_default_device_pinned_mem_limit 0 <N>M` (device 0: the only one the daemon sees), and read
back with the matching `get_` commands (man page nvidia-cuda-mps-control(1),
https://manpages.ubuntu.com/manpages/noble/man1/nvidia-cuda-mps-control.1.html). A GPU is
enforcing its layout only once the read-back limits are the wanted ones.

The daemon is the state: what a daemon answers on its pipe is what it enforces, so an agent that
restarts adopts the daemons it finds, and a daemon that dies is seen by the next look (`check`)
and started again by the next `enforce`. `quit` ends the daemon and its servers, and so every
client attached to them ("quit ... the MPS controller and any associated MPS servers": Quick
Start), so a daemon whose GPU runs processes (NVML) is never stopped or restarted: the change waits.
Its own servers without clients do not count: a server is a compute process of its GPU for NVML, and
it stays after its last client has gone (`sharing.model.beyond`), so the daemon is asked which
servers it runs (`get_server_list`) and the clients of each (`get_client_list <PID>`: the MPS guide,
"MPSv2 Interface", https://docs.nvidia.com/deploy/mps/latest/mpsv2-interface.html).
The shared memory the clients and servers use is `<mpsRoot>/shm` (NVIDIA's device plugin mounts it
at /dev/shm in both, k8s-device-plugin v0.20.0 internal/plugin/mps.go).

A MIG device made on demand for a DRA claim that asks for MPS gets a daemon of its own the same way
(`serve`, `end`): NVIDIA's MPS guide runs one per MIG device ("Multi-Instance GPU (MIG) support":
start `nvidia-cuda-mps-control -d` with `CUDA_VISIBLE_DEVICES=<MIG UUID>`; the MIG user guide, "CUDA
Device Enumeration", takes MIG UUIDs there), in exclusive-process mode set on the MIG device handle
("If MIG is enabled on a GPU, device must be MIG device handle": nvml.h nvmlDeviceSetComputeMode).
Those daemons live as long as their claim is prepared; the reconcile (`enforce`) looks at whole GPUs
only and leaves them alone: one that stops answering is started again by `restart`
(`sharing.rollout.mps.watch_claim_mps`).

In the agent's pod the daemons are started by the MPS keeper, a container of their own
(`sharing.gpu.mpskeeper`), so that a restart of the agent's container leaves them serving; without
a keeper (an agent run by hand, tests) they are started here, as children of this process.
"""

from __future__ import annotations

import asyncio
import enum
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from sharing.devices import MpsSettings, pipe_dir
from sharing.errors import BackendError
from sharing.gpu.mpscontrol import control_env, log_dir, run_control
from sharing.gpu.mpskeeper import ask_keeper
from sharing.mig import Outcome
from sharing.model import Gpu, GpuUuid, NodeState
from sharing.text import bounded

log = structlog.get_logger(__name__)

KEEPER_GRACE_S = 5.0
"""How much longer than the tool's own deadline the agent waits for the keeper's answer."""

ComputeMode = Callable[[GpuUuid, bool], Awaitable[None]]
"""Set a GPU's compute mode: exclusive-process (True) or default (False)."""


@dataclass(frozen=True, slots=True)
class Enforced:
    """What a daemon answered when asked for its defaults."""

    active_thread_percentage: int
    pinned_memory_mib: int

    def matches(self, settings: MpsSettings) -> bool:
        """True when these are the settings' limits."""
        return (self.active_thread_percentage, self.pinned_memory_mib) == (
            settings.active_thread_percentage,
            settings.pinned_memory_mib,
        )


class Readiness(enum.Enum):
    """Where a GPU's MPS layout stands: its devices are advertised, advertised unhealthy, or not at all."""

    READY = "ready"
    """The daemon answers with the layout's limits."""
    DOWN = "down"
    """It was started for these limits and no longer answers (its replicas are unhealthy)."""
    PENDING = "pending"
    """No daemon enforces them yet (the layout's devices are not advertised)."""


@dataclass(frozen=True, slots=True)
class MpsResult:
    """What `enforce` did for one GPU: APPLIED, UNCHANGED, BLOCKED or FAILED, and why."""

    outcome: Outcome
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Servers:
    """A daemon's MPS servers as it lists them."""

    count: int = 0
    idle: int = 0
    """Those without a client."""
    clients: tuple[int, ...] = ()
    """The PIDs of the others' clients (as the daemon sees them)."""

    @property
    def serving(self) -> bool:
        """Some server has clients (or its clients could not be read)."""
        return self.count > self.idle


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """One GPU's daemon, for `sharing status` and /metrics."""

    gpu: GpuUuid
    pipe_directory: str
    wanted: MpsSettings
    enforced: Enforced | None
    """What it answered at the last look; None: it did not answer."""
    restarts: int
    error: str = ""

    @property
    def healthy(self) -> bool:
        """It answers and enforces what is wanted."""
        return self.enforced is not None and self.enforced.matches(self.wanted)


class MpsDaemons:
    """The control daemons of this node's MPS GPUs."""

    def __init__(
        self,
        root: Path,
        control: Path,
        compute_mode: ComputeMode,
        *,
        timeout_s: float = 10.0,
        keeper: Path | None = None,
    ) -> None:
        self.root = root
        self.control = control
        self._compute_mode = compute_mode
        self._timeout_s = timeout_s
        self._keeper = keeper
        """The MPS keeper's socket: daemons are started there (`sharing.gpu.mpskeeper`); None: here."""
        self._wanted: dict[GpuUuid, MpsSettings] = {}
        self._enforced: dict[GpuUuid, Enforced | None] = {}
        self._restarts: dict[GpuUuid, int] = {}
        self._errors: dict[GpuUuid, str] = {}
        self._lock = asyncio.Lock()
        """One look or change at a time: a look during a restart must not record a stale answer."""

    def pipe_dir(self, gpu: str) -> Path:
        """The host directory of the GPU's control pipe."""
        return Path(pipe_dir(str(self.root), gpu))

    def log_dir(self, gpu: str) -> Path:
        """The host directory of the GPU's daemon log."""
        return log_dir(self.root, gpu)

    @property
    def shm_dir(self) -> Path:
        """The host directory clients and servers share as /dev/shm."""
        return self.root / "shm"

    def readiness(self, gpu: GpuUuid, settings: MpsSettings) -> Readiness:
        """Whether the GPU's daemon enforces `settings`, was started for them and is gone, or neither."""
        enforced = self._enforced.get(gpu)
        if enforced is not None and enforced.matches(settings):
            return Readiness.READY
        if self._wanted.get(gpu) == settings and enforced is None:
            return Readiness.DOWN
        return Readiness.PENDING

    def status(self) -> tuple[DaemonStatus, ...]:
        """Every GPU a daemon is wanted for, in UUID order."""
        return tuple(
            DaemonStatus(
                gpu,
                str(self.pipe_dir(gpu)),
                wanted,
                self._enforced.get(gpu),
                self._restarts.get(gpu, 0),
                self._errors.get(gpu, ""),
            )
            for gpu, wanted in sorted(self._wanted.items())
        )

    async def check(self) -> bool:
        """Ask every wanted daemon for its limits; True when an answer changed since the last look."""
        async with self._lock:
            return await self._check()

    async def _check(self) -> bool:
        changed = False
        for gpu in list(self._wanted):
            enforced = await self._read(gpu)
            if enforced != self._enforced.get(gpu):
                changed = True
                if enforced is None:
                    log.warning("mps_daemon_not_answering", gpu=gpu, pipe=str(self.pipe_dir(gpu)))
            self._enforced[gpu] = enforced
        return changed

    async def adopt(self, wanted: Mapping[GpuUuid, MpsSettings]) -> None:
        """Take on the daemons that already answer with `wanted`'s limits (an agent that waits for the
        node while another owns it: it starts, stops and restarts nothing, but its MPS replicas are
        ready where a daemon serves them)."""
        async with self._lock:
            for gpu, want in wanted.items():
                current = await self._read(gpu)
                if current is not None and current.matches(want):
                    self._wanted[gpu], self._enforced[gpu] = want, current

    async def enforce(
        self, wanted: Mapping[GpuUuid, MpsSettings], node: NodeState
    ) -> dict[GpuUuid, MpsResult]:
        """Make each GPU's daemon enforce `wanted` (absent: no daemon), never stopping a daemon whose
        GPU runs processes; the result per GPU of `node` that has or wants a daemon."""
        async with self._lock:
            return await self._enforce(wanted, node)

    async def _enforce(
        self, wanted: Mapping[GpuUuid, MpsSettings], node: NodeState
    ) -> dict[GpuUuid, MpsResult]:
        results: dict[GpuUuid, MpsResult] = {}
        for gpu in node.gpus:
            want = wanted.get(gpu.uuid)
            had = self._wanted.get(gpu.uuid)
            current = await self._read(gpu.uuid)
            if want is None:
                if current is None and had is None and not self.pipe_dir(gpu.uuid).parent.exists():
                    continue
                if current is not None and await self._in_use(gpu):
                    results[gpu.uuid] = MpsResult(
                        Outcome.BLOCKED, _busy(gpu.index, "stopping its MPS daemon")
                    )
                    continue
                results[gpu.uuid] = await self._stop(gpu.uuid, current is not None)
                self._forget(gpu.uuid)
                continue
            if current is not None and current.matches(want):
                self._wanted[gpu.uuid], self._enforced[gpu.uuid] = want, current
                self._errors.pop(gpu.uuid, None)
                results[gpu.uuid] = MpsResult(Outcome.UNCHANGED)
                continue
            if await self._in_use(gpu):
                # New limits for running clients would mean quitting their server; without a daemon,
                # the processes running there would share the GPU with the clients to come.
                doing = "restarting its MPS daemon with new limits" if current else "starting its MPS daemon"
                if had == want:
                    self._enforced[gpu.uuid] = current
                results[gpu.uuid] = MpsResult(Outcome.BLOCKED, _busy(gpu.index, doing))
                continue
            restart = had == want  # the same limits wanted again: the daemon died or was stopped
            results[gpu.uuid] = await self._start(gpu.uuid, want, running=current is not None)
            if restart and results[gpu.uuid].outcome is Outcome.APPLIED:
                self._restarts[gpu.uuid] = self._restarts.get(gpu.uuid, 0) + 1
        return results

    async def serve(self, device: str, want: MpsSettings) -> None:
        """Have `device`'s daemon enforce `want` (one already answering with them is kept, one with
        other limits is restarted); BackendError says why it could not be done."""
        async with self._lock:
            current = await self._read(device)
            if current is not None and current.matches(want):
                self._wanted[GpuUuid(device)], self._enforced[GpuUuid(device)] = want, current
                return
            result = await self._start(GpuUuid(device), want, running=current is not None)
            if result.outcome is Outcome.FAILED:
                raise BackendError(result.reason)

    async def restart(self, device: str, node: NodeState) -> MpsResult:
        """Start again the daemon `serve` started for a MIG device and that no longer answers with its
        limits: APPLIED (a restart, counted), BLOCKED while processes other than its idle servers run on
        the device (as a GPU's daemon waits for them: `enforce`), FAILED with why, UNCHANGED when it
        answers, is no longer wanted (its claim was unprepared) or its device is gone from `node`."""
        async with self._lock:
            want = self._wanted.get(GpuUuid(device))
            if want is None:
                return MpsResult(Outcome.UNCHANGED)
            current = await self._read(device)
            if current is not None and current.matches(want):
                self._enforced[GpuUuid(device)] = current
                return MpsResult(Outcome.UNCHANGED)
            found = next((ci for g in node.gpus for _, ci in g.mig_devices if ci.uuid == device), None)
            if found is None:
                return MpsResult(Outcome.UNCHANGED)
            if found.busy_beyond((await self._servers(device)).idle):
                return MpsResult(
                    Outcome.BLOCKED,
                    f"processes run on MIG device {device}: its MPS daemon is started again once they end",
                )
            result = await self._start(GpuUuid(device), want, running=current is not None)
            if result.outcome is Outcome.APPLIED:
                self._restarts[GpuUuid(device)] = self._restarts.get(GpuUuid(device), 0) + 1
            return result

    async def in_use(self, gpu: Gpu) -> bool:
        """Whether processes run on the GPU other than its daemon's servers without clients."""
        async with self._lock:
            return await self._in_use(gpu)

    async def servers(self, device: str) -> Servers:
        """The MPS servers of `device`'s daemon (none when no daemon answers); BackendError when the
        tool cannot run."""
        async with self._lock:
            return await self._servers(device)

    async def stop_unused(self, gpu: GpuUuid) -> MpsResult:
        """Stop the GPU's daemon before its hardware changes, unless a client is attached to its
        servers (BLOCKED); its servers without clients go with it."""
        async with self._lock:
            current = await self._read(gpu)
            if current is None and not self.pipe_dir(gpu).parent.exists():
                return MpsResult(Outcome.UNCHANGED)
            servers = await self._servers(gpu)
            if servers.serving:
                return MpsResult(Outcome.BLOCKED, "MPS clients are attached to its daemon's server")
            result = await self._stop(gpu, current is not None)
            if result.outcome is Outcome.APPLIED:
                self._forget(gpu)
            return result

    async def end(self, device: str, *, restore_mode: bool = False) -> None:
        """Stop `device`'s daemon (if it runs) and remove its directories; BackendError says why not.
        Its compute mode is left (the MIG device goes next, or is gone, and the mode with it) unless
        `restore_mode`: a device that stays (one the agent did not make) goes back to DEFAULT."""
        async with self._lock:
            if await self._read(device) is not None:
                await self._quit(GpuUuid(device))
            if restore_mode:
                await self._compute_mode(GpuUuid(device), False)
            await asyncio.to_thread(shutil.rmtree, self.root / device, True)
            self._forget(GpuUuid(device))
            self._restarts.pop(GpuUuid(device), None)  # its claim is gone: so are its figures
        log.info("mps_daemon_stopped", gpu=device)

    # ---- one daemon --------------------------------------------------------------------------

    async def _start(self, gpu: GpuUuid, want: MpsSettings, *, running: bool) -> MpsResult:
        self._wanted[gpu] = want
        try:
            if running:
                await self._quit(gpu)
            await self._compute_mode(gpu, True)
            for path in (self.pipe_dir(gpu), self.log_dir(gpu), self.shm_dir):
                await asyncio.to_thread(path.mkdir, parents=True, exist_ok=True)
            started = await self._launch(gpu)
            if started[0] != 0:
                raise BackendError(f"nvidia-cuda-mps-control -d failed: {bounded(started[1], 300)}")
            commands = (
                f"set_default_active_thread_percentage {want.active_thread_percentage}\n"
                f"set_default_device_pinned_mem_limit 0 {want.pinned_memory_mib}M\n"
            )
            set_ = await self._run([], commands, self._env(gpu))
            if set_[0] != 0:
                raise BackendError(f"setting the limits failed: {bounded(set_[1], 300)}")
            enforced = await self._read(gpu)
        except (BackendError, OSError) as err:
            self._enforced[gpu] = None
            self._errors[gpu] = bounded(str(err), 300)
            log.error("mps_daemon_failed", gpu=gpu, error=self._errors[gpu])
            return MpsResult(
                Outcome.FAILED, f"its MPS control daemon could not be started: {self._errors[gpu]}"
            )
        self._enforced[gpu] = enforced
        if enforced is None or not enforced.matches(want):
            self._errors[gpu] = f"it answers {enforced} instead of the limits it was given"
            return MpsResult(Outcome.FAILED, f"its MPS control daemon {self._errors[gpu]}")
        self._errors.pop(gpu, None)
        log.info(
            "mps_daemon_started",
            gpu=gpu,
            active_thread_percentage=want.active_thread_percentage,
            pinned_memory_mib=want.pinned_memory_mib,
            pipe=str(self.pipe_dir(gpu)),
        )
        return MpsResult(Outcome.APPLIED)

    async def _stop(self, gpu: GpuUuid, running: bool) -> MpsResult:
        try:
            if running:
                await self._quit(gpu)
            await self._compute_mode(gpu, False)
        except BackendError as err:
            return MpsResult(
                Outcome.FAILED, f"its MPS control daemon could not be stopped: {bounded(str(err))}"
            )
        await asyncio.to_thread(shutil.rmtree, self.root / gpu, True)
        log.info("mps_daemon_stopped", gpu=gpu)
        return MpsResult(Outcome.APPLIED)

    async def _quit(self, gpu: GpuUuid) -> None:
        """`quit`, then wait until the daemon no longer answers (its servers end with it)."""
        await self._run([], "quit\n", self._env(gpu))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        delay = 0.01
        while (self.pipe_dir(gpu) / "control").exists() and await self._read(gpu) is not None:
            if loop.time() >= deadline:
                raise BackendError(f"the MPS control daemon of {gpu} still answers after quit")
            await asyncio.sleep(delay)  # the daemon's own exit, with a deadline
            delay = min(delay * 2, 0.2)

    async def _in_use(self, gpu: Gpu) -> bool:
        if not gpu.busy:
            return False
        return gpu.busy_beyond((await self._servers(gpu.uuid)).idle)

    async def _servers(self, device: str) -> Servers:
        if not (self.pipe_dir(device) / "control").exists():
            return Servers()
        env = self._env(device)
        code, out = await self._run([], "get_server_list\n", env)
        pids = _pids(out) if code == 0 else ()
        if not pids:  # no server, or no daemon that answers (and a server of none is not ours)
            return Servers()
        idle, clients = 0, list[int]()
        for pid in pids:
            code, out = await self._run([], f"get_client_list {pid}\n", env)
            listed = _pids(out) if code == 0 else None
            if listed == ():
                idle += 1
            else:  # clients, or an answer that is not a list of them: in use
                clients.extend(listed or ())
        return Servers(len(pids), idle, tuple(clients))

    def _forget(self, gpu: GpuUuid) -> None:
        for kept in (self._wanted, self._enforced, self._errors):
            kept.pop(gpu, None)

    async def _read(self, gpu: str) -> Enforced | None:
        """The daemon's defaults, or None when it does not answer."""
        if not (self.pipe_dir(gpu) / "control").exists():
            return None
        code, out = await self._run(
            [],
            "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit 0\n",
            self._env(gpu),
        )
        lines = out.split()
        if code != 0 or len(lines) != 2:
            return None
        try:
            return Enforced(int(float(lines[0])), _mib(lines[1]))
        except ValueError:
            return None

    def _env(self, gpu: str) -> dict[str, str]:
        return control_env(self.root, self.control, gpu)

    async def _launch(self, gpu: GpuUuid) -> tuple[int, str]:
        """`nvidia-cuda-mps-control -d` for the GPU, through the keeper when there is one (the daemon
        then outlives this process's container), else as a child of this process."""
        if self._keeper is not None:
            return await ask_keeper(self._keeper, gpu, timeout_s=self._timeout_s + KEEPER_GRACE_S)
        return await self._run(["-d"], "", control_env(self.root, self.control, gpu, visible=True))

    async def _run(self, args: list[str], stdin: str, env: dict[str, str]) -> tuple[int, str]:
        return await run_control(self.control, args, stdin, env, self._timeout_s)


def _busy(index: int, doing: str) -> str:
    return f"processes run on GPU {index} (MPS clients or others): {doing} waits until they end"


def _pids(text: str) -> tuple[int, ...] | None:
    """The PIDs the tool printed, one a line; None when a line is not one."""
    try:
        return tuple(int(line) for line in text.split())
    except ValueError:
        return None


def _mib(text: str) -> int:
    """`3G`, `512M` or `0` (as get_default_device_pinned_mem_limit prints it) in MiB."""
    if text.endswith("G"):
        return int(text[:-1]) * 1024
    if text.endswith("M"):
        return int(text[:-1])
    return int(text)
