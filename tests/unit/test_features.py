"""Which feature gates an API server has off, from what it kept of the probe slices (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sharing.kube.api import SliceSpec
from sharing.kube.features import CONSUMABLE, PARTITIONABLE, TAINTS, ClusterFeatures, missing_gates, probes


def stripped(spec: SliceSpec, *fields: str) -> SliceSpec:
    """`spec` as an API server without the gates of `fields` stores it."""
    devices = tuple(
        replace(
            d,
            taints=() if "taints" in fields else d.taints,
            allow_multiple_allocations=d.allow_multiple_allocations and "shared" not in fields,
            capacity=tuple((n, replace(c, policy=None)) for n, c in d.capacity)
            if "shared" in fields
            else d.capacity,
        )
        for d in spec.devices
    )
    counters = () if "counters" in fields else spec.shared_counters
    return replace(spec, devices=devices, shared_counters=counters)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ((), set()),
        (("counters",), {PARTITIONABLE}),
        (("taints",), {TAINTS}),
        (("shared",), {CONSUMABLE}),
        (("counters", "taints", "shared"), {PARTITIONABLE, TAINTS, CONSUMABLE}),
    ],
    ids=["1.37", "no-partitionable", "no-taints", "no-consumable", "1.34"],
)
def test_the_gates_off_are_those_whose_fields_were_dropped(
    fields: tuple[str, ...], expected: set[str]
) -> None:
    counters, device = probes("gpu.nvidia.com", "n1")
    assert missing_gates((stripped(counters, *fields), stripped(device, *fields))) == expected


def test_nothing_is_lacking_before_the_api_server_was_asked() -> None:
    assert not ClusterFeatures(frozenset({PARTITIONABLE})).lacks(PARTITIONABLE)
    assert ClusterFeatures(frozenset({PARTITIONABLE}), known=True).lacks(PARTITIONABLE)
