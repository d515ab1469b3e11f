"""The usage sampler: every `usage.intervalSeconds`, on a thread of its own, what the GPUs do and whose it is.

Off the reconcile path: it reads NVML through a reader of its own (`GpuBackend.usage_reader`, not the
backend's worker), maps each process's host PID to its pod and container through the host's
`/proc/<pid>/cgroup` (the chart mounts the host's /proc read-only; no hostPID), the pod's UID to its
namespace and name through the pods the API server bound to this node (listed again when a process
names a pod or container not known yet; one still unknown, every POD_RELIST_S), asks the agent who holds
which slice, attributes (`sharing.usage.attribute`), updates each held slice's window
(`sharing.usage.window`), hands the slices that became idle to `on_idle` (the agent's `SliceIdle`
Events, `sharing.usage.idle`) and publishes one report. The windows are written to the state directory
every SAVE_EVERY_S, when the sampler stops, and at once when a slice's idle Event is handed on (so a
restart does not say it again). A sample that fails is logged and the next one tried;
nothing here stops the agent. The thread's CPU time is counted (`cpu_seconds`): what the bench reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from sharing.errors import SharingError
from sharing.gpu.backend import UsageReader
from sharing.gpu.nvmllib import name_os_thread
from sharing.model import BoundPod
from sharing.text import bounded
from sharing.usage import store
from sharing.usage.attribute import HeldSlice, Pod, attribute, pods_by_uid
from sharing.usage.cgroup import PodProcess, pod_of
from sharing.usage.idle import newly_idle
from sharing.usage.report import SliceReport, UsageReport, summarise
from sharing.usage.window import History, SliceKey, record

log = structlog.get_logger(__name__)

POD_RELIST_S = 30.0
SAVE_EVERY_S = 60.0
THREAD = "usage"
"""The sampler thread's name (and its OS thread's: `/proc/<pid>/task/<tid>/comm`)."""

HeldSource = Callable[[], Sequence[HeldSlice] | None]
"""Who holds which slice now; None when that cannot be told (PodResources unreadable)."""
PodSource = Callable[[], Sequence[BoundPod]]
"""The pods the API server bound to this node (blocking; raises SharingError)."""
IdleSink = Callable[[Sequence[SliceReport]], None]
"""Told the slices that became idle (each once per pod and slice); must not block."""


class UsageSampler:
    """Samples on its own thread (`start`/`stop`), or once per `sample()` (tests, the bench)."""

    def __init__(
        self,
        reader: UsageReader,
        *,
        held: HeldSource,
        pods: PodSource,
        proc: Path,
        state: Path | None,
        interval_s: float,
        window_s: float,
        idle_after_s: float = 1800.0,
        on_idle: IdleSink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reader = reader
        self.held = held
        self.pods = pods
        self.proc = proc
        self.state = state
        self.interval_s = interval_s
        self.window_s = window_s
        self.idle_after_s = idle_after_s
        self.on_idle = on_idle
        """None: no idle Events (`usage.idleEvents` off)."""
        self.clock = clock
        self.report: UsageReport | None = None
        """The latest sample's report (None before the first)."""
        self.cpu_seconds = 0.0
        """CPU time the samples took on their thread, so far."""
        self.samples = 0
        self.histories: dict[SliceKey, History] = {}
        self._pods: dict[str, Pod] = {}
        self._asked: dict[str, float] = {}
        """Per pod UID not known at the last list: when it was asked for."""
        self._saved_at = clock()
        self._loaded = False
        self._said: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Sample now and every interval on the sampler's thread, until `stop`."""
        self._thread = threading.Thread(target=self._run, name=THREAD, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop sampling (a sample under way finishes), save the windows, release the reader."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("usage_sampler_not_stopped", waited_s=timeout_s)
                return
        self._save()
        self.reader.close()

    def _run(self) -> None:
        name_os_thread(THREAD.encode())
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as err:  # a bug or a driver failure must not end sampling
                log.warning("usage_sample_failed", error=f"{type(err).__name__}: {bounded(str(err))}")
            self._stop.wait(self.interval_s)

    def sample(self) -> UsageReport:
        """One sample: read, attribute, update the windows, publish the report."""
        started = time.thread_time()
        try:
            return self._sample()
        finally:
            self.cpu_seconds += time.thread_time() - started
            self.samples += 1

    def _sample(self) -> UsageReport:
        if not self._loaded:
            self._load()
        readings = self.reader.read()
        problems: list[str] = []
        owners = self._owners({p.pid for _, _, p in readings.processes()}, problems)
        held = self._held()
        pods = self._known_pods(owners, problems)
        attribution = attribute(readings, held or (), owners, pods)
        if held is not None:
            read = {d.uuid for g in readings.gpus for d in g.devices}
            self.histories = record(
                self.histories,
                [u for u in attribution.slices if u.held.uuid in read],
                readings.at,
                self.window_s,
            )
        report = summarise(
            readings,
            attribution,
            self.histories,
            interval_s=self.interval_s,
            window_s=self.window_s,
            holders_known=held is not None,
            idle_after_s=self.idle_after_s,
            problems=tuple(problems),
        )
        if self.on_idle is not None:
            self._tell_idle(report)
        self.report = report
        if self.clock() - self._saved_at >= SAVE_EVERY_S:
            self._save()
        return report

    # ---- whose processes -----------------------------------------------------------------------

    def _owners(self, pids: set[int], problems: list[str]) -> dict[int, PodProcess]:
        """Pod and container of each PID whose cgroup says it is a pod's."""
        owners: dict[int, PodProcess] = {}
        if pids and not (self.proc / "self").exists():
            problems.append(f"the host's /proc is not readable at {self.proc}: every process is unattributed")
            self._once("proc", "usage_proc_unreadable", proc=str(self.proc))
            return owners
        for pid in pids:
            try:
                text = (self.proc / str(pid) / "cgroup").read_text("utf-8", "replace")
            except OSError:
                continue  # ended since NVML listed it, or not ours to see
            found = pod_of(text)
            if found is not None:
                owners[pid] = found
        return owners

    def _known_pods(self, owners: dict[int, PodProcess], problems: list[str]) -> dict[str, Pod]:
        """The pods by UID, listed again when a process names a pod (or container) not known yet; a pod
        still unknown after that is asked for again only POD_RELIST_S later."""
        now = self.clock()
        unknown = {
            o.pod_uid
            for o in owners.values()
            if o.pod_uid not in self._pods
            or (o.container_id and o.container_id not in self._pods[o.pod_uid].containers)
        }
        if any(now - self._asked.get(uid, -POD_RELIST_S) >= POD_RELIST_S for uid in unknown):
            self._asked = dict.fromkeys(unknown, now)
            try:
                self._pods = pods_by_uid(self.pods())
                self._said.discard("pods")
            except SharingError as err:
                self._once("pods", "usage_pods_unread", error=bounded(str(err)))
        missing = {o.pod_uid for o in owners.values()} - set(self._pods)
        if missing:
            problems.append(
                f"processes of {len(missing)} pod(s) this node's pod list does not name are unattributed"
            )
        return self._pods

    def _held(self) -> Sequence[HeldSlice] | None:
        try:
            held = self.held()
        except Exception as err:  # the agent's loop stopping, PodResources failing
            self._once("held", "usage_holders_unread", error=f"{type(err).__name__}: {bounded(str(err))}")
            return None
        if held is not None:
            self._said.discard("held")
        return held

    def _tell_idle(self, report: UsageReport) -> None:
        self.histories, idle = newly_idle(self.histories, report.slices)
        if not idle:
            return
        self._save()  # said once: remembered before it is said, across a crash too
        assert self.on_idle is not None
        try:
            self.on_idle(idle)
        except Exception as err:  # the agent's loop stopping: the Event is not said, never the sampler
            log.warning("usage_idle_not_told", error=f"{type(err).__name__}: {bounded(str(err))}")

    # ---- the windows on disk -------------------------------------------------------------------

    def _load(self) -> None:
        self._loaded = True
        if self.state is None:
            return
        try:
            self.histories = store.load(self.state)
        except store.WindowFileError as err:
            log.warning("usage_windows_not_loaded", error=str(err))

    def _save(self) -> None:
        self._saved_at = self.clock()
        if self.state is None or not self._loaded:
            return
        try:
            store.save(self.state, self.histories)
        except OSError as err:
            log.warning("usage_windows_not_saved", path=str(self.state), error=err.strerror)

    def _once(self, what: str, event: str, **context: object) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning(event, **context)
