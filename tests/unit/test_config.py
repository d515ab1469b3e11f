"""Parsing and validation of the native config format: valid configs, a table of invalid ones, fuzzing."""

from __future__ import annotations

import contextlib
import string
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharing.config import CONFIGMAP, ConfigSet, InvalidConfigError, Problem, parse_config, parse_configmap
from sharing.config.spec import MigMode, MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.errors import ConfigError
from sharing.mig.catalog import load_catalog


def test_the_design_example_parses_to_frozen_values() -> None:
    text = """
version: v1
migStrategy: mixed
sharing:
  renameByDefault: true
  failRequestsGreaterThanOne: true
gpus:
  - devices: [0, 1]
    mig: {3g.20gb: 1, 2g.10gb: 1, 1g.5gb: 2}
    replicas: 2
  - devices: {product: NVIDIA A100-SXM4-40GB, indices: [2]}
    mig: enabled
  - devices: {product: Tesla-T4}
    replicas: {gpu: 3}
    rename: {gpu: gpu-t4}
  - devices: all
    mig: unchanged
    replicas: {gpu: 4, 1g.5gb: 2}
"""
    assert parse_config("a100", text) == (
        SharingConfig(
            name="a100",
            mig_strategy=MigStrategy.MIXED,
            rename_by_default=True,
            fail_requests_greater_than_one=True,
            rules=(
                Rule(
                    Selector(indices=(0, 1)),
                    MigMode.ENABLED,
                    (("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1)),
                    Replicas(2),
                ),
                Rule(Selector(product="A100-SXM4-40GB", indices=(2,)), MigMode.ENABLED),
                Rule(
                    Selector(product="T4"),
                    MigMode.DISABLED,
                    replicas=Replicas(1, (("gpu", 3),)),
                    rename=(("nvidia.com/gpu", "nvidia.com/gpu-t4"),),
                ),
                Rule(
                    Selector(all=True), MigMode.UNCHANGED, replicas=Replicas(1, (("1g.5gb", 2), ("gpu", 4)))
                ),
            ),
        ),
    )


def test_defaults_and_mig_words() -> None:
    config = parse_config(
        "d", "version: v1\ngpus:\n- {devices: [3], mig: disabled}\n- {devices: all, mig: {}}\n"
    )
    assert config == (SharingConfig("d", rules=(Rule(Selector(indices=(3,))), Rule(Selector(all=True)))),)
    assert parse_config("e", "version: v1") == (SharingConfig("e"),)


def test_the_message_style_of_the_design() -> None:
    text = (
        "version: v1\nmigStrategy: mixed\ngpus:\n- devices: all\n"
        "- devices: {product: A100-SXM4-40GB}\n  mig: {3g.20gb: 3}\n"
    )
    with pytest.raises(InvalidConfigError) as caught:
        parse_config("a100-mixed", text)
    assert [str(p) for p in caught.value.problems] == [
        "a100-mixed: gpus[1].devices: this rule never matches: gpus[0] already matches every GPU",
        "a100-mixed: gpus[1].mig.3g.20gb: 3 instances exceed the maximum of 2 on A100-SXM4-40GB",
    ]
    assert isinstance(caught.value, ConfigError)


V1 = "version: v1\n"
A100 = "A100-SXM4-40GB"


def rule(body: str, strategy: str = "mixed") -> str:
    return f"{V1}migStrategy: {strategy}\ngpus:\n- " + body.replace("\n", "\n  ") + "\n"


def nvidia(resources: str, strategy: str = "mixed") -> str:
    return f"{V1}flags: {{migStrategy: {strategy}}}\nsharing:\n  timeSlicing:\n    resources:\n" + "".join(
        f"    {line}\n" for line in resources.strip().splitlines()
    )


def migparted(entries: str) -> str:
    return f"{V1}mig-configs:\n  x:\n" + "".join(f"  {line}\n" for line in entries.strip().splitlines())


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [" + ", ".join([f"*{p}"] * 10) + "]\n" for p, c in zip("abcdef", "bcdefg", strict=True)
)

# (id, document, config name, exact path, part of the message, products)
INVALID: list[tuple[str, str | bytes, str, str, str, list[str] | None]] = [
    ("unknown-top-key", V1 + "foo: 1", "c", "foo", "unknown key; expected one of", None),
    ("typo-suggests", V1 + "migStratgy: mixed", "c", "migStratgy", "did you mean 'migStrategy'", None),
    ("missing-version", "gpus: []", "c", "version", "required key is missing", None),
    ("bad-version", "version: v2", "c", "version", "expected one of v1", None),
    (
        "bad-strategy",
        V1 + "migStrategy: both",
        "c",
        "migStrategy",
        "expected one of none, single, mixed",
        None,
    ),
    ("sharing-not-mapping", V1 + "sharing: true", "c", "sharing", "expected a mapping, got a boolean", None),
    (
        "rename-by-default-str",
        V1 + "sharing: {renameByDefault: 'yes'}",
        "c",
        "sharing.renameByDefault",
        "expected true or false",
        None,
    ),
    ("gpus-not-list", V1 + "gpus: {devices: all}", "c", "gpus", "expected a list of rules", None),
    ("rule-not-mapping", V1 + "gpus: [all]", "c", "gpus[0]", "expected a mapping, got a string", None),
    ("devices-missing", rule("mig: disabled"), "c", "gpus[0].devices", "required key is missing", None),
    (
        "devices-bad-word",
        rule("devices: some"),
        "c",
        "gpus[0].devices",
        "expected all, a list of GPU indices",
        None,
    ),
    ("devices-empty", rule("devices: []"), "c", "gpus[0].devices", "non-empty list of GPU indices", None),
    ("devices-negative", rule("devices: [-1]"), "c", "gpus[0].devices[0]", "must be at least 0", None),
    (
        "devices-bool",
        rule("devices: [true]"),
        "c",
        "gpus[0].devices[0]",
        "expected an integer, got a boolean",
        None,
    ),
    ("devices-twice", rule("devices: [0, 0]"), "c", "gpus[0].devices[1]", "GPU 0 is listed twice", None),
    (
        "devices-product-key",
        rule("devices: {product: A30, model: x}"),
        "c",
        "gpus[0].devices.model",
        "unknown key",
        None,
    ),
    (
        "devices-product-int",
        rule("devices: {product: 3}"),
        "c",
        "gpus[0].devices.product",
        "expected a string",
        None,
    ),
    ("rule-typo", rule("devices: all\nreplica: 2"), "c", "gpus[0].replica", "did you mean 'replicas'", None),
    (
        "mig-bool",
        rule("devices: all\nmig: true"),
        "c",
        "gpus[0].mig",
        "expected {profile: count} or one of",
        None,
    ),
    (
        "mig-bad-word",
        rule("devices: all\nmig: partitioned"),
        "c",
        "gpus[0].mig",
        "disabled, enabled, unchanged",
        None,
    ),
    (
        "mig-zero",
        rule("devices: all\nmig: {1g.5gb: 0}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "must be at least 1",
        None,
    ),
    (
        "mig-negative",
        rule("devices: all\nmig: {1g.5gb: -2}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "must be at least 1",
        None,
    ),
    (
        "mig-count-bool",
        rule("devices: all\nmig: {1g.5gb: true}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "expected an integer, got a boolean",
        None,
    ),
    (
        "mig-count-float",
        rule("devices: all\nmig: {1g.5gb: 1.5}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "expected an integer, got a number",
        None,
    ),
    (
        "mig-count-str",
        rule("devices: all\nmig: {1g.5gb: '2'}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "expected an integer, got a string",
        None,
    ),
    ("mig-profile-int", rule("devices: all\nmig: {1: 2}"), "c", "gpus[0].mig", "is not a string", None),
    (
        "profile-unknown-on-a-known-gpu",
        rule("devices: all\nmig: {9g.99gb: 1}"),
        "c",
        "gpus[0].mig.9g.99gb",
        f"unknown MIG profile '9g.99gb' on {A100}",
        [A100],
    ),
    (
        "not-a-gpu-instance-profile",
        rule("devices: all\nmig: {1c.9g.99gb: 1}"),
        "c",
        "gpus[0].mig.1c.9g.99gb",
        "no product in the hardware catalog has it",
        None,
    ),
    (
        "profile-not-on-product",
        rule("devices: {product: H100-80GB-HBM3}\nmig: {1g.5gb: 1}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "unknown MIG profile '1g.5gb' on H100-80GB-HBM3",
        None,
    ),
    (
        "over-max",
        rule(f"devices: {{product: {A100}}}\nmig: {{3g.20gb: 3}}"),
        "c",
        "gpus[0].mig.3g.20gb",
        f"3 instances exceed the maximum of 2 on {A100}",
        None,
    ),
    (
        "over-capacity",
        rule(f"devices: {{product: {A100}}}\nmig: {{4g.20gb: 1, 7g.40gb: 1}}"),
        "c",
        "gpus[0].mig",
        f"need 12 placement slots and 11 compute slices; {A100} has 8 and 7",
        None,
    ),
    (
        "no-product-has-all",
        rule("devices: all\nmig: {1g.5gb: 1, 1g.10gb+me: 1}"),
        "c",
        "gpus[0].mig",
        "no product in the hardware catalog has all of",
        None,
    ),
    (
        "fits-no-product",
        rule("devices: [0]\nmig: {7g.40gb: 1, 1g.5gb: 1}"),
        "c",
        "gpus[0].mig",
        "fits no product in the hardware catalog",
        None,
    ),
    (
        "on-given-product",
        rule("devices: all\nmig: {1g.5gb: 7}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "unknown MIG profile '1g.5gb' on H100-80GB-HBM3",
        ["H100-80GB-HBM3"],
    ),
    (
        "count-on-given-product",
        rule("devices: [0, 1]\nmig: {1g.6gb: 5}"),
        "c",
        "gpus[0].mig.1g.6gb",
        "5 instances exceed the maximum of 4 on A30",
        ["NVIDIA A30"],
    ),
    (
        "mig-on-given-non-mig-gpu",
        rule("devices: all\nmig: enabled"),
        "c",
        "gpus[0].mig",
        "T4 has no MIG",
        ["Tesla T4"],
    ),
    (
        "mig-on-non-catalog-product",
        rule("devices: {product: Tesla-T4}\nmig: {1g.5gb: 1}"),
        "c",
        "gpus[0].mig",
        "T4 has no MIG",
        None,
    ),
    (
        "single-two-profiles",
        rule("devices: all\nmig: {1g.5gb: 2, 2g.10gb: 1}", "single"),
        "c",
        "gpus[0].mig",
        "migStrategy single needs one MIG profile per GPU",
        None,
    ),
    (
        "single-two-rules",
        V1 + "migStrategy: single\ngpus:\n- {devices: [0], mig: {1g.5gb: 7}}\n"
        "- {devices: [1], mig: {2g.10gb: 3}}",
        "c",
        "gpus[1].mig",
        "the same MIG profile on every GPU of a node",
        None,
    ),
    ("replicas-zero", rule("devices: all\nreplicas: 0"), "c", "gpus[0].replicas", "must be at least 1", None),
    (
        "replicas-over",
        rule("devices: all\nreplicas: 257"),
        "c",
        "gpus[0].replicas",
        "must be at most 256",
        None,
    ),
    (
        "replicas-bool",
        rule("devices: all\nreplicas: true"),
        "c",
        "gpus[0].replicas",
        "expected an integer, got a boolean",
        None,
    ),
    (
        "replicas-map-zero",
        rule("devices: all\nreplicas: {gpu: 0}"),
        "c",
        "gpus[0].replicas.gpu",
        "must be at least 1",
        None,
    ),
    (
        "replicas-not-in-mig",
        rule(f"devices: {{product: {A100}}}\nmig: {{3g.20gb: 1}}\nreplicas: {{1g.5gb: 2}}"),
        "c",
        "gpus[0].replicas.1g.5gb",
        "1g.5gb is not one of this rule's MIG instances (3g.20gb)",
        None,
    ),
    (
        "replicas-profile-mig-off",
        rule("devices: all\nreplicas: {1g.5gb: 2}"),
        "c",
        "gpus[0].replicas.1g.5gb",
        "MIG is disabled by this rule",
        None,
    ),
    (
        "replicas-gpu-mig-on",
        rule("devices: all\nmig: {1g.5gb: 1}\nreplicas: {gpu: 2}"),
        "c",
        "gpus[0].replicas.gpu",
        "no whole GPU to replicate",
        None,
    ),
    (
        "replicas-profile-none",
        rule("devices: all\nmig: {1g.5gb: 1}\nreplicas: {1g.5gb: 2}", "none"),
        "c",
        "gpus[0].replicas.1g.5gb",
        "migStrategy none does not advertise MIG devices",
        None,
    ),
    (
        "after-all",
        V1 + "gpus:\n- {devices: all}\n- {devices: [0]}",
        "c",
        "gpus[1].devices",
        "never matches: gpus[0] already matches every GPU",
        None,
    ),
    (
        "duplicate-selector",
        V1 + "gpus:\n- {devices: {product: A30}}\n- {devices: {product: nvidia a30}}",
        "c",
        "gpus[1].devices",
        "it selects the same GPUs as gpus[0]",
        None,
    ),
    (
        "indices-covered",
        V1 + "gpus:\n- {devices: [0]}\n- {devices: [1]}\n- {devices: [1, 0]}",
        "c",
        "gpus[2].devices",
        "every GPU it selects is matched by gpus[0], gpus[1]",
        None,
    ),
    (
        "rename-invalid",
        rule("devices: all\nreplicas: 2\nrename: {nvidia.com/gpu: Bad Name}"),
        "c",
        "gpus[0].rename.nvidia.com/gpu",
        "not a valid resource name",
        None,
    ),
    (
        "rename-to-own-name",
        rule("devices: all\nreplicas: 2\nrename: {gpu: mig-1g.5gb}"),
        "c",
        "gpus[0].rename.gpu",
        "a name the agent advertises itself",
        None,
    ),
    (
        "rename-not-advertised",
        rule("devices: all\nreplicas: 2\nrename: {mig-1g.5gb: small}"),
        "c",
        "gpus[0].rename.mig-1g.5gb",
        "this rule advertises no nvidia.com/mig-1g.5gb",
        None,
    ),
    ("yaml-syntax", V1 + "gpus: [\n", "c", "", "invalid YAML at line 3, column 1", None),
    ("yaml-tab", V1 + "gpus:\n\t- devices: all", "c", "", "invalid YAML at line 3, column 1", None),
    (
        "not-a-mapping",
        "- 1\n- 2",
        "c",
        "",
        "expected a mapping at the top of the document (got a list)",
        None,
    ),
    ("empty-document", "", "c", "", "the document is empty", None),
    ("duplicate-key", V1 + "version: v1", "c", "version", "duplicate key at line 2, column 1", None),
    (
        "duplicate-profile",
        rule("devices: all\nmig: {1g.5gb: 1, 1g.5gb: 2}"),
        "c",
        "gpus[0].mig.1g.5gb",
        "duplicate key",
        None,
    ),
    ("multiple-documents", V1 + "---\n" + V1, "c", "", "expected a single document", None),
    ("not-utf8", b"version: v1\nfoo: \xff\xfe", "c", "", "not UTF-8 text: byte 0xff at offset 17", None),
    ("control-char", "version: v1\x00", "c", "", "invalid YAML at line 1, column 12: character #x0000", None),
    (
        "huge-hex-int",
        rule("devices: all\nreplicas: 0x1" + "0" * 60),
        "c",
        "gpus[0].replicas",
        "must be at most 256, got a huge number",
        None,
    ),
    (
        "too-many-digits",
        rule("devices: all\nreplicas: " + "7" * 5000),
        "c",
        "",
        "a value cannot be read",
        None,
    ),
    ("bad-date", V1 + "when: 2024-02-30", "c", "", "a value cannot be read", None),
    ("python-tag", V1 + "x: !!python/object:os.system {}", "c", "", "invalid YAML at line 2", None),
    ("alias-bomb", BOMB, "c", "", "more than 20000 nodes once aliases are expanded", None),
    ("recursive-alias", "a: &a [*a]", "c", "", "a recursive structure", None),
    ("deep-nesting", "[" * 2000 + "]" * 2000, "c", "", "nested deeper than 64 levels", None),
    (
        "deep-block-nesting",
        "a:\n" + "".join(" " * i + "- \n" for i in range(1, 100)),
        "c",
        "",
        "nested deeper than 64 levels",
        None,
    ),
    ("bad-configmap-key", V1, "bad key!", "", "not a valid ConfigMap key", None),
    # NVIDIA device-plugin configs
    (
        "nvidia-typo",
        nvidia("- {name: nvidia.com/gpu, replicas: 2, renam: x}"),
        "c",
        "sharing.timeSlicing.resources[0].renam",
        "did you mean 'rename'",
        None,
    ),
    (
        "nvidia-no-replicas",
        nvidia("- {name: nvidia.com/gpu}"),
        "c",
        "sharing.timeSlicing.resources[0].replicas",
        "no replicas specified",
        None,
    ),
    (
        "nvidia-one-replica",
        nvidia("- {name: nvidia.com/gpu, replicas: 1}"),
        "c",
        "sharing.timeSlicing.resources[0].replicas",
        "number of replicas must be >= 2",
        None,
    ),
    (
        "nvidia-other-domain",
        nvidia("- {name: example.com/gpu, replicas: 2}"),
        "c",
        "sharing.timeSlicing.resources[0].name",
        "NVIDIA's plugin serves only nvidia.com/ resources",
        None,
    ),
    (
        "nvidia-bad-uuid",
        nvidia("- {name: nvidia.com/gpu, replicas: 2, devices: [GPU-8a3c]}"),
        "c",
        "sharing.timeSlicing.resources[0].devices[0]",
        "unsupported device",
        None,
    ),
    (
        "nvidia-twice",
        nvidia("- {name: nvidia.com/gpu, replicas: 2}\n- {name: gpu, replicas: 3}"),
        "c",
        "sharing.timeSlicing.resources[1].name",
        "already time-sliced on these GPUs by",
        None,
    ),
    (
        "nvidia-mps-next-to-time-slicing",
        V1 + "sharing: {mps: {resources: [{name: gpu, replicas: 2}]}, timeSlicing: {resources: []}}",
        "c",
        "sharing",
        "both timeSlicing and mps are set: NVIDIA's plugin would silently ignore timeSlicing",
        None,
    ),
    (
        "nvidia-mps-with-mixed",
        V1 + "flags: {migStrategy: mixed}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}",
        "c",
        "flags.migStrategy",
        "using migStrategy mixed is not supported with MPS",
        None,
    ),
    (
        "native-mps-next-to-replicas",
        V1 + "gpus: [{devices: all, replicas: 2, mps: {replicas: 2}}]",
        "c",
        "gpus[0].replicas",
        "a rule shares its GPUs one way",
        None,
    ),
    (
        "nvidia-empty-resources",
        V1 + "sharing: {timeSlicing: {resources: []}}",
        "c",
        "sharing.timeSlicing.resources",
        "non-empty list",
        None,
    ),
    (
        "nvidia-unknown-flag",
        V1 + "flags: {migStrategy: none, fooBar: 1}",
        "c",
        "flags.fooBar",
        "unknown key",
        None,
    ),
    # mig-parted files
    (
        "migparted-bad-profile-name",
        migparted("- {devices: all, mig-enabled: true, mig-devices: {1g.5gb+xyz: 1}}"),
        "x",
        "mig-configs.x[0].mig-devices",
        "is not of the form <G>g.<GB>gb",
        None,
    ),
    (
        "migparted-bad-filter",
        migparted("- {devices: all, mig-enabled: false, device-filter: A100}"),
        "x",
        "mig-configs.x[0].device-filter",
        "expected a PCI id like 0x20B010DE",
        None,
    ),
    (
        "migparted-enabled-no-devices",
        migparted("- {devices: all, mig-enabled: true}"),
        "x",
        "mig-configs.x[0].mig-devices",
        "required key is missing",
        None,
    ),
    (
        "migparted-disabled-with-devices",
        migparted("- {devices: all, mig-enabled: false, mig-devices: {1g.5gb: 1}}"),
        "x",
        "mig-configs.x[0].mig-devices",
        "mig-enabled is false",
        None,
    ),
    (
        "migparted-all-zero",
        migparted("- {devices: all, mig-enabled: true, mig-devices: {1g.5gb: 0}}"),
        "x",
        "mig-configs.x[0].mig-devices",
        "every count is 0",
        None,
    ),
    (
        "migparted-typo",
        migparted("- {devices: all, mig-enabled: false, mig-device: {}}"),
        "x",
        "mig-configs.x[0].mig-device",
        "did you mean 'mig-devices'",
        None,
    ),
    (
        "migparted-bad-devices",
        migparted("- {devices: some, mig-enabled: false}"),
        "x",
        "mig-configs.x[0].devices",
        "expected all or a list of GPU indices",
        None,
    ),
    (
        "migparted-over-max-on-the-node",
        migparted(
            "- {devices: all, mig-enabled: true, mig-devices: {1g.6gb: 5}, device-filter: '0x20B710DE'}"
        ),
        "x",
        "mig-configs.x[0].mig-devices.1g.6gb",
        "5 instances exceed the maximum of 4 on A30",
        ["A30"],
    ),
    (
        "migparted-no-version",
        "mig-configs: {x: [{devices: all, mig-enabled: false}]}",
        "mig",
        "version",
        "required key is missing",
        None,
    ),
]


@pytest.mark.parametrize(("document", "config", "path", "message", "products"),
                         [pytest.param(*case[1:], id=case[0]) for case in INVALID])  # fmt: skip
def test_invalid_documents_name_the_path(
    document: str | bytes, config: str, path: str, message: str, products: list[str] | None
) -> None:
    key = config if config != "x" else "file"
    result = parse_configmap({key: document}, products=products)
    assert not result.valid
    found = [(p.config, p.path) for p in result.errors if message in p.message]
    assert (config, path) in found, [str(p) for p in result.errors]
    assert config in result.invalid


def test_the_table_is_big_enough() -> None:
    assert len(INVALID) >= 40
    assert len({case[0] for case in INVALID}) == len(INVALID)


def test_all_errors_are_collected_at_once() -> None:
    text = rule("devices: all\nmig: {1g.5gb: 0, 2g.10gb: true}\nreplicas: 0\nbogus: 1")
    paths = [p.path for p in parse_configmap({"c": text}).errors]
    assert paths == ["gpus[0].bogus", "gpus[0].mig.1g.5gb", "gpus[0].mig.2g.10gb", "gpus[0].replicas"]


def test_no_placement_is_found_by_the_planner() -> None:
    catalog = load_catalog(
        """
layouts:
  odd:
    slots: 4
    computeSlices: 4
    placementsSource: "inferred: a test"
    profiles:
      - {kind: a, enum: 0, id: 1, slices: 1, size: 2, maxCount: 1, placements: [1]}
      - {kind: b, enum: 1, id: 2, slices: 1, size: 2, maxCount: 2, placements: [0, 2]}
products:
  ODD-GPU:
    layout: odd
    nvmlNames: [NVIDIA ODD]
    pciDeviceIds: ["0x1234"]
    idsSource: "inferred: a test"
    memoryMiB: 4096
    profiles:
      a: {name: 2g.2gb, memoryMiB: 2048, source: "inferred: a test"}
      b: {name: 1g.2gb, memoryMiB: 2048, source: "inferred: a test"}
"""
    )
    text = rule("devices: {product: ODD-GPU}\nmig: {2g.2gb: 1, 1g.2gb: 1}")
    result = parse_configmap({"c": text}, catalog=catalog)
    assert [(p.path, p.message) for p in result.errors] == [
        ("gpus[0].mig", "1x1g.2gb, 1x2g.2gb has no valid placement on ODD-GPU")
    ]


def test_warnings_are_data() -> None:
    text = (
        V1
        + "sharing: {renameByDefault: true}\ngpus:\n- {devices: {product: A30}}\n- {devices: {product: Z9}}\n"
    )
    result = parse_configmap({"c": text}, products=["A100-SXM4-40GB"])
    assert result.valid
    assert [(p.path, p.message.split(":")[0]) for p in result.warnings] == [
        ("gpus[1].devices", "'Z9' is not in the hardware catalog"),
        ("gpus[0].devices", "matches none of the node's GPUs (A100-SXM4-40GB)"),
        ("gpus[1].devices", "matches none of the node's GPUs (A100-SXM4-40GB)"),
        ("sharing.renameByDefault", "has no effect"),
    ]


def test_one_bad_key_does_not_spoil_the_others() -> None:
    result = parse_configmap({"good": V1, "bad": "version: v9", "worse": b"\xff"})
    assert result.names == ("good",)
    assert result.invalid == ("bad", "worse")
    assert result.get("good") == SharingConfig("good")
    assert [p.config for p in result.errors_for("bad")] == ["bad"]
    with pytest.raises(InvalidConfigError):
        result.require()


def test_an_oversized_configmap_is_refused() -> None:
    result = parse_configmap({f"k{i}": V1 + "# " + "x" * 300_000 for i in range(4)})
    assert result.configs == ()
    assert result.errors == (
        Problem(
            CONFIGMAP, "", "the data is 1200064 bytes; Kubernetes' limit for a ConfigMap is 1048576 (1 MiB)"
        ),
    )


HOSTILE = {
    # The shapes tried on the demo node: 480,000 zeros (940 KB) and 60,000 small mappings (900 KB).
    "list-940kb": (V1 + "gpus: [" + ",".join(["0"] * 480_000) + "]", "the limit for one config is 262144"),
    "mappings-900kb": (V1 + "gpus:\n" + "- {gpu: 1234}\n" * 64_000, "the limit for one config is 262144"),
    # Under the byte limit: the streaming count refuses them.
    "list-250kb": (V1 + "gpus: [" + ",".join(["0"] * 125_000) + "]", "more than 20000 nodes"),
    "alias-bomb": (BOMB, "more than 20000 nodes once aliases are expanded"),
    "alias-bomb-deep": (
        "a: &a [[[[[[[[[[x]]]]]]]]]]\n"
        + "".join(f"{c}: &{c} [[[[[[[[[[*{p}]]]]]]]]]]\n" for p, c in zip("abcdef", "bcdefg", strict=True)),
        "nested deeper than 64 levels",
    ),
    "deep": ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
}


@pytest.mark.parametrize("shape", HOSTILE)
def test_a_hostile_key_is_refused_before_anything_is_built(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused while streaming the parser's events: no YAML node (and no value) is made of it."""
    text, message = HOSTILE[shape]
    built = []
    real = yaml.nodes.Node.__init__

    def counting(self: yaml.nodes.Node, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(yaml.nodes.Node, "__init__", counting)
    result = parse_configmap({"hostile": text})
    assert [] == built
    assert ("hostile",) == result.invalid
    assert [("hostile", "")] == [(p.config, p.path) for p in result.errors]
    assert message in result.errors[0].message


@pytest.mark.parametrize("shape", HOSTILE)
def test_a_hostile_key_leaves_the_other_configs_of_the_configmap(shape: str) -> None:
    result = parse_configmap({"mine": rule("devices: all\nreplicas: 2"), "hostile": HOSTILE[shape][0]})
    assert ("mine",) == result.names
    assert ("hostile",) == result.invalid
    assert str(result.errors[0]).startswith("hostile: ")


def test_offline_a_profile_no_catalog_product_has_is_left_to_the_driver() -> None:
    result = parse_configmap({"c": rule("devices: all\nmig: {9g.99gb: 1}")})
    assert ("c",) == result.names
    assert [("gpus[0].mig.9g.99gb", True)] == [
        (p.path, "the driver of each GPU decides" in p.message) for p in result.warnings
    ]


def test_a_config_name_that_no_label_can_hold_is_a_warning() -> None:
    result = parse_configmap({"-odd-": V1})
    assert result.valid
    assert "no node label can name this config" in result.warnings[0].message


# --- fuzzing: only the ConfigError family may escape, and parse_configmap never raises ---

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.sampled_from(["all", "v1", "mixed", "single", "none", "enabled", "disabled", "unchanged", "gpu",
                     "1g.5gb", "3g.20gb", "7g.80gb", "A100-SXM4-40GB", "A30", "nvidia.com/gpu",
                     "nvidia.com/mig-1g.5gb", "0x20B010DE", "GPU-1", "0:1"]),
    st.text(string.printable, max_size=8),
)  # fmt: skip
keys = st.sampled_from(
    [
        "version",
        "migStrategy",
        "sharing",
        "gpus",
        "devices",
        "mig",
        "replicas",
        "rename",
        "product",
        "indices",
        "renameByDefault",
        "failRequestsGreaterThanOne",
        "flags",
        "timeSlicing",
        "resources",
        "name",
        "mig-configs",
        "mig-enabled",
        "mig-devices",
        "device-filter",
        "1g.5gb",
        "gpu",
        "x",
    ]
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=25,
)


def _check_parse(name: str, raw: str | bytes, products: list[str] | None = None) -> None:
    result = parse_configmap({name: raw}, products=products)
    assert isinstance(result, ConfigSet)
    assert result.valid == (not result.errors)
    assert {p.config for p in result.errors} <= set(result.invalid)
    with contextlib.suppress(ConfigError):
        result.require()


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(values, st.booleans())
def test_fuzz_random_structures(value: Any, wrap: bool) -> None:
    if wrap:
        value = {"version": "v1", "migStrategy": "mixed", "gpus": [value]}
    _check_parse("fuzz", yaml.safe_dump(value))


@FUZZ
@given(st.dictionaries(keys, values, max_size=4), st.sampled_from(["native", "nvidia", "migparted"]))
def test_fuzz_shaped_documents(body: dict[str, Any], shape: str) -> None:
    if shape == "native":
        doc: Any = {"version": "v1", "gpus": [{"devices": "all", **body}]}
    elif shape == "nvidia":
        doc = {
            "version": "v1",
            "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", **body}]}},
        }
    else:
        doc = {"version": "v1", "mig-configs": {"c": [{"devices": "all", "mig-enabled": True, **body}]}}
    _check_parse("fuzz", yaml.safe_dump(doc), products=["A100-SXM4-40GB", "Tesla T4"])


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(raw: bytes) -> None:
    _check_parse("fuzz", raw)


@FUZZ
@given(st.text(alphabet="{}[]:,-&*!|>'\"#%@` \n\tabv01", max_size=80))
def test_fuzz_yaml_punctuation(text: str) -> None:
    _check_parse("fuzz", text)
