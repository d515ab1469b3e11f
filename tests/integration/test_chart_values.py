"""The chart's values.schema.json: helm refuses a mistyped or wrongly typed value, naming its path.

A key the chart does not have (`drain.enabeld`) would otherwise be ignored without a word, and a
value of the wrong type (`dra.enabled=yes`) rendered into something else than meant. Helm checks
the values against the schema in `helm install`, `upgrade`, `template` and `lint` alike; here the
first against a real API server (nothing gets installed), the others without one. Every set of
values the lab, the tests, the demo and the benchmarks install with still renders.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lab
import pytest
import yaml
from lab import cluster
from lab.helm import CHART, NAMESPACE, RELEASE, Helm, lab_values

pytestmark = pytest.mark.integration

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


def sections(values: Mapping[str, Any], path: str = "") -> Iterator[str]:
    """Every part of the values with an `enabled` switch (drain, dra, metrics.serviceMonitor, ...)."""
    for key, value in values.items():
        if isinstance(value, dict):
            if "enabled" in value:
                yield f"{path}{key}"
            yield from sections(value, f"{path}{key}.")


SWITCHES = sorted(sections(DEFAULTS))

WRONG = {
    # --set value: the path and what helm says of it.
    "dra.enabled=yes": ("/dra/enabled", "got string, want boolean"),
    "httpPort=metrics": ("/httpPort", "got string, want integer"),
    "httpPort=70000": ("/httpPort", "maximum"),
    "logFormat=text": ("/logFormat", "value must be one of 'auto', 'json', 'console'"),
    "deviceListStrategy=envvar\\,cdi": ("/deviceListStrategy", "'oneOf' failed"),
    "metrics.prometheusRule.configPendingFor=soon": (
        "/metrics/prometheusRule/configPendingFor",
        "does not match pattern",
    ),
    "config.map.mine=null": ("/config/map/mine", "got null, want string"),
}


def helm(bins: lab.Binaries, tmp_path: Path, kubeconfig: Path | None = None) -> Helm:
    return Helm(kubeconfig or tmp_path / "no-cluster", binary=bins.helm)


def refused(done: Any, path: str, what: str) -> None:
    """helm failed, rendered nothing, and said what is wrong where (lint says it on stdout)."""
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "kind:" not in done.stdout, said
    assert "values don't meet the specifications of the schema(s)" in said, said
    assert any(f"at '{path}'" in line and what in line for line in said.splitlines()), said


@pytest.mark.parametrize("section", SWITCHES)
def test_a_mistyped_switch_is_refused_with_its_path(
    cluster_binaries: lab.Binaries, tmp_path: Path, section: str
) -> None:
    path = "/" + section.replace(".", "/")
    for verb in ("template", "lint"):
        done = helm(cluster_binaries, tmp_path).run(
            verb, RELEASE, str(CHART), "--set", f"{section}.enabeld=true", check=False
        )
        refused(done, path, "additional properties 'enabeld' not allowed")


@pytest.mark.parametrize("value", sorted(WRONG))
def test_a_value_of_the_wrong_type_is_refused_with_its_path(
    cluster_binaries: lab.Binaries, tmp_path: Path, value: str
) -> None:
    done = helm(cluster_binaries, tmp_path).run("template", RELEASE, str(CHART), "--set", value, check=False)
    refused(done, *WRONG[value])


def test_helm_install_refuses_them_before_anything_is_installed(
    cluster_binaries: lab.Binaries, control_plane: lab.ControlPlane, tmp_path: Path
) -> None:
    release = helm(cluster_binaries, tmp_path, control_plane.kubeconfig)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"usage": {"enabeld": True}, "dra": {"enabled": "yes"}}))
    done = release.run(
        "install", "schema-check", str(CHART), "--namespace", "schema-check", "--create-namespace",
        "--values", str(values), check=False,
    )  # fmt: skip
    refused(done, "/usage", "additional properties 'enabeld' not allowed")
    refused(done, "/dra/enabled", "got string, want boolean")
    assert 1 == control_plane.kubectl("get", "namespace", "schema-check").returncode
    assert release.run("status", "schema-check", "--namespace", "schema-check", check=False).returncode != 0


LAB = {
    # Every set of values the lab installs the chart with (lab.helm.lab_values at its call sites).
    "lab": lab_values(),
    "lab configs": lab_values({"mine": "version: v1\n"}),
    "dra (demo --dra, tests/node, bench)": lab_values(dra={"enabled": True}),
    "cdi-cri (tests/node/test_cdi.py, test_mps.py)": lab_values(deviceListStrategy="cdi-cri"),
    "drain (tests/node/test_drain.py)": lab_values(drain={"enabled": True}),
    "metrics service (tests/node/test_agent.py)": lab_values(metrics={"service": {"enabled": True}}),
    "json logs (tests/node/test_node.py)": lab_values(logFormat="json"),
    "cluster (tests/cluster)": cluster.values(),
    "monitoring": lab_values(
        metrics={
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True},
            "dashboard": {"enabled": True},
        }
    ),
}
SETS = {
    # The --set lines of hack/test.sh's lint and of the tests and benchmarks that render parts.
    "hack/test.sh lint": [
        "driverRoot=/run/nvidia/driver", "driverRootReadOnly=false", "deviceListStrategy={envvar,cdi-cri}",
        "config.create=true",
    ],
    "dra parts (tests/integration/test_dra_*.py, hack/bench)": ["dra.enabled=true", "fullnameOverride=x"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LAB) + sorted(SETS))
def test_every_set_of_values_the_lab_installs_with_renders(
    cluster_binaries: lab.Binaries, tmp_path: Path, name: str
) -> None:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if name in LAB:
        path = tmp_path / "values.json"
        path.write_text(json.dumps(LAB[name]))
        args += ["--values", str(path)]
    else:
        args += [a for value in SETS[name] for a in ("--set", value)]
    done = helm(cluster_binaries, tmp_path).run(*args, check=False)
    assert 0 == done.returncode, done.stderr
    assert "kind: DaemonSet" in done.stdout
