"""Which config a node gets from its labels (DESIGN.md "Selection")."""

from __future__ import annotations

import pytest

from sharing.config import parse_configmap
from sharing.config.selection import (
    CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    Failed,
    Selected,
    Unmanaged,
    select_config,
)

V1 = "version: v1\n"
CONFIGS = parse_configmap(
    {
        "default": V1 + "gpus: [{devices: all, replicas: 2}]",
        "a100-balanced": V1
        + "migStrategy: mixed\ngpus: [{devices: {product: A100-SXM4-40GB}, mig: {1g.5gb: 7}}]",
        "all-disabled": V1 + "gpus: [{devices: all, mig: disabled}]",
        "broken": V1 + "gpus: [{devices: all, mig: {1g.5gb: 9}}]",
    }
)
NO_DEFAULT = parse_configmap({"all-disabled": V1})
BROKEN_DEFAULT = parse_configmap({"default": "version: v2"})

CASES = [
    ("primary-label", {CONFIG_LABEL: "a100-balanced"}, CONFIGS, ("selected", "a100-balanced", "label")),
    ("mig-manager-label", {MIG_CONFIG_LABEL: "all-disabled"}, CONFIGS, ("selected", "all-disabled", "label")),
    (
        "primary-wins",
        {CONFIG_LABEL: "all-disabled", MIG_CONFIG_LABEL: "a100-balanced"},
        CONFIGS,
        ("selected", "all-disabled", "label"),
    ),
    (
        "empty-label-is-absent",
        {CONFIG_LABEL: "", MIG_CONFIG_LABEL: "all-disabled"},
        CONFIGS,
        ("selected", "all-disabled", "label"),
    ),
    ("no-label-default", {"other": "x"}, CONFIGS, ("selected", "default", "default")),
    ("no-label-no-default", {}, NO_DEFAULT, ("unmanaged", "", "left as they are")),
    ("missing-config", {CONFIG_LABEL: "nope"}, CONFIGS, ("failed", "nope", "does not exist")),
    ("invalid-config", {CONFIG_LABEL: "broken"}, CONFIGS, ("failed", "broken", "exceed the maximum of 7")),
    ("invalid-default", {}, BROKEN_DEFAULT, ("failed", "default", "is invalid")),
    (
        "missing-with-mig-label",
        {MIG_CONFIG_LABEL: "all-1g.5gb"},
        CONFIGS,
        ("failed", "all-1g.5gb", "does not exist"),
    ),
]


@pytest.mark.parametrize(("labels", "configs", "expected"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_selection(labels: dict[str, str], configs: object, expected: tuple[str, str, str]) -> None:
    kind, name, text = expected
    answer = select_config(labels, configs)  # type: ignore[arg-type]
    if kind == "selected":
        assert isinstance(answer, Selected)
        assert (answer.config.name, text in answer.source) == (name, True)
    elif kind == "unmanaged":
        assert isinstance(answer, Unmanaged)
        assert text in answer.reason
    else:
        assert isinstance(answer, Failed)
        assert answer.name == name
        assert f"config {name!r}" in answer.reason
        assert text in answer.reason


def test_the_failure_carries_the_problems() -> None:
    answer = select_config({CONFIG_LABEL: "broken"}, CONFIGS)
    assert isinstance(answer, Failed)
    assert [p.path for p in answer.problems] == ["gpus[0].mig"]


def test_the_label_key_is_configurable() -> None:
    labels = {"example.com/gpu-config": "all-disabled", CONFIG_LABEL: "default"}
    answer = select_config(labels, CONFIGS, label="example.com/gpu-config")
    assert isinstance(answer, Selected)
    assert answer.config.name == "all-disabled"
    assert answer.source == "label example.com/gpu-config=all-disabled"


def test_a_missing_config_lists_the_valid_ones() -> None:
    answer = select_config({CONFIG_LABEL: "nope"}, CONFIGS)
    assert isinstance(answer, Failed)
    assert "valid configs: default, a100-balanced, all-disabled" in answer.reason
