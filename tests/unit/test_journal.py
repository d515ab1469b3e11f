"""The journal and the last-good file as they are found on disk after crashes, bugs and meddling.

A corrupt file must never stop the node: it is moved aside, reported with a bounded message, and
the applier plans from what the GPUs really are. Two appliers (the agent and `sharing apply`) never
run hardware steps at the same time.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from sharing.mig.catalog import default_catalog
from sharing.mig.change import Target
from sharing.model import GpuUuid
from sharing.store.journal import Journal, JournalCorruptError, JournalError, JournalLockedError
from sharing.store.memory import LastGood, LastGoodError, Remembered

CATALOG = default_catalog()

GPU = GpuUuid("GPU-5f1c3a52-0c1d-4d3e-9f00-2b8a1e6c7d90")
BEGIN = json.dumps({"event": "begin", "targets": {GPU: {"mig": True, "instances": [["1g.5gb", 2]]}}})


@pytest.mark.parametrize(
    ("content", "why"),
    [
        pytest.param(b"\x00\xff\xfe junk \x80\n", "not UTF-8", id="binary-junk"),
        pytest.param(b"[1, 2, 3]\n", "line 1: not a journal entry", id="json-not-an-object"),
        pytest.param(b'{"targets": {}}\n', "line 1: not a journal entry", id="missing-key"),
        pytest.param(
            b'{"event": "begin", "targets": {"GPU-1": {"mig": "yes", "instances": []}}}\n',
            "line 1: not a journal entry",
            id="wrong-type",
        ),
        pytest.param(
            b'{"event": "step", "n": 1, "gpu": "GPU-1", "step": "x"}\n', "begin entry", id="no-begin"
        ),
        pytest.param(
            (
                BEGIN
                + "\n"
                + json.dumps({"event": "step", "n": 1, "gpu": "G" * 2_000_000, "step": "x"})
                + "\n"
            ).encode(),
            "larger than",
            id="a-2MB-line",
        ),
    ],
)
def test_a_corrupt_journal_is_moved_aside_and_reported_briefly(
    tmp_path: Path, content: bytes, why: str
) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    journal.path.write_bytes(content)
    with pytest.raises(JournalCorruptError) as err:
        journal.unfinished()
    message = str(err.value)
    assert why in message
    assert "moved to" in message
    assert len(message) < 600
    assert not journal.path.exists()
    assert content == journal.path.with_name("journal.jsonl.corrupt").read_bytes()
    assert journal.unfinished() is None  # the next run starts clean


def test_a_fifo_journal_is_set_aside_without_waiting_for_a_writer(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    os.mkfifo(journal.path)
    raised: list[BaseException] = []

    def read() -> None:
        try:
            journal.unfinished()
        except BaseException as err:  # handed to the test
            raised.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked in open(): free it before failing
        with open(journal.path, "wb"):
            pass
        reader.join()
        pytest.fail("reading a FIFO journal blocked until a writer came")
    (err,) = raised
    assert isinstance(err, JournalCorruptError)
    assert (
        f"the apply journal {journal.path} is corrupt (a FIFO, not a regular file); it was moved to"
        in str(err)
    )
    assert journal.unfinished() is None


def test_a_lock_file_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    journal.lock_path.mkdir()
    with pytest.raises(JournalError) as err, journal.locked():
        pass
    assert str(journal.lock_path) in str(err.value)


def test_a_corrupt_journal_that_cannot_be_moved_aside_says_so_in_words(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    journal.path.write_bytes(b"junk\n")
    (tmp_path / "journal.jsonl.corrupt").mkdir()
    (tmp_path / "journal.jsonl.corrupt" / "taken").touch()
    with pytest.raises(JournalCorruptError) as err:
        journal.unfinished()
    assert "; it could not be moved aside (" in str(err.value)
    assert "was could not" not in str(err.value)


def test_only_a_last_line_torn_by_a_crash_is_tolerated(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    journal.begin({GPU: Target(True, (("1g.5gb", 2),))})
    journal.done(journal.step(GPU, "create 1g.5gb@0"))
    journal.step(GPU, "create 1g.5gb@1")
    with open(journal.path, "a") as out:
        out.write('{"event": "step", "n": 3, "gpu"')  # torn by the crash: that step never started
    unfinished = journal.unfinished()
    assert unfinished is not None
    assert {GPU: Target(True, (("1g.5gb", 2),))} == unfinished.targets
    assert f"{GPU}: create 1g.5gb@1" == unfinished.in_flight


def test_a_crashed_runs_dynamic_gpu_stays_dynamic(tmp_path: Path) -> None:
    """Read back as a static target without instances, it would destroy the claims' instances."""
    journal = Journal(tmp_path / "journal.jsonl")
    journal.begin({GPU: Target(True, dynamic=True)})
    journal.step(GPU, "enable MIG")
    unfinished = journal.unfinished()
    assert unfinished is not None
    assert {GPU: Target(True, dynamic=True)} == unfinished.targets


def test_the_agent_and_sharing_apply_never_run_at_the_same_time(tmp_path: Path) -> None:
    one, two = Journal(tmp_path / "journal.jsonl"), Journal(tmp_path / "journal.jsonl")
    with one.locked():
        with pytest.raises(JournalLockedError) as err, two.locked():
            pass
        assert "another process (pid" in str(err.value)
    with two.locked():  # released: the next run gets it
        pass


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'["a list"]', id="not-an-object"),
        pytest.param(b'{"config": 7, "configmap": {}}', id="wrong-type"),
        pytest.param(b'{"config": "x", "configmap": {"x": 1}}', id="text-not-a-string"),
        pytest.param(b"\xff\xfe", id="junk"),
    ],
)
def test_a_last_good_file_of_the_wrong_shape_is_moved_aside(tmp_path: Path, content: bytes) -> None:
    memory = LastGood(tmp_path / "last-good.json")
    memory.path.write_bytes(content)
    with pytest.raises(LastGoodError, match=r"is not a last-good file .*; it was moved to "):
        memory.load()
    assert not memory.path.exists()
    assert memory.load() is None


def test_last_good_round_trips(tmp_path: Path) -> None:
    memory = LastGood(tmp_path / "last-good.json")
    saved = Remembered("mine", {"mine": "version: v1\n"}, {"all-1g": "version: v1\n"})
    memory.save(saved)
    assert saved == LastGood(memory.path).load()
