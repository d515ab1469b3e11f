"""The lab's image cache: another checkout's archive of the same image stays while it may be in use."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from lab import images


def test_an_archive_used_within_the_hour_survives_another_checkouts_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARING_CACHE", str(tmp_path))
    store = tmp_path / "images"
    store.mkdir()
    theirs, old = store / "agent-theirs.tar", store / "agent-old.tar"
    theirs.write_text("handed to another checkout a moment ago")
    old.write_text("last used two hours ago")
    hours_ago = time.time() - 2 * images.STALE_S
    os.utime(old, (hours_ago, hours_ago))

    ours = images._cached("agent", "ours", lambda out: out.write_text("built"))

    assert "built" == ours.read_text()
    assert theirs.exists()
    assert not old.exists()


def test_handing_out_a_cached_archive_marks_it_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARING_CACHE", str(tmp_path))
    (tmp_path / "images").mkdir()
    kept = tmp_path / "images" / "agent-k.tar"
    kept.write_text("x")
    hours_ago = time.time() - 2 * images.STALE_S
    os.utime(kept, (hours_ago, hours_ago))

    assert kept == images._cached("agent", "k", lambda out: pytest.fail("built again"))
    assert time.time() - kept.stat().st_mtime < images.STALE_S
