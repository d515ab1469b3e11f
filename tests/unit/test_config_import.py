"""NVIDIA device-plugin configs and mig-parted files convert to the equivalent native configs (==)."""

from __future__ import annotations

from pathlib import Path

from sharing.config import parse_config, parse_configmap

ROOT = Path(__file__).resolve().parents[2]

# The time-slicing example of the device-plugin README (written out by hand).
NVIDIA_TIME_SLICING = """
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 10
"""
NATIVE_TIME_SLICING = """
version: v1
gpus:
  - devices: all
    mig: unchanged
    replicas: 10
"""

# The gpu-operator "time-slicing with MIG (mixed)" shape: per-resource replicas, renamed by default.
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

# Entries of mig-parted's deployments/systemd config-default.yaml (written out by hand, trimmed to
# the products the catalog knows).
MIG_PARTED = """
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false

  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}

  all-1g.5gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7

  all-balanced:
    # A100-40GB, A800-40GB
    - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1

    # H100-80GB, H800-80GB
    - device-filter: ["0x233010DE", "0x233110DE", "0x232210DE", "0x232410DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "2g.20gb": 1
        "3g.40gb": 1

    # A30-24GB
    - device-filter: "0x20B710DE"
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.6gb": 2
        "2g.12gb": 1

  custom-config:
    - devices: [0, 1]
      mig-enabled: false
    - devices: [2, 3]
      device-filter: "0x233110DE:0x16C110DE"
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
"""
NATIVE_BALANCED = """
version: v1
migStrategy: mixed
gpus:
  - {devices: {product: A100-SXM4-40GB}, mig: {1g.5gb: 2, 2g.10gb: 1, 3g.20gb: 1}}
  - {devices: {product: A100-PCIE-40GB}, mig: {1g.5gb: 2, 2g.10gb: 1, 3g.20gb: 1}}
  - {devices: {product: H100-80GB-HBM3}, mig: {1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}}
  - {devices: {product: H100-PCIE}, mig: {1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}}
  - {devices: {product: A30}, mig: {1g.6gb: 2, 2g.12gb: 1}}
"""


def one(name: str, text: str) -> object:
    (config,) = parse_config(name, text)
    return config


def test_nvidia_time_slicing_example() -> None:
    assert one("ts", NVIDIA_TIME_SLICING) == one("ts", NATIVE_TIME_SLICING)


def test_nvidia_mixed_with_renames_and_flags() -> None:
    result = parse_configmap({"m": NVIDIA_MIXED})
    assert result.configs == (one("m", NATIVE_MIXED),)
    assert [w.path for w in result.warnings] == ["flags.failOnInitError", "flags.plugin"]


def test_nvidia_devices_and_rename_are_honoured() -> None:
    assert one("p", NVIDIA_PER_GPU) == one("p", NATIVE_PER_GPU)


def test_mig_parted_entries_become_configs() -> None:
    result = parse_configmap({"config.yaml": MIG_PARTED})
    assert result.names == ("all-disabled", "all-enabled", "all-1g.5gb", "all-balanced", "custom-config")
    native = {
        "all-disabled": "version: v1\nmigStrategy: mixed\ngpus: [{devices: all, mig: disabled}]",
        "all-enabled": "version: v1\nmigStrategy: mixed\ngpus: [{devices: all, mig: enabled}]",
        "all-1g.5gb": "version: v1\nmigStrategy: mixed\ngpus: [{devices: all, mig: {1g.5gb: 7}}]",
        "all-balanced": NATIVE_BALANCED,
        "custom-config": "version: v1\nmigStrategy: mixed\ngpus:\n- {devices: [0, 1], mig: disabled}\n"
        "- {devices: {product: H100-PCIE, indices: [2, 3]}, mig: {3g.40gb: 2}}",
    }
    for name, text in native.items():
        assert result.get(name) == one(name, text), name
    assert [(w.config, w.path) for w in result.warnings] == [
        ("custom-config", "mig-configs.custom-config[1].device-filter")
    ]


def test_mig_parted_presets_equal_ours() -> None:
    result = parse_configmap({"config.yaml": MIG_PARTED})
    for name in ("all-disabled", "all-enabled"):
        text = (ROOT / "profiles" / f"{name}.yaml").read_text()
        assert result.get(name) == one(name, text)


def test_an_entry_named_like_another_key_is_an_error() -> None:
    result = parse_configmap({"all-disabled": "version: v1", "config.yaml": MIG_PARTED})
    assert [(p.config, p.path) for p in result.errors] == [("all-disabled", "mig-configs.all-disabled")]
    assert "defined twice" in result.errors[0].message
