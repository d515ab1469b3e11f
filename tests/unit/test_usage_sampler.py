"""The usage sampler's loop: readings, the host's /proc, the pods and the holders into a report and windows.

The readings come from an in-memory reader of the sampler's own Protocol (`UsageReader`); the fake
driver's suite runs the NVML reader under it (tests/fakedriver/test_usage_reader.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import structlog

from sharing.errors import KubeError
from sharing.model import BoundPod, GpuUuid
from sharing.readings import DeviceReading, GpuReading, NodeReadings, ProcessReading
from sharing.usage import HeldSlice, UsageSampler
from sharing.usage.sampler import POD_RELIST_S, SAVE_EVERY_S
from tests.polling import poll

GIB = 1 << 30
GPU = "GPU-aaaa"
T0 = 1_767_000_000.0
UID_A, UID_B = "11111111-2222-3333-4444-555555555555", "66666666-7777-8888-9999-000000000000"
CTR_A, CTR_B = "a" * 64, "b" * 64
A = HeldSlice("nvidia.com/gpu.shared", f"{GPU}::0", GPU, GPU, "ml", "a", "main")
B = HeldSlice("nvidia.com/gpu.shared", f"{GPU}::1", GPU, GPU, "ml", "b", "main")


class Reader:
    """Readings a test sets; counts reads and closes."""

    def __init__(self) -> None:
        self.processes: tuple[ProcessReading, ...] = ()
        self.at = T0
        self.reads = 0
        self.closed = False
        self.fail: Exception | None = None

    def read(self) -> NodeReadings:
        self.reads += 1
        if self.fail is not None:
            raise self.fail
        device = DeviceReading(
            GPU, sum(p.memory_bytes or 0 for p in self.processes), 24 * GIB, self.processes
        )
        gpu = GpuReading(
            0, GpuUuid(GPU), 70.0, 40.0, device.memory_used_bytes, 24 * GIB, 0.5, False, False, (device,)
        )
        return NodeReadings(self.at, (gpu,))

    def close(self) -> None:
        self.closed = True


class World:
    """The host's /proc, the pod list and the holders the sampler is given."""

    def __init__(self, tmp: Path) -> None:
        self.proc = tmp / "proc"
        (self.proc / "self").mkdir(parents=True)
        self.pods: list[BoundPod] = []
        self.lists = 0
        self.held: Sequence[HeldSlice] | None = (A, B)
        self.now = 0.0
        self.reader = Reader()

    def process(self, pid: int, uid: str, container: str) -> None:
        (self.proc / str(pid)).mkdir()
        (self.proc / str(pid) / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/{container}\n")

    def list_pods(self) -> Sequence[BoundPod]:
        self.lists += 1
        return list(self.pods)

    def sampler(self, state: Path | None) -> UsageSampler:
        return UsageSampler(
            self.reader, held=lambda: self.held, pods=self.list_pods, proc=self.proc, state=state,
            interval_s=10.0, window_s=86400.0, clock=lambda: self.now,
        )  # fmt: skip


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = World(tmp_path)
    w.process(10, UID_A, CTR_A)
    w.process(20, UID_B, CTR_B)
    w.pods = [
        BoundPod("ml", "a", frozenset(), uid=UID_A, containers=((CTR_A, "main"),)),
        BoundPod("ml", "b", frozenset(), uid=UID_B, containers=((CTR_B, "main"),)),
    ]
    w.reader.processes = (ProcessReading(10, 3 * GIB, 0.5), ProcessReading(20, GIB, 0.2))
    return w


def test_each_slice_gets_its_own_pods_use(world: World, tmp_path: Path) -> None:
    report = world.sampler(tmp_path / "usage.json").sample()
    assert [(s.use.held.pod, s.use.memory_used_bytes, s.use.sm, s.idle_seconds) for s in report.slices] == [
        ("a", 3 * GIB, 0.5, 0.0),
        ("b", GIB, 0.2, 0.0),
    ]
    assert (report.unattributed, report.holders_known, report.problems) == ((), True, ())


def test_the_pods_are_listed_again_only_for_a_pod_not_known_yet(world: World, tmp_path: Path) -> None:
    sampler = world.sampler(None)
    sampler.sample()
    sampler.sample()
    assert 1 == world.lists
    world.process(30, "99999999-2222-3333-4444-555555555555", "c" * 64)
    world.reader.processes += (ProcessReading(30, GIB, 0.1),)
    world.now += 1
    report = sampler.sample()
    assert 2 == world.lists  # a new pod's process: listed again
    assert [30] == [p for u in report.unattributed for p in u.pids]  # not bound here: unattributed
    assert "processes of 1 pod(s)" in report.problems[0]
    sampler.sample()
    assert 2 == world.lists  # still unknown: not before POD_RELIST_S
    world.now += POD_RELIST_S
    sampler.sample()
    assert 3 == world.lists


def test_a_pod_list_that_fails_is_said_once_and_keeps_the_last(world: World) -> None:
    sampler = world.sampler(None)
    sampler.sample()

    def unreachable() -> Sequence[BoundPod]:
        raise KubeError("connection refused")

    sampler.pods = unreachable
    world.process(30, "99999999-2222-3333-4444-555555555555", "c" * 64)
    world.reader.processes += (ProcessReading(30, GIB, 0.1),)
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            world.now += POD_RELIST_S
            report = sampler.sample()
    assert 1 == sum(e["event"] == "usage_pods_unread" for e in logs)
    assert [3 * GIB, GIB] == [s.use.memory_used_bytes for s in report.slices]


def test_while_holders_are_unknown_no_slice_is_shown_and_no_window_moves(world: World) -> None:
    sampler = world.sampler(None)
    sampler.sample()
    before = dict(sampler.histories)
    world.held = None
    world.reader.at += 600
    report = sampler.sample()
    assert (False, ()) == (report.holders_known, report.slices)
    assert [10, 20] == [p for u in report.unattributed for p in u.pids]
    assert before == sampler.histories


def test_without_the_hosts_proc_every_process_is_unattributed(world: World, tmp_path: Path) -> None:
    world.proc = tmp_path / "not-mounted"
    report = world.sampler(None).sample()
    assert [0, 0] == [s.use.memory_used_bytes for s in report.slices]
    assert [10, 20] == [p for u in report.unattributed for p in u.pids]
    assert f"the host's /proc is not readable at {tmp_path / 'not-mounted'}" in report.problems[0]


def test_the_windows_are_saved_and_a_new_sampler_goes_on_from_them(world: World, tmp_path: Path) -> None:
    state = tmp_path / "usage.json"
    first = world.sampler(state)
    first.sample()
    assert not state.exists()  # saved every SAVE_EVERY_S and at the end, not every sample
    world.now += SAVE_EVERY_S
    world.reader.at += 60
    world.reader.processes = (ProcessReading(20, GIB, 0.2),)  # pod a's process ended
    first.sample()
    assert state.exists()
    first.stop()
    assert world.reader.closed
    world.reader.at += 600
    report = world.sampler(state).sample()
    a, b = report.slices
    assert (660.0, 3 * GIB) == (
        a.idle_seconds,
        a.peak_bytes,
    )  # idle since the process ended, before the restart
    assert (0.0, GIB) == (b.idle_seconds, b.peak_bytes)


def test_a_slice_idle_for_idle_after_is_told_once_per_pod_and_slice_across_restarts(
    world: World, tmp_path: Path
) -> None:
    state, told = tmp_path / "usage.json", []

    def sampler() -> UsageSampler:
        return UsageSampler(
            world.reader, held=lambda: world.held, pods=world.list_pods, proc=world.proc, state=state,
            interval_s=10.0, window_s=86400.0, idle_after_s=60.0, on_idle=told.extend,
            clock=lambda: world.now,
        )  # fmt: skip

    world.reader.processes = (ProcessReading(10, GIB, 0.5),)  # pod b runs nothing on its slice
    first = sampler()
    assert [False, False] == [s.idle for s in first.sample().slices]  # b held for 0 s
    world.reader.at += 59
    assert [False, False] == [s.idle for s in first.sample().slices]
    assert [] == told
    world.reader.at += 1
    assert [False, True] == [s.idle for s in first.sample().slices]
    assert [B] == [r.use.held for r in told]
    assert state.exists()  # remembered at once, not at the next save
    world.reader.at += 600
    first.sample()
    assert 1 == len(told)
    # A restart (the file as the crash left it): still idle, and not said again.
    again = sampler()
    world.reader.at += 600
    assert [False, True] == [s.idle for s in again.sample().slices]
    assert 1 == len(told)
    # A new pod holding b's slice is a new holder: its idle slice is said.
    b2 = HeldSlice(B.resource, B.device, B.uuid, B.gpu, "ml", "b2", "main")
    world.held = (A, b2)
    again.sample()
    world.reader.at += 60
    again.sample()
    assert [B, b2] == [r.use.held for r in told]


def test_without_idle_events_nothing_is_told_and_the_slice_still_shows_idle(world: World) -> None:
    world.reader.processes = ()
    sampler = UsageSampler(
        world.reader, held=lambda: world.held, pods=world.list_pods, proc=world.proc, state=None,
        interval_s=10.0, window_s=86400.0, idle_after_s=60.0, clock=lambda: world.now,
    )  # fmt: skip
    sampler.sample()
    world.reader.at += 60
    assert [True, True] == [s.idle for s in sampler.sample().slices]
    assert not any(h.idle_said for h in sampler.histories.values())


def test_the_thread_samples_until_stopped_and_survives_a_failing_read(world: World) -> None:
    sampler = world.sampler(None)
    world.reader.fail = RuntimeError("NVML_ERROR_UNKNOWN")
    with structlog.testing.capture_logs() as logs:
        sampler.interval_s = 0.01
        sampler.start()
        poll("a failed sample", lambda: world.reader.reads, lambda n: n >= 2, timeout=10)
        world.reader.fail = None
        poll("a report", lambda: sampler.report, lambda r: r is not None, timeout=10)
        sampler.stop()
    assert any(e["event"] == "usage_sample_failed" and "NVML_ERROR_UNKNOWN" in e["error"] for e in logs)
    assert world.reader.closed
    assert sampler.cpu_seconds > 0
    assert [] == [t for t in threading.enumerate() if t.name == "usage"]  # nothing samples once stopped
