"""The chart's monitoring objects checked by Prometheus's own promtool (hack/go/prometheus).

With `metrics.serviceMonitor`, `metrics.prometheusRule` and `metrics.dashboard` on, the chart renders
a ServiceMonitor, a PrometheusRule and a Grafana dashboard ConfigMap. Here:

- `promtool check rules` reads the PrometheusRule's groups as a rule file;
- `promtool test rules` runs tests/monitoring/alerts.test.yaml against them: each alert fires on
  the input that should fire it and stays silent on the inputs beside it;
- every query of the dashboard (its panels and its variables) is evaluated by promtool over the
  series Prometheus would store from a scrape of the agent, and a query that returns nothing fails;
- the ServiceMonitor selects the metrics Service, and its port, in the release's namespace.

The series come from a scrape: a hand-written one here (tests/monitoring/scrape.txt, every kind
of series the agent serves), and a scrape of the agent on the lab's real node in
tests/node/test_monitoring.py, where every dashboard query must return series too. They are
labelled as Prometheus labels a scrape of the rendered ServiceMonitor's target (`target()`,
`stored()`), so a query that reads a label the ServiceMonitor does not give fails too.
promtool evaluates them offline through its rule unit tests (input series, a PromQL expression, the
samples it should give): nothing to start, no TSDB to write, a second per run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import lab
import pytest
import yaml
from lab.helm import NAMESPACE, RELEASE
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "gpu-sharing"
MONITORING = REPO / "tests" / "monitoring"
ON = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "metrics.dashboard.enabled=true",
)
KINDS = ("ServiceMonitor", "PrometheusRule")
AGENT_NODE = "gpu-node-1"
AGENT_POD = "gpu-sharing-4xk2p"
AGENT_ADDRESS = "10.244.1.2"
MINUTES = 60
"""How long the stored series last (one sample a minute); queries are evaluated at the end."""
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def scrape() -> str:
    """The agent's /metrics, as Prometheus reads it: the source of every series here."""
    return (MONITORING / "scrape.txt").read_text()


def helm_template(bins: lab.Binaries, *sets: str) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` renders them with `sets` (`--set`)."""
    args = [str(bins.helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for value in sets:
        args += ["--set", value]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    assert 0 == done.returncode, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def rendered(cluster_binaries: lab.Binaries) -> dict[tuple[str, str], dict[str, Any]]:
    """The chart with its monitoring on: (kind, name) -> object."""
    return {(d["kind"], d["metadata"]["name"]): d for d in helm_template(cluster_binaries, *ON)}


def one(rendered: Mapping[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for (k, _), d in rendered.items() if k == kind]
    return found


def promtool(bins: lab.Binaries, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """promtool, built with the tests' tools (the demo's build leaves it out)."""
    tool = lab.binaries(test_tools=True).promtool
    return subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, check=False)


def rules_file(rendered: Mapping[tuple[str, str], dict[str, Any]], directory: Path) -> Path:
    """The PrometheusRule's groups as the rule file Prometheus reads (what the operator writes)."""
    path = directory / "rules.yaml"
    path.write_text(
        yaml.safe_dump({"groups": one(rendered, "PrometheusRule")["spec"]["groups"]}, sort_keys=False)
    )
    return path


def test_the_monitoring_objects_are_off_by_default(cluster_binaries: lab.Binaries) -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in helm_template(cluster_binaries)}
    assert set() == {k for k in kinds if k[0] in KINDS or k == ("ConfigMap", "gpu-sharing-dashboard")}
    assert ("Service", "gpu-sharing-metrics") not in kinds


def test_promtool_checks_the_prometheusrules_groups(
    cluster_binaries: lab.Binaries, rendered: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    done = promtool(
        cluster_binaries, "check", "rules", "--lint=all", "--lint-fatal", rules_file(rendered, tmp_path)
    )
    assert 0 == done.returncode, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout


def test_each_alert_fires_on_its_input_and_stays_silent_otherwise(
    cluster_binaries: lab.Binaries, rendered: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    rules_file(rendered, tmp_path)
    tests = shutil.copy(MONITORING / "alerts.test.yaml", tmp_path)
    done = promtool(cluster_binaries, "test", "rules", tests)
    assert 0 == done.returncode, done.stdout + done.stderr
    # Every alert of the chart is tested both ways: firing, and silent where it should be.
    alerts = {r["alert"] for g in one(rendered, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    cases = [c for t in yaml.safe_load(Path(tests).read_text())["tests"] for c in t["alert_rule_test"]]
    assert (alerts, alerts) == (
        {c["alertname"] for c in cases if c["exp_alerts"]},
        {c["alertname"] for c in cases if not c["exp_alerts"]},
    )


def test_the_servicemonitor_scrapes_the_metrics_services_port_of_the_agents(
    rendered: dict[tuple[str, str], dict[str, Any]],
) -> None:
    monitor, service = one(rendered, "ServiceMonitor"), one(rendered, "Service")
    pods = rendered[("DaemonSet", "gpu-sharing")]["spec"]["template"]
    (agent,) = [c for c in pods["spec"]["containers"] if c["name"] == "agent"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert [service["metadata"]["namespace"]] == monitor["spec"]["namespaceSelector"]["matchNames"]
    assert [("metrics", "/metrics")] == [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]]
    assert [("metrics", "metrics")] == [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]]
    assert service["spec"]["selector"].items() <= pods["metadata"]["labels"].items()
    assert "metrics" in [p["name"] for p in agent["ports"]]


def test_the_dashboard_is_a_configmap_grafanas_sidecar_loads(
    rendered: dict[tuple[str, str], dict[str, Any]],
) -> None:
    configmap = rendered[("ConfigMap", "gpu-sharing-dashboard")]
    assert "1" == configmap["metadata"]["labels"]["grafana_dashboard"]
    (text,) = configmap["data"].values()
    assert json.loads((CHART / "dashboards" / "gpu-sharing.json").read_text()) == json.loads(text)


def target(rendered: Mapping[tuple[str, str], dict[str, Any]]) -> tuple[dict[str, str], bool]:
    """The labels Prometheus gives the agent's scrape target of the rendered ServiceMonitor (as the
    Prometheus Operator writes its scrape config: job from the Service's name, namespace, service,
    pod, container, endpoint; then the ServiceMonitor's relabelings of the pod's metadata), and
    whether its labels yield to the scraped ones (honorLabels)."""
    monitor, service = one(rendered, "ServiceMonitor"), one(rendered, "Service")
    (endpoint,) = monitor["spec"]["endpoints"]
    labels = {
        "job": service["metadata"]["name"],
        "instance": f"{AGENT_ADDRESS}:{service['spec']['ports'][0]['port']}",
        "namespace": service["metadata"]["namespace"],
        "service": service["metadata"]["name"],
        "pod": AGENT_POD,
        "container": "agent",
        "endpoint": endpoint["port"],
    }
    meta = {"__meta_kubernetes_pod_node_name": AGENT_NODE}
    for relabel in endpoint.get("relabelings", []):
        assert relabel.get("action", "replace").lower() == "replace", relabel
        labels[relabel["targetLabel"]] = ";".join(meta[s] for s in relabel["sourceLabels"])
    return labels, bool(endpoint.get("honorLabels"))


def stored(text: str, labels: Mapping[str, str], honor: bool) -> Iterator[tuple[dict[str, str], float]]:
    """The series Prometheus stores from a scrape of `text` by a target of `labels`: each sample's
    labels merged with the target's as Prometheus's scrape loop does (scrape/scrape.go,
    mutateSampleLabels: with honor the scraped label wins, otherwise it is kept as exported_<name>;
    empty labels are dropped), and `up` 1."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            merged = {"__name__": sample.name, **sample.labels}
            for name, value in labels.items():
                if honor and name in sample.labels:
                    continue
                if not honor and sample.labels.get(name):
                    merged[f"exported_{name}"] = sample.labels[name]
                merged[name] = value
            yield {k: v for k, v in merged.items() if v}, sample.value
    yield {"__name__": "up", **labels}, 1.0


def test_a_slices_series_name_the_pod_holding_it_not_the_agents(
    rendered: dict[tuple[str, str], dict[str, Any]],
) -> None:
    labels, honor = target(rendered)
    held = {
        (s.labels["namespace"], s.labels["pod"])
        for f in text_string_to_metric_families(scrape())
        for s in f.samples
        if s.name == "gpu_sharing_slice_owner_info"
    }
    assert len(held) > 1
    kept = list(stored(scrape(), labels, honor))
    owners = {(s["namespace"], s["pod"]) for s, _ in kept if s["__name__"] == "gpu_sharing_slice_owner_info"}
    agents = {(s["namespace"], s["pod"]) for s, _ in kept if s["__name__"] == "gpu_sharing_build_info"}
    assert (held, {(NAMESPACE, AGENT_POD)}) == (owners, agents)


def series(labels: Mapping[str, str]) -> str:
    """A series in PromQL's selector syntax (promtool's input_series)."""
    inner = ",".join(f'{k}="{_quote(v)}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{labels['__name__']}{{{inner}}}"


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every query of the dashboard: each panel target, each variable's label_values
    (as "series of this selector that carry this label"), with Grafana's variables filled in as its
    "All" does (allValue `.*`) and its interval variables as fixed durations."""
    dashboard = json.loads((CHART / "dashboards" / "gpu-sharing.json").read_text())
    found = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {t['refId']}", t["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["query"])
        assert match, f"variable {variable['name']}: {variable['query']}"
        selector, label = match.groups()
        # `unless on (label) vector(1)` drops the series whose label is empty.
        found.append(
            (f"variable {variable['name']}", f"count by ({label}) ({selector}) unless on ({label}) vector(1)")
        )
    return [(where, _fill(expr)) for where, expr in found]


def _fill(expr: str) -> str:
    for name, duration in GRAFANA_INTERVALS.items():
        expr = expr.replace(name, duration)
    filled = re.sub(r'=~"\$\{?\w+\}?"', '=~".*"', expr)
    assert "$" not in filled, f"a Grafana variable outside a regex matcher: {expr}"
    return filled


def evaluation(
    samples: Sequence[tuple[dict[str, str], float]], queries: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    """A promtool rule unit test: the samples as series lasting MINUTES, each query wrapped in absent()
    (a sample when the query returns nothing) and expected to give no sample."""
    return {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": series(labels), "values": f"{_number(value)}+0x{MINUTES}"}
                    for labels, value in samples
                ],
                "promql_expr_test": [
                    {"expr": f"absent({expr})", "eval_time": f"{MINUTES}m", "exp_samples": []}
                    for _, expr in queries
                ],
            }
        ],
    }


def _number(value: float) -> str:
    return format(Decimal(repr(value)), "f")


def empty_dashboard_queries(
    bins: lab.Binaries, rendered: Mapping[tuple[str, str], dict[str, Any]], text: str, tmp_path: Path
) -> list[str]:
    """Where each dashboard query that returns nothing over the series Prometheus stores from a scrape
    of `text` by the rendered ServiceMonitor's target stands (none: every query returns series)."""
    labels, honor = target(rendered)
    samples = list(stored(text, labels, honor))
    queries = dashboard_queries()
    assert len(queries) > 20
    path = tmp_path / "dashboard.test.yaml"
    path.write_text(yaml.safe_dump(evaluation(samples, queries), sort_keys=False))
    done = promtool(bins, "test", "rules", path)
    # promtool names each failed expression as a Go-quoted string: `expr: "absent(...)", time: ...`.
    failed = {json.loads(q) for q in re.findall(r'expr: ("(?:[^"\\]|\\.)*"), time:', done.stderr)}
    empty = [where for where, expr in queries if f"absent({expr})" in failed]
    assert done.returncode == 0 or empty, done.stdout + done.stderr
    return empty


def test_every_dashboard_query_returns_series_from_a_scrape_with_every_kind_of_series(
    cluster_binaries: lab.Binaries, rendered: dict[tuple[str, str], dict[str, Any]], tmp_path: Path
) -> None:
    """The dashboard's queries against a scrape that has every series the agent can serve (a fast
    check of the queries' syntax and labels; tests/node/test_monitoring.py evaluates them over a
    scrape of the agent on the real node)."""
    assert [] == empty_dashboard_queries(cluster_binaries, rendered, scrape(), tmp_path)
