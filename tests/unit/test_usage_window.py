"""Each held slice's window: idle time, peak memory and SM p95 in hourly buckets, and its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharing.usage import store
from sharing.usage.attribute import HeldSlice, SliceUse
from sharing.usage.window import BUCKET_SECONDS, SM_BINS, History, SliceKey, key_of, record, sm_bin

GIB = 1 << 30
HOUR = BUCKET_SECONDS
DAY = 24 * HOUR
T0 = 1_767_000_000 // HOUR * HOUR  # an hour's start
A = HeldSlice("nvidia.com/gpu.shared", "GPU-a::0", "GPU-a", "GPU-a", "ml", "a", "main")
B = HeldSlice("nvidia.com/gpu.shared", "GPU-a::1", "GPU-a", "GPU-a", "ml", "b", "main")


def use(held: HeldSlice, memory: int, sm: float | None, *pids: int) -> SliceUse:
    return SliceUse(held, memory, 24 * GIB, sm, pids)


def run(samples: list[tuple[float, list[SliceUse]]], window: float = DAY) -> dict[SliceKey, History]:
    histories: dict[SliceKey, History] = {}
    for at, uses in samples:
        histories = record(histories, uses, at, window)
    return histories


@pytest.mark.parametrize(
    ("share", "expected"),
    [(0.0, 0), (0.049, 0), (0.05, 1), (0.5, 10), (0.951, 19), (1.0, 19), (1.7, 19), (-0.1, 0)],
)
def test_sm_bins_are_5_percent_wide(share: float, expected: int) -> None:
    assert expected == sm_bin(share)


def test_idle_counts_from_the_last_process_or_from_when_it_was_held() -> None:
    histories = run(
        [(T0, [use(A, GIB, 0.5, 10), use(B, 0, 0.0)]), (T0 + 600, [use(A, 0, 0.0), use(B, 0, 0.0)])]
    )
    assert 600 == histories[key_of(A)].idle_seconds(T0 + 600)  # its process ended after the first sample
    assert 900 == histories[key_of(B)].idle_seconds(T0 + 900)  # never used since it was first held
    assert histories[key_of(B)].last_active is None


def test_peak_and_p95_over_the_window_only() -> None:
    busy = [(T0 + i * 60, [use(A, 8 * GIB, 0.9, 10)]) for i in range(10)]  # the first hour: 8 GiB at 90 %
    later = [(T0 + 2 * HOUR + i * 60, [use(A, 2 * GIB, 0.2, 10)]) for i in range(30)]
    histories = run(busy + later, window=2 * HOUR)
    history = histories[key_of(A)]
    assert [T0, T0 + 2 * HOUR] == [b.start for b in history.buckets]
    assert 8 * GIB == history.peak_bytes(T0 + 2 * HOUR + 1800, 2 * HOUR)
    # 30 samples at 20 % and 10 at 90 %: the p95 is in the 90 % bin (its upper edge, 95 %).
    assert 0.95 == history.sm_p95(T0 + 2 * HOUR + 1800, 2 * HOUR)
    # An hour on, the busy hour has left the window, and the next sample drops it.
    assert 2 * GIB == history.peak_bytes(T0 + 3 * HOUR + 1, 2 * HOUR)
    assert 0.25 == history.sm_p95(T0 + 3 * HOUR + 1, 2 * HOUR)
    after = record(histories, [use(A, GIB, None, 10)], T0 + 3 * HOUR + 1, 2 * HOUR)[key_of(A)]
    assert [T0 + 2 * HOUR, T0 + 3 * HOUR] == [b.start for b in after.buckets]


def test_unknown_sm_counts_for_memory_only() -> None:
    history = run([(T0, [use(A, 3 * GIB, None, 10)])])[key_of(A)]
    assert (3 * GIB, None, 0) == (
        history.peak_bytes(T0, DAY),
        history.sm_p95(T0, DAY),
        history.samples(T0, DAY),
    )


def test_a_slice_no_longer_held_is_forgotten() -> None:
    histories = run([(T0, [use(A, GIB, 0.1, 10), use(B, GIB, 0.1, 20)]), (T0 + 10, [use(B, GIB, 0.1, 20)])])
    assert [key_of(B)] == list(histories)


def test_memory_is_bounded_by_the_window_whatever_the_interval() -> None:
    samples = [(T0 + i * 10.0, [use(A, i, 0.5, 10)]) for i in range(0, 3 * DAY // 10, 7)]
    history = run(samples)[key_of(A)]
    assert len(history.buckets) <= DAY // HOUR + 1
    assert all(len(b.sm) == SM_BINS for b in history.buckets)


def test_the_windows_survive_a_restart_through_their_file(tmp_path: Path) -> None:
    path = tmp_path / "usage.json"
    histories = run(
        [(T0, [use(A, GIB, 0.5, 10), use(B, 0, None)]), (T0 + HOUR, [use(A, 2 * GIB, 0.1), use(B, 0, None)])]
    )
    store.save(path, histories)
    assert histories == store.load(path)
    document = json.loads(path.read_text())
    assert (1, 3600, 20) == (document["version"], document["bucketSeconds"], document["smBins"])
    assert {"namespace": "ml", "pod": "b", "container": "main", "resource": "nvidia.com/gpu.shared",
            "device": "GPU-a::1", "firstHeld": T0, "lastActive": None, "idleSaid": False} == {
        k: v for k, v in document["slices"][1].items() if k != "buckets"
    }  # fmt: skip


def test_no_file_is_no_windows(tmp_path: Path) -> None:
    assert {} == store.load(tmp_path / "usage.json")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        pytest.param(b"\x00\xff not json", "not a usage window file", id="junk"),
        pytest.param(b'{"version": 2, "slices": []}', "not a version 1 document", id="another-version"),
        pytest.param(
            b'{"version": 1, "bucketSeconds": 60, "smBins": 20, "slices": []}',
            "buckets of 3600 s",
            id="other-buckets",
        ),
        pytest.param(
            json.dumps(
                {
                    "version": 1,
                    "bucketSeconds": 3600,
                    "smBins": 20,
                    "slices": [
                        {
                            "namespace": "ml",
                            "pod": "a",
                            "container": "c",
                            "resource": "r",
                            "device": "d",
                            "firstHeld": 1.0,
                            "lastActive": None,
                            "buckets": [{"start": 0, "peakBytes": -1, "sm": [0] * 20}],
                        }
                    ],
                }
            ).encode(),
            "peakBytes is not a whole number",
            id="negative-bytes",
        ),
        pytest.param(
            b'{"version": 1, "bucketSeconds": 3600, "smBins": 20, "slices": [{"namespace": 1}]}',
            "namespace is not a string",
            id="wrong-type",
        ),
    ],
)
def test_a_file_that_is_not_ours_is_moved_aside(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "usage.json"
    path.write_bytes(content)
    with pytest.raises(store.WindowFileError, match=why) as raised:
        store.load(path)
    assert "was moved to" in str(raised.value)
    assert not path.exists()
    assert content == (tmp_path / "usage.json.corrupt").read_bytes()


def test_a_directory_in_its_place_is_refused(tmp_path: Path) -> None:
    (tmp_path / "usage.json").mkdir()
    with pytest.raises(store.WindowFileError, match="a directory"):
        store.load(tmp_path / "usage.json")
