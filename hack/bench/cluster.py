"""The fast cluster the single-node benches share: etcd + kube-apiserver with an audit log, deploy/
applied, the kubelet harness (the kubelet's own device manager) as the node, and the agent on
the fake driver's GPUs with a token bound to a pod on that node, as its DaemonSet pod would have.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lab

from bench.clients import CONFIG_LABEL, NAMESPACE, Api, Watch, node_view
from bench.expect import Inventory, expected_inventory, expected_labels, labels_match, resources_match
from bench.procs import REPO, free_port, install_driver, start_agent, stop_process
from bench.report import say
from sharing.cli.sim import parse_gpus
from sharing.config import parse_configmap
from sharing.config.spec import SharingConfig
from sharing.gpu import simstate
from sharing.mig.catalog import Catalog, default_catalog

NODE = "bench-gpu-node"
AGENT_USER = "system:serviceaccount:gpu-sharing:gpu-sharing"
NODE_CLAIM = "authentication.kubernetes.io/node-name"
HARNESS_POLL = "--poll-interval=10ms"
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["{AGENT_USER}"]
  - level: None
"""


def audited_control_plane(directory: Path, bins: lab.Binaries) -> tuple[lab.ControlPlane, Path]:
    """A control plane (not started) whose audit log records every request of the agents."""
    directory.mkdir(parents=True, exist_ok=True)
    policy = directory / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    audit_log = directory / "audit.log"
    args = [f"--audit-policy-file={policy}", f"--audit-log-path={audit_log}"]
    return lab.ControlPlane(
        base_dir=directory / "control-plane", extra_apiserver_args=args, bins=bins
    ), audit_log


def deploy(cp: lab.ControlPlane, configs: dict[str, str] | None = None) -> None:
    """deploy/ (RBAC, the own-node admission policy, the presets) and the user's ConfigMap with
    the presets' configs plus `configs`."""
    cp.kubectl("apply", "-f", str(REPO / "deploy"), check=True)
    presets = cp.kubectl("get", "configmap", "gpu-sharing-presets", "-n", NAMESPACE, "-o", "json", check=True)
    data = {**json.loads(presets.stdout)["data"], **(configs or {})}
    user = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gpu-sharing-config"}, "data": data}
    user["metadata"]["namespace"] = NAMESPACE
    cp.kubectl("apply", "-f", "-", input=json.dumps(user), check=True)


def audit_counts(audit_log: Path, start_wall: float, end_wall: float) -> dict[str, tuple[int, int]]:
    """{node claim: (requests, of which watches)} the agents sent in [start, end), by audit ID."""
    seen: dict[str, tuple[str, str]] = {}
    with audit_log.open() as log:
        for line in log:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            user = event.get("user", {})
            if user.get("username") != AGENT_USER:
                continue
            if event.get("stage") not in ("ResponseStarted", "ResponseComplete"):
                continue
            received = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
            if start_wall <= received < end_wall:
                node = (user.get("extra", {}).get(NODE_CLAIM) or [""])[0]
                seen[event["auditID"]] = (node, event.get("verb", ""))
    counts: dict[str, tuple[int, int]] = {}
    for node, verb in seen.values():
        n, w = counts.get(node, (0, 0))
        counts[node] = (n + 1, w + (verb == "watch"))
    return counts


@dataclass
class Cluster:
    """Everything the single-node benches run: control plane, harness, agent, clients."""

    tmp: Path
    cp: lab.ControlPlane
    kubelet: lab.KubeletHarness
    api: Api
    watch: Watch
    audit_log: Path
    agent_kubeconfig: Path
    catalog: Catalog
    agent: subprocess.Popen[bytes] | None = None
    agents: int = 0
    driver: Path = Path()
    """The node's driver root (the fake driver, fresh GPUs per sim_init)."""
    gpus: list[str] = field(default_factory=list)

    def sim_init(self, gpus: str) -> None:
        specs = parse_gpus(gpus)
        self.driver = self.tmp / f"driver-{len(specs)}-{self.agents}"
        simstate.init_state(install_driver(self.driver), specs)
        self.gpus = [s.product for s in specs]

    def start_agent(self, kubeconfig: Path | None = None) -> subprocess.Popen[bytes]:
        self.agents += 1
        self.agent = start_agent(
            node=NODE, kubeconfig=kubeconfig or self.agent_kubeconfig, driver_root=self.driver,
            plugin_dir=self.kubelet.device_plugin_dir, pod_resources=self.kubelet.pod_resources_socket,
            log=self.tmp / f"agent-{self.agents}.log", http_port=free_port(),
        )  # fmt: skip
        return self.agent

    def stop_agent(self) -> None:
        stop_process(self.agent)
        self.agent = None

    def config(self, name: str) -> SharingConfig:
        data = self.api.configmap_data()
        configs = parse_configmap({name: data[name]}, products=self.gpus, catalog=self.catalog)
        config = configs.get(name)
        if config is None:
            raise RuntimeError(f"config {name!r} is invalid: {configs.errors}")
        return config

    def expect(self, name: str) -> Inventory:
        return expected_inventory(self.config(name), self.gpus, self.catalog)

    def check_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is not None:
            raise RuntimeError(f"the agent exited with {self.agent.returncode}; see {self.tmp}/agent-*.log")

    def wait_resources(self, ok: Callable[[dict[str, Any]], bool], timeout: float = 60) -> float:
        """Time the harness reply that first satisfies `ok` arrived."""
        self.kubelet.wait_resources(ok, timeout=timeout)
        return time.monotonic()

    def wait_labels(self, name: str, inventory: Inventory, since: int, timeout: float = 90) -> float:
        """Arrival of the Node event that shows config `name` done (state, MIG counts, annotation)."""
        return self.watch.wait(NODE, labels_match(expected_labels(inventory), name), since, timeout)

    def converge(self, name: str, timeout: float = 90) -> tuple[float, float]:
        """Label the node with config `name`; (seconds to the harness, seconds to the labels)."""
        inventory = self.expect(name)
        since = self.watch.mark()
        start = time.monotonic()
        self.api.label_node(NODE, {CONFIG_LABEL: name})
        at_harness = self.wait_resources(resources_match(inventory), timeout)
        at_labels = self.wait_labels(name, inventory, since, timeout)
        return at_harness - start, at_labels - start

    def audit(self, start_wall: float, end_wall: float) -> tuple[int, int]:
        """(requests, of which watches) the agent sent in [start, end)."""
        counts = audit_counts(self.audit_log, start_wall, end_wall).values()
        return sum(n for n, _ in counts), sum(w for _, w in counts)


@contextlib.contextmanager
def running_cluster(tmp: Path) -> Iterator[Cluster]:
    """Control plane, deploy/, the harness registered as the Node, and a pod-bound agent token."""
    bins = lab.binaries()
    say("starting etcd + kube-apiserver (audit log on) and the kubelet harness")
    with contextlib.ExitStack() as stack:
        cp, audit_log = audited_control_plane(tmp, bins)
        stack.enter_context(cp)
        kubelet = stack.enter_context(
            lab.KubeletHarness(
                tmp / "kubelet", kubeconfig=cp.kubeconfig, node_name=NODE, extra_args=[HARNESS_POLL],
                binary=bins.kubelet_harness,
            )
        )  # fmt: skip
        api = Api(cp.server, cp.dir)
        stack.callback(api.close)
        deadline = time.monotonic() + 60
        while True:
            try:
                api.request("GET", f"/api/v1/nodes/{NODE}")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        deploy(cp)
        kubeconfig = cp.token_kubeconfig(api.agent_token(NODE), "gpu-sharing-agent")
        watch = Watch(api, "/api/v1/nodes", node_view, f"metadata.name={NODE}").start()
        stack.callback(watch.stop)
        env = Cluster(tmp, cp, kubelet, api, watch, audit_log, kubeconfig, default_catalog())
        stack.callback(env.stop_agent)
        yield env
