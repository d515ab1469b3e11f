"""`sharing validate` as users run it: exit codes, output lines and the JSON shape, via a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "deploy" / "presets-configmap.yaml"


def validate(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "sharing", "validate", *args],
        check=False, input=stdin.decode("latin-1"), capture_output=True, text=True, encoding="latin-1",
        env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_the_presets_configmap_is_valid() -> None:
    result = validate(str(PRESETS))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "all-replicas-4: [none] all GPUs: MIG off, 4 replicas each" in lines
    assert any(
        line.startswith("a100-mig-h100-time-sliced: [mixed] A100-SXM4-40GB: MIG 2x 1g.5gb") for line in lines
    )


def test_json_shape_with_gpus() -> None:
    result = validate(str(PRESETS), "--gpu", "A100-SXM4-40GB", "--gpu", "NVIDIA A30", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == {"valid", "configs", "errors", "warnings"}
    assert out["valid"] is True
    assert out["errors"] == []
    demo = next(c for c in out["configs"] if c["name"] == "a100-mig-h100-time-sliced")
    assert (
        demo["summary"]
        == "[mixed] A100-SXM4-40GB: MIG 2x 1g.5gb + 1x 2g.10gb + 1x 3g.20gb; A30: left as it is"
    )
    assert {"config", "path", "message"} == set(out["warnings"][0])


def test_an_invalid_config_exits_1_with_one_line_per_error(tmp_path: Path) -> None:
    path = tmp_path / "a100-mixed.yaml"
    path.write_text(
        "version: v1\ngpus:\n- devices: {product: A100-SXM4-40GB}\n  mig: {3g.20gb: 3}\n  bogus: 1\n"
    )
    result = validate(str(path))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "a100-mixed: gpus[0].bogus: unknown key; expected one of devices, mig, replicas, rename, mps, "
        "reclaimForeign",
        "a100-mixed: gpus[0].mig.3g.20gb: 3 instances exceed the maximum of 2 on A100-SXM4-40GB",
    ]
    out = json.loads(validate(str(path), "--json").stdout)
    assert out["valid"] is False
    assert out["errors"][1] == {
        "config": "a100-mixed",
        "path": "gpus[0].mig.3g.20gb",
        "message": "3 instances exceed the maximum of 2 on A100-SXM4-40GB",
    }


def test_stdin_and_imported_formats() -> None:
    nvidia = (
        b"version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 10}\n"
    )
    result = validate("-", stdin=nvidia)
    assert (result.returncode, result.stdout) == (0, "stdin: [none] all GPUs: MIG as is, 10 replicas each\n")
    migparted = (
        b"version: v1\nmig-configs:\n  all-enabled:\n  - {devices: all, mig-enabled: true, mig-devices: {}}\n"
    )
    result = validate("-", stdin=migparted)
    assert (result.returncode, result.stdout) == (0, "all-enabled: [mixed] all GPUs: MIG on, no instances\n")


def test_a_configmap_with_a_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata:\n  good: 'version: v1'\n  bad: '[1'\n"
    )
    result = validate(str(path))
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == "good: [none] no rules: every GPU is left as it is"
    assert result.stdout.splitlines()[1].startswith("bad: invalid YAML at line 1, column 3")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["/nonexistent/x.yaml"], "cannot read /nonexistent/x.yaml", id="missing-file"),
        pytest.param([str(PRESETS), "--gpu", "Tesla Z4"], "unknown GPU 'Tesla Z4'", id="unknown-gpu"),
        pytest.param([], "the following arguments are required: FILE", id="no-file"),
    ],
)
def test_usage_errors_exit_2(args: list[str], message: str) -> None:
    result = validate(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(bytes(range(256)) * 4, id="binary"),
        pytest.param(b"\xef\xbb\xbf\xff\xfe", id="bom-then-garbage"),
        pytest.param(b"a: &a [*a, *a]\nb: *a\n", id="recursive-alias"),
        pytest.param(b"kind: ConfigMap\ndata: [1, 2]\n", id="configmap-data-list"),
        pytest.param(b"kind: ConfigMap\ndata: {1: {a: b}}\n", id="configmap-odd-values"),
        pytest.param(b"x" * (1024 * 1024 + 10), id="oversized"),
    ],
)
def test_never_a_traceback(data: bytes) -> None:
    result = validate("-", stdin=data)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "internal error" not in result.stderr


def test_a_gpu_without_mig_can_be_given_and_is_checked_as_such(tmp_path: Path) -> None:
    path = tmp_path / "t4.yaml"
    path.write_text("version: v1\ngpus:\n- {devices: all, replicas: 4}\n")
    result = validate(str(path), "--gpu", "T4")
    assert (result.returncode, result.stdout) == (0, "t4: [none] T4: MIG off, 4 replicas each\n")
    presets = validate(str(PRESETS), "--gpu", "Tesla T4")
    assert 1 == presets.returncode
    assert "all-enabled: gpus[0].mig: T4 has no MIG (not a MIG product)" in presets.stdout.splitlines()


def test_a_mig_parted_file_on_a_given_node_skips_entries_for_other_gpus() -> None:
    migparted = (
        b"version: v1\nmig-configs:\n  balanced:\n"
        b"  - {device-filter: '0x299910DE', devices: all, mig-enabled: true, mig-devices: {9g.9gb: 1}}\n"
        b"  - {device-filter: ['0x233510DE'], devices: all, mig-enabled: true,"
        b" mig-devices: {1g.18gb: 2, 2g.35gb: 1, 3g.71gb: 1}}\n"
    )
    result = validate("-", "--gpu", "0x2335", stdin=migparted)
    assert (result.returncode, result.stdout) == (
        0,
        "balanced: [mixed] H200: MIG 2x 1g.18gb + 1x 2g.35gb + 1x 3g.71gb\n",
    )
    assert "matches none of the node's GPUs (H200): skipped, as mig-parted skips it" in result.stderr


@pytest.mark.parametrize(
    ("gpus", "ok"),
    [
        pytest.param(("A100-SXM4-40GB", "H100-80GB-HBM3"), True, id="gpu-0-is-the-a100"),
        pytest.param(("H100-80GB-HBM3", "A100-SXM4-40GB"), False, id="gpu-0-is-the-h100"),
    ],
)
def test_the_gpus_given_are_the_nodes_gpus_in_index_order(
    tmp_path: Path, gpus: tuple[str, ...], ok: bool
) -> None:
    """An index rule is checked on the GPU at that index only, and a problem is said once."""
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\nmigStrategy: mixed\ngpus:\n  - devices: [0]\n    mig: {1g.5gb: 2}\n")
    result = validate(str(config), *(a for g in gpus for a in ("--gpu", g)))
    assert (0 if ok else 1) == result.returncode
    errors = [line for line in result.stdout.splitlines() if "unknown MIG profile" in line]
    assert ([] if ok else [errors[0]]) == errors


def test_a_rule_for_a_gpu_index_not_given_is_a_warning_not_an_error(tmp_path: Path) -> None:
    """`devices: [2]` checked with one --gpu: nothing is there to check it on (the agent only warns)."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "version: v1\nmigStrategy: mixed\ngpus:\n"
        "  - devices: [2]\n    mig: {4g.20gb: 1}\n    replicas: {4g.20gb: 2}\n"
        "  - {devices: all, replicas: 3}\n"
    )
    result = validate(str(config), "--gpu", "A100-SXM4-40GB")
    assert (0, "c: [mixed] A100-SXM4-40GB: MIG off, 3 replicas each\n") == (result.returncode, result.stdout)
    assert "warning: c: gpus[0].devices: matches none of the node's GPUs (A100-SXM4-40GB)" in result.stderr
    assert "unknown MIG profile" not in result.stderr


def test_the_summary_names_each_gpu_once(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "version: v1\nmigStrategy: mixed\ngpus:\n"
        "  - devices: [2]\n    mig: {4g.20gb: 1}\n    replicas: {4g.20gb: 2}\n"
        "  - {devices: all, replicas: 3}\n"
    )
    result = validate(str(config), *["--gpu", "A100-SXM4-40GB"] * 3, "--gpu", "T4")
    assert 0 == result.returncode, result.stdout + result.stderr
    assert (
        "c: [mixed] A100-SXM4-40GB (GPUs 0, 1): MIG off, 3 replicas each; "
        "A100-SXM4-40GB (GPU 2): MIG 1x 4g.20gb, replicas 4g.20gb=2; T4: MIG off, 3 replicas each\n"
    ) == result.stdout
    three = validate(str(PRESETS), *["--gpu", "A100-SXM4-40GB"] * 3)
    assert "all-replicas-4: [none] A100-SXM4-40GB: MIG off, 4 replicas each" in three.stdout.splitlines()


FIXTURES_DP = ROOT / "tests" / "unit" / "fixtures" / "nvidia" / "device-plugin"


@pytest.mark.parametrize(
    ("text", "gpus", "code", "stdout"),
    [
        pytest.param(
            (FIXTURES_DP / "32-mps-readme-example.yaml").read_text(), [], 0,
            ["mps: [none] all GPUs: MIG as is, MPS: 10 replicas each with 10% of the threads and 1/10 of "
             "the memory"],
            id="nvidia-readme",
        ),
        pytest.param(
            "version: v1\ngpus:\n- devices: [0]\n  mps: {replicas: 4, activeThreadPercentage: 30, "
            "pinnedMemoryLimit: 4Gi}\n", ["T4"], 0,
            ["mps: [none] T4: MIG off, MPS: 4 replicas each with 30% of the threads and 4096 MiB"],
            id="native-with-limits",
        ),
        pytest.param(
            "version: v1\ngpus: [{devices: all, mps: {replicas: 49}}]\n", ["T4"], 1,
            ["mps: gpus[0].mps.replicas: maximum allowed replicas exceeded: 49 > 48: GPU 0 (T4), compute "
             "capability 7.5, serves at most 48 MPS clients (48 from 7.5, 16 before)"],
            id="above-the-cap-of-the-gpu-given",
        ),
        pytest.param(
            "version: v1\ngpus: [{devices: all, mps: {replicas: 17}}]\n", ["V100-SXM2-16GB", "T4"], 1,
            ["mps: gpus[0].mps.replicas: maximum allowed replicas exceeded: 17 > 16: GPU 0 (V100-SXM2-16GB), "
             "compute capability 7.0, serves at most 16 MPS clients (48 from 7.5, 16 before)"],
            id="a-v100-takes-16",
        ),
        pytest.param(
            "version: v1\ngpus: [{devices: all, mps: {replicas: 16}}]\n", ["V100-SXM2-16GB"], 0,
            ["mps: [none] V100-SXM2-16GB: MIG off, MPS: 16 replicas each with 6% of the threads and 1/16 of "
             "the memory"],
            id="a-v100-at-16",
        ),
    ],
)  # fmt: skip
def test_mps_configs_say_mps(
    tmp_path: Path, text: str, gpus: list[str], code: int, stdout: list[str]
) -> None:
    path = tmp_path / "mps.yaml"
    path.write_text(text)
    result = validate(str(path), *[a for g in gpus for a in ("--gpu", g)])
    assert (code, stdout) == (result.returncode, result.stdout.splitlines()), result.stderr
