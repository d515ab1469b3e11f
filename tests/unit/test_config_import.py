"""NVIDIA's file formats: accepted and refused where NVIDIA's tools accept and refuse them, meaning what
they mean to NVIDIA's tools.

The fixtures under fixtures/nvidia/ are this project's own files, one per form, each headed by the
verdict of NVIDIA's parser (k8s-device-plugin api/config/v1, mig-parted api/spec/v1) as read from its
code; `# differs:` marks the few deliberate differences, with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sharing.config import parse_config, parse_configmap, parse_file
from sharing.config.spec import MigMode, MigStrategy, PciFilter, Replicas, Rule, Selector, SharingConfig
from sharing.mig.catalog import default_catalog
from sharing.model import Gpu, GpuUuid

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nvidia"
CATALOG = default_catalog()


def fixtures(kind: str) -> list[Path]:
    return sorted((FIXTURES / kind).glob("*.yaml"))


def nvidia_verdict(path: Path) -> tuple[bool, str | None]:
    """(NVIDIA accepts, why we deliberately differ or None) from the fixture's header."""
    text = path.read_text()
    verdict = re.match(r"# (?:nvidia|mig-parted): (accept|reject) -- ", text)
    assert verdict is not None, path
    differs = re.search(r"^# differs: (.+)$", text, re.MULTILINE)
    return verdict[1] == "accept", differs[1] if differs else None


@pytest.mark.parametrize("path", fixtures("device-plugin") + fixtures("mig-parted"), ids=lambda p: p.stem)
def test_accepted_and_refused_where_nvidia_does(path: Path) -> None:
    accepted, differs = nvidia_verdict(path)
    result = parse_file(path.stem, path.read_bytes())
    ours = result.valid and bool(result.configs)
    expected = accepted if differs is None else not accepted
    assert expected == ours, [str(p) for p in result.errors]


def test_the_fixtures_cover_both_verdicts_and_few_differ() -> None:
    verdicts = [nvidia_verdict(p) for p in fixtures("device-plugin") + fixtures("mig-parted")]
    assert len(verdicts) >= 70
    assert sum(a for a, _ in verdicts) >= 30
    assert sum(not a for a, _ in verdicts) >= 30
    assert sum(d is not None for _, d in verdicts) == 4


# --- device-plugin configs: what they mean --------------------------------------------------------

NVIDIA_MIXED = """
version: v1
flags:
  migStrategy: mixed
  failOnInitError: true
  plugin: {passDeviceSpecs: false, deviceListStrategy: envvar, deviceIDStrategy: uuid}
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 2
    - name: nvidia.com/mig-1g.5gb
      replicas: 4
    - name: nvidia.com/mig-1g.10gb.me
      replicas: 3
"""
NATIVE_MIXED = """
version: v1
migStrategy: mixed
sharing: {renameByDefault: true, failRequestsGreaterThanOne: true}
gpus:
  - devices: all
    mig: unchanged
    replicas: {gpu: 2, 1g.5gb: 4, 1g.10gb+me: 3}
"""

# `devices` and `rename`, which NVIDIA's plugin parses and ignores, are honoured.
NVIDIA_PER_GPU = """
version: v1
flags: {migStrategy: none}
sharing:
  timeSlicing:
    resources:
    - {name: nvidia.com/gpu, replicas: 4, devices: ["0", 1], rename: gpu-small}
    - {name: nvidia.com/gpu, replicas: 8, devices: [2]}
    - {name: gpu, replicas: 2}
"""
NATIVE_PER_GPU = """
version: v1
migStrategy: none
gpus:
  - devices: [0, 1]
    mig: unchanged
    replicas: 4
    rename: {nvidia.com/gpu: nvidia.com/gpu-small}
  - devices: [2]
    mig: unchanged
    replicas: 8
  - devices: all
    mig: unchanged
    replicas: 2
"""


def one(name: str, text: str, **kwargs: object) -> SharingConfig:
    (config,) = parse_config(name, text, **kwargs)  # type: ignore[arg-type]
    return config


def test_nvidia_mixed_with_renames_and_flags() -> None:
    result = parse_configmap({"m": NVIDIA_MIXED})
    assert result.configs == (one("m", NATIVE_MIXED),)
    assert [w.path for w in result.warnings] == ["flags.failOnInitError", "flags.plugin"]


def test_nvidia_devices_and_rename_are_honoured() -> None:
    assert one("p", NVIDIA_PER_GPU) == one("p", NATIVE_PER_GPU)


def test_a_gpu_uuid_selects_that_gpu_and_mig_devices_mean_every_device() -> None:
    uuid = "GPU-4c1f2d3e-5a6b-4c7d-8e9f-0a1b2c3d4e5f"
    config = one("u", (FIXTURES / "device-plugin" / "11-devices-as-a-gpu-uuid.yaml").read_text())
    assert config.rules == (Rule(Selector(uuids=(uuid,)), MigMode.UNCHANGED, replicas=Replicas(2)),)
    assert config.rule_for(0, None, uuid=uuid) is not None
    assert config.rule_for(0, None, uuid="GPU-other") is None
    result = parse_file("m", (FIXTURES / "device-plugin" / "14-devices-as-a-mig-index.yaml").read_text())
    assert result.configs[0].rules[0].devices == Selector(all=True)
    assert "like NVIDIA's plugin, the entry applies to every device" in result.warnings[0].message


@pytest.mark.parametrize(
    ("default", "expected"),
    [(MigStrategy.NONE, MigStrategy.NONE), (MigStrategy.MIXED, MigStrategy.MIXED)],
    ids=["none", "mixed"],
)
def test_the_default_mig_strategy_applies_to_configs_that_name_none(
    default: MigStrategy, expected: MigStrategy
) -> None:
    plain = (FIXTURES / "device-plugin" / "01-plain-time-slicing.yaml").read_text()
    assert expected == one("d", plain, default_mig_strategy=default).mig_strategy
    named = NVIDIA_PER_GPU  # says none itself
    assert MigStrategy.NONE == one("n", named, default_mig_strategy=default).mig_strategy
    native = "version: v1\ngpus: [{devices: all, mig: unchanged}]\n"
    assert MigStrategy.NONE == one("x", native, default_mig_strategy=default).mig_strategy


def test_a_top_level_imex_key_makes_a_device_plugin_config() -> None:
    result = parse_file("i", (FIXTURES / "device-plugin" / "18-only-an-imex-section.yaml").read_text())
    assert result.valid
    assert ["imex"] == [w.path for w in result.warnings]


# --- mig-parted files: what they mean -------------------------------------------------------------

MIG_PARTED = """
version: v1
mig-configs:
  all-balanced:
    - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
      devices: all
      mig-enabled: true
      mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    - device-filter: ["0x233010DE", "0x233110DE", "0x232210DE", "0x232410DE"]
      devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    - device-filter: ["0x20F310DE"]
      devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    - device-filter: ["0x299910DE", "0x31C210DE"]
      devices: all
      mig-enabled: true
      mig-devices: {"1g.99gb": 7}
  custom-config:
    - devices: all
      mig-enabled: false
    - devices: [2, 3]
      device-filter: "0x233110DE:0x16C110DE"
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
  broken:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.5gb": 9}
"""


def gpu(index: int, name: str, pci: int, subsystem: int = 0) -> Gpu:
    return Gpu(index, GpuUuid(f"GPU-{index}"), name, 40960, True, False, False, pci_device_id=pci,
               pci_subsystem_id=subsystem)  # fmt: skip


A100_NODE = [gpu(0, "NVIDIA A100-SXM4-40GB", 0x20B010DE), gpu(1, "NVIDIA A100-SXM4-40GB", 0x20B010DE)]


def test_entries_for_gpus_the_node_lacks_are_skipped_not_refused() -> None:
    """NVIDIA's all-balanced names GPUs the catalog lacks (and a profile no GPU has): on this node, fine."""
    result = parse_configmap({"config.yaml": MIG_PARTED}, gpus=A100_NODE)
    assert result.names == ("all-balanced", "custom-config")
    assert result.invalid == ("broken",)
    config = result.get("all-balanced")
    assert config is not None
    a100 = config.rule_for(0, "A100-SXM4-40GB", pci_device_id=0x20B010DE)
    assert a100 is not None
    assert a100.instances == (("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1))
    skipped = [
        w
        for w in result.warnings
        if w.config == "all-balanced" and "skipped, as mig-parted skips it" in w.message
    ]
    assert [w.path for w in skipped] == [
        "mig-configs.all-balanced[3]",
        "mig-configs.all-balanced[2]",
        "mig-configs.all-balanced[1]",
    ]


def test_a_device_filter_is_the_exact_pci_id_not_the_product() -> None:
    """An A800-only id (0x20F3) must not select A100s (0x20B2), although both are the A100-SXM4-80GB entry."""
    config = parse_configmap({"f": MIG_PARTED}).get("all-balanced")
    assert config is not None
    a800 = config.rule_for(0, "A100-SXM4-80GB", pci_device_id=0x20F310DE)
    a100 = config.rule_for(0, "A100-SXM4-80GB", pci_device_id=0x20B210DE)
    assert a800 is not None
    assert a800.devices == Selector(pci=(PciFilter(0x20F310DE),))
    assert a100 is None


def test_later_entries_override_earlier_ones_as_in_mig_parted() -> None:
    config = parse_configmap({"f": MIG_PARTED}).get("custom-config")
    assert config is not None
    h100 = {"pci_device_id": 0x233110DE, "pci_subsystem_id": 0x16C110DE}
    assert MigMode.ENABLED == getattr(config.rule_for(2, "H100-PCIE", **h100), "mig", None)
    assert MigMode.DISABLED == getattr(config.rule_for(1, "H100-PCIE", **h100), "mig", None)
    other_board = {"pci_device_id": 0x233110DE, "pci_subsystem_id": 0x12345678}
    assert MigMode.DISABLED == getattr(config.rule_for(2, "H100-PCIE", **other_board), "mig", None)
    assert config.rules[-1].devices == Selector(all=True)  # reversed: the first entry matches last


def test_gpus_without_mig_are_left_alone_by_all_entries() -> None:
    """The DGX Station's display GPU (0x1FB0) next to its A100s: mig-parted skips it; so does the agent."""
    text = (FIXTURES / "mig-parted" / "07-a-display-gpu-with-mig-off.yaml").read_text()
    display = Gpu(
        0, GpuUuid("GPU-d"), "NVIDIA DGX Display", 4096, False, False, False, pci_device_id=0x1FB010DE
    )
    result = parse_file("station", text, gpus=[display, gpu(1, "NVIDIA A100-SXM4-80GB", 0x20B210DE)])
    assert result.valid
    enabled = "version: v1\nmig-configs:\n  mig-on:\n"
    enabled += "    - {devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}\n"
    config = parse_file("f", enabled, products=["A100-SXM4-80GB", "T4"]).get("mig-on")
    assert config is not None
    assert config.rules[0].skip_without_mig


def test_one_invalid_config_does_not_spoil_a_plain_file() -> None:
    result = parse_file("file", MIG_PARTED)
    assert "custom-config" in result.names
    assert "broken" in result.invalid
    assert [p.config for p in result.errors_for("custom-config")] == []


def test_mig_parted_presets_equal_ours() -> None:
    text = "version: v1\nmig-configs:\n  all-disabled:\n    - {devices: all, mig-enabled: false}\n"
    ours = one("all-disabled", (ROOT / "profiles" / "all-disabled.yaml").read_text())
    theirs = parse_file("f", text).get("all-disabled")
    assert theirs is not None
    assert ours.rules[0].mig == theirs.rules[0].mig
    assert ours.rules[0].devices == theirs.rules[0].devices


DEFAULT_FILE = FIXTURES / "mig-parted" / "30-nvidias-default-file.yaml"
OPERATOR_DEFAULT = FIXTURES / "gpu-operator" / "default-mig-parted-config.yaml"


def test_nvidias_default_mig_file_is_valid_offline_with_warnings_for_profiles_the_catalog_lacks() -> None:
    """mig-parted accepts it and lets the node's driver decide; so does `validate` without --gpu."""
    result = parse_file("default", DEFAULT_FILE.read_bytes())
    assert [] == [str(p) for p in result.errors]
    assert 81 == len(result.configs)
    lacked = [p.path for p in result.warnings if "no product in the hardware catalog" in p.message]
    unknown = {path.partition(".mig-devices.")[2] for path in lacked}
    assert {"3g.95gb", "4g.95gb", "7g.189gb"} == unknown  # GB200's names under its first drivers


def test_the_gpu_operators_default_configmap_validates_offline() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "sharing", "validate", str(OPERATOR_DEFAULT)],
        check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert 0 == result.returncode, result.stdout + result.stderr
    assert "81 valid, 0 invalid" in result.stderr
    assert "warning: all-7g.189gb: mig-configs.all-7g.189gb[0].mig-devices.7g.189gb: unknown MIG profile" in (
        result.stderr
    )


@pytest.mark.parametrize(
    ("gpu", "config", "valid"),
    [
        pytest.param("A100-SXM4-40GB", "all-7g.189gb", False, id="a100-lacks-7g.189gb"),
        pytest.param("GB300", "all-3g.139gb", True, id="gb300-has-3g.139gb"),
        pytest.param("GB300", "all-1g.35gb.me", True, id="gb300-has-1g.35gb+me"),
        pytest.param("GB300", "all-7g.189gb", False, id="gb300-lacks-7g.189gb"),
        pytest.param("H100-SXM5-94GB", "all-1g.12gb", True, id="the-catalog-knows-no-profiles-of-it"),
    ],
)
def test_on_a_gpu_the_catalog_knows_a_profile_it_lacks_stays_an_error(
    gpu: str, config: str, valid: bool
) -> None:
    result = parse_file("default", DEFAULT_FILE.read_bytes(), products=[gpu])
    assert valid == (config in result.names), [str(p) for p in result.errors_for(config)]


def test_an_entry_named_like_another_key_is_an_error() -> None:
    result = parse_configmap({"custom-config": "version: v1", "config.yaml": MIG_PARTED})
    assert ("custom-config", "mig-configs.custom-config") in [(p.config, p.path) for p in result.errors]
