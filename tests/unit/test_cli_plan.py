"""`sharing plan` and `sharing profiles` as a user runs them: JSON shape, exit codes, messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def sharing(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "sharing", *args], capture_output=True, text=True, env=env, check=False
    )


def test_plan_json_for_a_feasible_change() -> None:
    done = sharing(
        "plan",
        "--gpu",
        "NVIDIA A100-SXM4-40GB",
        "--want",
        "3g.20gb=1,2g.10gb=1,1g.5gb=2",
        "--have",
        "3g.20gb@4,1g.5gb@0:busy",
        "--json",
    )
    assert 0 == done.returncode, done.stderr
    assert {
        "feasible": True,
        "layout": [
            {"profile": "1g.5gb", "start": 0, "size": 1},
            {"profile": "1g.5gb", "start": 1, "size": 1},
            {"profile": "2g.10gb", "start": 2, "size": 2},
            {"profile": "3g.20gb", "start": 4, "size": 4},
        ],
        "keep": [{"profile": "1g.5gb", "start": 0, "size": 1}, {"profile": "3g.20gb", "start": 4, "size": 4}],
        "destroy": [],
        "create": [
            {"profile": "2g.10gb", "start": 2, "size": 2},
            {"profile": "1g.5gb", "start": 1, "size": 1},
        ],
    } == json.loads(done.stdout)


def test_plan_destroys_only_what_does_not_fit() -> None:
    done = sharing(
        "plan",
        "--gpu",
        "H100-80GB-HBM3",
        "--want",
        "3g.40gb=2",
        "--have",
        "3g.40gb@0:busy,2g.20gb@4,1g.10gb@6",
        "--json",
    )
    assert 0 == done.returncode, done.stderr
    answer = json.loads(done.stdout)
    assert [{"profile": "3g.40gb", "start": 0, "size": 4}] == answer["keep"]
    assert [
        {"profile": "2g.20gb", "start": 4, "size": 2},
        {"profile": "1g.10gb", "start": 6, "size": 1},
    ] == answer["destroy"]
    assert [{"profile": "3g.40gb", "start": 4, "size": 4}] == answer["create"]


def test_infeasible_exits_1_with_the_reason() -> None:
    done = sharing(
        "plan", "--gpu", "A100-SXM4-40GB", "--want", "7g.40gb=1", "--have", "1g.5gb@3:busy", "--json"
    )
    assert 1 == done.returncode
    answer = json.loads(done.stdout)
    assert False is answer["feasible"]
    assert "1g.5gb@3:busy on A100-SXM4-40GB is in use" in answer["reason"]


def test_picture_shows_the_slices_and_steps() -> None:
    done = sharing("plan", "--gpu", "A100-SXM4-40GB", "--want", "3g.20gb=1,1g.5gb=1", "--have", "3g.20gb@0")
    assert 0 == done.returncode, done.stderr
    lines = done.stdout.splitlines()
    assert "slot    0  1  2  3  4  5  6  7" in lines
    assert "now     A  A  A  A  .  .  .  ." in lines
    assert "target  A  A  A  A  B  .  .  ." in lines
    assert "  1. create  1g.5gb@4" in lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--gpu", "Tesla T4", "--want", "1g.5gb=1"],
            "T4 has no MIG: it can only be time-sliced or shared with MPS",
        ),
        (["--gpu", "Z100", "--want", "1g.5gb=1"], "unknown GPU 'Z100': give a catalog name, an NVML name"),
        (
            ["--gpu", "A100-SXM4-40GB", "--want", "1g.10gbx=1"],
            "--want: unknown MIG profile '1g.10gbx' on A100-SXM4-40GB",
        ),
        (["--gpu", "A100-SXM4-40GB", "--want", "1g.5gb"], "--want: '1g.5gb' is not PROFILE=COUNT"),
        (["--gpu", "A100-SXM4-40GB", "--want", "1g.5gb=1", "--have", "1g.5gb@7"], "1g.5gb cannot start at 7"),
        (
            ["--gpu", "A100-SXM4-40GB", "--want", "1g.5gb=1", "--have", "3g.20gb@0,1g.5gb@2"],
            "overlaps 3g.20gb@0",
        ),
        (
            ["--gpu", "A100-SXM4-40GB", "--want", "1g.5gb=1", "--have", "1g.5gb@0:idle"],
            "is not PROFILE@START",
        ),
        (["--want", "1g.5gb=1"], "the following arguments are required: --gpu"),
    ],
    ids=[
        "no-mig",
        "unknown-gpu",
        "profile",
        "want-syntax",
        "bad-start",
        "overlap",
        "have-syntax",
        "missing-flag",
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], message: str) -> None:
    done = sharing("plan", *args)
    assert 2 == done.returncode
    assert "" == done.stdout
    assert 1 == len(done.stderr.strip().splitlines()), done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_profiles_json() -> None:
    done = sharing("profiles", "--gpu", "NVIDIA A30", "--json")
    assert 0 == done.returncode, done.stderr
    profiles = json.loads(done.stdout)
    assert ["1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"] == [p["name"] for p in profiles]
    assert {
        "name": "2g.12gb",
        "id": 5,
        "enum": 1,
        "computeSlices": 2,
        "maxCount": 2,
        "memoryMiB": 11968,
        "memorySource": "issue 12 of this project (values it reports from posted "
        "nvidia-smi mig -lgip output; the posting itself was not found again) (11.69 GiB)",
        "multiprocessors": 28,
        "placements": [0, 2],
        "placementSize": 2,
        "placementSlots": 4,
        "placementsVerified": True,
    } == profiles[2]


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        pytest.param("L4", "L4 has no MIG: it cannot be partitioned, but it can be time-sliced", id="l4"),
        pytest.param("0x2335", "H200: 8 placement slots, 7 compute slices, 143771 MiB", id="pci-id"),
        pytest.param(
            "NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000: 12 placement slots", id="nvml-name"
        ),
    ],
)
def test_profiles_of_any_gpu_by_any_name(gpu: str, expected: str) -> None:
    done = sharing("profiles", "--gpu", gpu)
    assert (0, "") == (done.returncode, done.stderr)
    assert expected in done.stdout


def test_profiles_table_marks_inferred_placements() -> None:
    done = sharing("profiles", "--gpu", "H200")
    assert 0 == done.returncode
    assert "7g.141gb" in done.stdout
    assert "placements are inferred" in done.stdout


def test_every_command_has_help() -> None:
    for args in (["--help"], ["plan", "--help"], ["profiles", "--help"]):
        done = sharing(*args)
        assert 0 == done.returncode
        assert "usage: sharing" in done.stdout
