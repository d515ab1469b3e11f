"""MPS in configs: NVIDIA's `sharing.mps` and the native `mps` rule key, read into Rule.sharing/Rule.mps,
and the per-GPU client cap checked when the config is parsed for the node's GPUs.

The cap is NVIDIA's (k8s-device-plugin cmd/mps-control-daemon/mps/device.go `maxClients`, and its
device_test.go cases: CC 7.0 -> 16, 7.5 and 9.0 -> 48, 49 fails).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sharing.config import parse_config, parse_file
from sharing.config.selection import Failed, select_config
from sharing.config.spec import MigMode, MpsLimits, Replicas, Rule, Selector, Sharing, SharingConfig
from sharing.model import Gpu, GpuUuid

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvidia" / "device-plugin"


def one(text: str, **kwargs: object) -> SharingConfig:
    (config,) = parse_config("c", text, **kwargs)  # type: ignore[arg-type]
    return config


def gpu(index: int, product: str, capability: tuple[int, int], *, mig: bool = False) -> Gpu:
    return Gpu(index, GpuUuid(f"GPU-{index}"), product, 16384, mig, mig, mig, compute_capability=capability)


def mps_rule(devices: Selector, replicas: int, mig: MigMode = MigMode.UNCHANGED, **kw: object) -> Rule:
    return Rule(devices, mig, replicas=Replicas(1, (("gpu", replicas),)), sharing=Sharing.MPS, **kw)  # type: ignore[arg-type]


def nvidia(entry: str, section: str = "mps", flags: str = "") -> str:
    """A device-plugin config with one resource: `{name: gpu, <entry>}`."""
    return f"version: v1\n{flags}sharing: {{{section}: {{resources: [{{name: gpu, {entry}}}]}}}}\n"


def errors(text: str, **kwargs: object) -> list[str]:
    return [f"{p.path}: {p.message}" for p in parse_file("c", text, **kwargs).errors]  # type: ignore[arg-type]


# --- NVIDIA's sharing.mps -------------------------------------------------------------------------


def test_nvidias_readme_example_shares_every_gpu_with_mps_and_fails_requests_above_one() -> None:
    config = one((FIXTURES / "32-mps-readme-example.yaml").read_text())
    assert config == SharingConfig(
        "c", fail_requests_greater_than_one=True, rules=(mps_rule(Selector(all=True), 10),)
    )


@pytest.mark.parametrize(
    ("fixture", "rename_by_default", "fail"),
    [
        ("33-mps-readme-renamebydefault", True, True),
        ("34-mps-failrequestsgreaterthanone-false", False, False),
    ],
    ids=["renamebydefault", "failrequests-relaxed"],
)
def test_the_mps_section_flags(fixture: str, rename_by_default: bool, fail: bool) -> None:
    config = one((FIXTURES / f"{fixture}.yaml").read_text())
    assert (rename_by_default, fail) == (config.rename_by_default, config.fail_requests_greater_than_one)
    assert [Sharing.MPS] == [r.sharing for r in config.rules]


NVIDIA_PER_GPU = """
version: v1
sharing:
  mps:
    resources:
    - {name: nvidia.com/gpu, replicas: 4, devices: [0, "1"], rename: gpu-quarter}
    - {name: nvidia.com/gpu, replicas: 2, devices: [2]}
"""
NATIVE_PER_GPU = """
version: v1
gpus:
  - devices: [0, 1]
    mig: unchanged
    mps: {replicas: 4}
    rename: {nvidia.com/gpu: gpu-quarter}
  - devices: [2]
    mig: unchanged
    mps: {replicas: 2}
"""


def test_devices_and_rename_give_per_gpu_replica_counts_like_the_native_form() -> None:
    """NVIDIA's plugin drops both, so every GPU gets one count (NVIDIA/k8s-device-plugin#1786)."""
    nvidia, native = one(NVIDIA_PER_GPU), one(NATIVE_PER_GPU)
    assert nvidia == native
    assert [4, 4, 2] == [
        getattr(nvidia.rule_for(i, None), "replicas", Replicas()).for_kind("gpu") for i in range(3)
    ]
    assert nvidia.rules[0].rename == (("nvidia.com/gpu", "nvidia.com/gpu-quarter"),)
    assert nvidia.rule_for(3, None) is None


def test_per_resource_limits_in_nvidias_form() -> None:
    text = """
version: v1
sharing:
  mps:
    resources:
    - {name: gpu, replicas: 4, devices: [0], activeThreadPercentage: 30, pinnedMemoryLimit: 4Gi}
    - {name: gpu, replicas: 2, devices: [1]}
"""
    config = one(text)
    assert [MpsLimits(30, 4096), MpsLimits()] == [r.mps for r in config.rules]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            nvidia("replicas: 2", flags="flags: {migStrategy: mixed}\n"),
            ["flags.migStrategy: using migStrategy mixed is not supported with MPS, as in NVIDIA's plugin: "
             "MPS shares whole GPUs only; use none"],
            id="mixed",
        ),
        pytest.param(
            nvidia("replicas: 1"),
            ["sharing.mps.resources[0].replicas: number of replicas must be >= 2, got 1 (leave the resource "
             "out to not share)"],
            id="one-replica",
        ),
        pytest.param(
            "version: v1\nsharing: {mps: {renameByDefault: true}}",
            ["sharing.mps.resources: no resources specified: expected a non-empty list, got nothing"],
            id="no-resources",
        ),
        pytest.param(
            nvidia("replicas: 2, activeThreadPercentage: 101"),
            ["sharing.mps.resources[0].activeThreadPercentage: must be at most 100, got 101"],
            id="threads-above-100",
        ),
        pytest.param(
            nvidia("replicas: 2, pinnedMemoryLimit: 2GB"),
            ["sharing.mps.resources[0].pinnedMemoryLimit: expected a size like 512Mi, 10Gi or 1Ti, got a "
             "string ('2GB')"],
            id="memory-without-binary-unit",
        ),
        pytest.param(
            nvidia("replicas: 2, pinnedMemoryLimit: 1Gi", "timeSlicing"),
            ["sharing.timeSlicing.resources[0].pinnedMemoryLimit: unknown key; expected one of name, "
             "replicas, rename, devices"],
            id="limits-only-with-mps",
        ),
        pytest.param(
            nvidia("replicas: 49"),
            ["sharing.mps.resources[0].replicas: maximum allowed replicas exceeded: 49 > 48: no GPU serves "
             "more than 48 MPS clients"],
            id="offline-above-48",
        ),
    ],
)  # fmt: skip
def test_nvidia_mps_files_refused(text: str, expected: list[str]) -> None:
    assert expected == errors(text)


# --- the cap by compute capability, for the node's GPUs -------------------------------------------

V100, T4, H100 = "Tesla V100-SXM2-16GB", "Tesla T4", "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("product", "capability", "replicas", "expected"),
    [
        pytest.param(V100, (7, 0), 16, [], id="cc7.0-16"),
        pytest.param(
            V100, (7, 0), 17,
            ["sharing.mps.resources[0].replicas: maximum allowed replicas exceeded: 17 > 16: GPU 0 ("
             "V100-SXM2-16GB), compute capability 7.0, serves at most 16 MPS clients (48 from 7.5, 16 "
             "before)"],
            id="cc7.0-17",
        ),
        pytest.param(T4, (7, 5), 48, [], id="cc7.5-48"),
        pytest.param(H100, (9, 0), 48, [], id="cc9.0-48"),
    ],
)  # fmt: skip
def test_the_client_cap_is_checked_for_the_nodes_gpus(
    product: str, capability: tuple[int, int], replicas: int, expected: list[str]
) -> None:
    text = nvidia(f"replicas: {replicas}")
    assert expected == errors(text, gpus=[gpu(0, product, capability)])


def test_the_cap_names_only_the_gpus_a_rule_applies_to() -> None:
    """GPU 0 takes 4 replicas from the first entry; only GPU 1 gets the 17 of the `all` entry."""
    text = """
version: v1
sharing:
  mps:
    resources:
    - {name: gpu, replicas: 4, devices: [0]}
    - {name: gpu, replicas: 17}
"""
    found = errors(text, gpus=[gpu(0, V100, (7, 0)), gpu(1, V100, (7, 0))])
    assert ["sharing.mps.resources[1].replicas: maximum allowed replicas exceeded: 17 > 16: GPU 1 ("
            "V100-SXM2-16GB), compute capability 7.0, serves at most 16 MPS clients (48 from 7.5, 16 before)"
            ] == found  # fmt: skip


def test_a_cap_violation_makes_the_node_keep_its_last_good_state() -> None:
    """Invalid for this node's GPUs: selection fails (the agent keeps what it has and says why)."""
    text = "version: v1\ngpus: [{devices: all, mps: {replicas: 20}}]\n"
    result = parse_file("mps", text, gpus=[gpu(0, V100, (7, 0))])
    selection = select_config({"nvidia.com/device-plugin.config": "mps"}, result)
    assert isinstance(selection, Failed)
    assert "20 > 16: GPU 0 (V100-SXM2-16GB)" in selection.reason


def test_a_gpu_with_mig_on_cannot_be_shared_with_mps() -> None:
    text = (FIXTURES / "26-mps-sharing.yaml").read_text()
    found = errors(text, gpus=[gpu(0, "NVIDIA A100-SXM4-40GB", (8, 0), mig=True)])
    assert ["sharing.mps.resources[0]: sharing using MPS is not supported for MIG devices: GPU 0 "
            "(A100-SXM4-40GB) has MIG enabled"] == found  # fmt: skip


# --- the native form ------------------------------------------------------------------------------


def test_the_native_mps_rule() -> None:
    text = """
version: v1
gpus:
  - devices: [0]
    mps: {replicas: 4, activeThreadPercentage: 25, pinnedMemoryLimit: 10Gi}
  - devices: all
    replicas: 2
"""
    config = one(text)
    assert config == SharingConfig(
        "c",
        fail_requests_greater_than_one=True,
        rules=(
            mps_rule(Selector(indices=(0,)), 4, MigMode.DISABLED, mps=MpsLimits(25, 10240)),
            Rule(Selector(all=True), replicas=Replicas(2)),
        ),
    )


def test_the_native_form_may_relax_fail_requests_greater_than_one() -> None:
    text = "version: v1\nsharing: {failRequestsGreaterThanOne: false}\n"
    text += "gpus: [{devices: all, mps: {replicas: 2}}]\n"
    assert one(text).fail_requests_greater_than_one is False


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        pytest.param(
            "{devices: all, mps: {replicas: 1}}", ["gpus[0].mps.replicas: must be at least 2, got 1"],
            id="one-replica",
        ),
        pytest.param(
            "{devices: all, mps: {activeThreadPercentage: 50}}",
            ["gpus[0].mps.replicas: required key is missing"],
            id="no-replicas",
        ),
        pytest.param(
            "{devices: all, mps: {replicas: 2, pinnedMemoryLimit: 17Gi}}",
            ["gpus[0].mps.pinnedMemoryLimit: 17408 MiB is more than the 16384 MiB of GPU 0 ("
             "V100-SXM2-16GB)"],
            id="memory-above-the-gpus",
        ),
    ],
)  # fmt: skip
def test_native_mps_rules_refused(rule: str, expected: list[str]) -> None:
    assert expected == errors(f"version: v1\ngpus: [{rule}]\n", gpus=[gpu(0, V100, (7, 0))])


def test_a_native_mps_rule_cannot_enable_mig() -> None:
    assert [
        "gpus[0].mps.replicas: MIG is enabled on these GPUs: there is no whole GPU to replicate",
        "gpus[0].mig: sharing using MPS is not supported for MIG devices: this rule enables MIG (MPS "
        "shares whole GPUs; use mig: disabled)",
    ] == errors("version: v1\ngpus: [{devices: all, mig: {1g.5gb: 7}, mps: {replicas: 2}}]\n")


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/configuration.md"])
def test_the_documented_mps_examples_are_valid(doc: str) -> None:
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", (ROOT / doc).read_text(), re.S) if "mps" in b]
    assert blocks
    for block in blocks:
        assert [] == [str(p) for p in parse_file("doc", block).errors]
