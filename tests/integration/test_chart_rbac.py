"""The chart's RBAC lets the agent read only what its node needs: with the DRA front-end on, a
ResourceClaim by name (`get`), never a list or a watch of them, which would be every claim of the
cluster for every node. Rendered by the Go-built helm, as users render it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import lab
import pytest
import yaml

pytestmark = pytest.mark.integration

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpu-sharing"


def test_the_agent_may_get_a_resourceclaim_and_never_list_or_watch_them(
    cluster_binaries: lab.Binaries,
) -> None:
    rendered = subprocess.run(
        [str(cluster_binaries.helm), "template", "x", str(CHART), "--set", "dra.enabled=true",
         "--show-only", "templates/rbac.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    roles = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("ClusterRole", "Role")]
    grants = [
        (verb, resource)
        for role in roles
        for rule in role.get("rules", [])
        if "resource.k8s.io" in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    ]
    assert [("get", "resourceclaims")] == [g for g in grants if g[1] == "resourceclaims"]
    assert {"list", "watch"} <= {verb for verb, resource in grants if resource == "resourceslices"}
