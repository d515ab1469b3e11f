"""Every value of the chart's values.yaml has a type in values.schema.json, and the schema closes
every part whose keys the chart owns, so that helm refuses a key it does not know
(tests/integration/test_chart_values.py shows helm doing it). The maps users fill freely (configs,
labels, annotations, Kubernetes objects) stay open."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpu-sharing"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
OPEN = {
    # The values whose keys are the user's: a map of names, or a Kubernetes object the API server checks.
    "config.map", "nodeSelector", "affinity", "podAnnotations", "resources.requests", "resources.limits",
    "mps.keeper.resources.requests", "mps.keeper.resources.limits", "metrics.serviceMonitor.labels",
    "metrics.prometheusRule.labels", "metrics.prometheusRule.alertLabels", "metrics.dashboard.labels",
    "metrics.dashboard.annotations",
}  # fmt: skip


def leaves(values: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
        here = f"{path}{key}"
        yield here, value
        if isinstance(value, dict) and here not in OPEN:
            yield from leaves(value, f"{here}.")


def schema_of(path: str) -> dict[str, Any]:
    node: dict[str, Any] = SCHEMA
    for key in path.split("."):
        node = node["properties"][key]
    return node


def kinds(node: Mapping[str, Any]) -> set[str]:
    """The JSON types a schema node allows ("enum" and "oneOf" by their members)."""
    if "enum" in node:
        return {type(v).__name__ for v in node["enum"]}
    if "oneOf" in node:
        return {k for n in node["oneOf"] for k in kinds(n)}
    allowed = node["type"]
    return set(allowed if isinstance(allowed, list) else [allowed])


JSON_TYPES = {"str": "string", "bool": "boolean", "int": "integer", "dict": "object", "list": "array"}


@pytest.mark.parametrize(("path", "value"), list(leaves(VALUES)), ids=[p for p, _ in leaves(VALUES)])
def test_every_value_has_a_type_its_default_has(path: str, value: Any) -> None:
    allowed = {JSON_TYPES.get(k, k) for k in kinds(schema_of(path))}
    assert JSON_TYPES[type(value).__name__] in allowed | ({"integer"} if "number" in allowed else set())


def closed(node: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, additionalProperties) of every object of the schema that lists its properties."""
    if "properties" in node:
        yield path, node.get("additionalProperties", True)
        for key, child in node["properties"].items():
            yield from closed(child, f"{path}.{key}".lstrip("."))


def test_every_part_the_chart_owns_refuses_keys_it_does_not_know() -> None:
    assert {p: False for p, _ in closed(SCHEMA)} == dict(closed(SCHEMA))
    for path in OPEN:
        assert schema_of(path).get("additionalProperties", True) is not False, path
