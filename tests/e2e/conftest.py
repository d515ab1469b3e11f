"""A GPU node run by the real agent: control plane, kubelet harness, deploy/ and the fake NVIDIA driver.

Each node has its own driver root (`hack/fakedriver/build.sh --install`, its GPUs made with
`sharing sim init`), and the agent reaches the GPUs as on a real node: `--driver-root`, the real
pynvml over the libnvidia-ml.so.1 found there.

The agent authenticates with its ServiceAccount's token (TokenRequest), never as admin; the test
drives it with the requests an operator's kubectl sends: a node label and a config in the ConfigMap
are the merge patches of `kubectl label` and `kubectl patch --type=merge`, sent straight to the API
server (a kubectl process per step costs a tenth of a CPU-second, and the soak takes hundreds).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lab
import pytest
from lab.api import ApiError
from lab.deadlines import scaled
from lab.process import tail

from tests.apiserver import agent_token, wait_for_policy
from tests.polling import poll

REPO = Path(__file__).resolve().parents[2]
CONFIGMAP = "gpu-sharing-config"
NAMESPACE = "gpu-sharing"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
GPUS = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:gpu-sharing"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def deployed(control_plane: lab.ControlPlane) -> lab.ControlPlane:
    """deploy/ applied to the API server (RBAC, the own-node admission policy, the presets), the
    policy in force."""
    control_plane.kubectl("apply", "-f", str(REPO / "deploy"), check=True)
    # The user's ConfigMap is theirs: deploy/ never ships it. Tests add their configs to it.
    if control_plane.kubectl("get", "configmap", CONFIGMAP, "-n", NAMESPACE).returncode != 0:
        control_plane.kubectl("create", "configmap", CONFIGMAP, "-n", NAMESPACE, check=True)
    wait_for_policy(control_plane)
    return control_plane


@dataclass
class AgentProcess:
    """`sharing agent` as the DaemonSet runs it, with its log in a file."""

    process: subprocess.Popen[bytes]
    log: Path
    port: int = 0
    """Its HTTP port (/healthz, /readyz, /status, /metrics)."""

    def get(self, path: str) -> tuple[int, str]:
        """GET a path of the agent's HTTP server: (status, body)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except OSError as err:  # not listening (yet)
            return 0, str(err)

    def wait(self, timeout: float) -> int:
        return self.process.wait(scaled(timeout))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class GpuNode:
    """One GPU node on the fake driver and the handles a test needs."""

    name: str
    control_plane: lab.ControlPlane
    kubelet: lab.KubeletHarness
    kubeconfig: Path
    root: Path
    """The node's driver root (the agent's --driver-root)."""
    tmp: Path
    sim: Path = field(init=False)
    """The fake driver's state (`sharing sim ... --sim-state`)."""
    agent: AgentProcess = field(init=False)
    configs: list[str] = field(default_factory=list)
    agents: list[AgentProcess] = field(default_factory=list)
    bound: set[str] = field(default_factory=set)
    """Pods of the API server bound to this node (in `default`), deleted after the test."""

    def __post_init__(self) -> None:
        self.sim = self.root / "var/lib/fake-nvidia/gpus.json"

    def sharing(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "sharing", *args],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            check=False,
        )
        assert 0 == done.returncode, done.stderr
        return done.stdout

    def start_agent(
        self,
        crash_after: int | None = None,
        kubeconfig: Path | None = None,
        *,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> AgentProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        if crash_after is not None:
            env["SHARING_SIM_CRASH_AFTER"] = str(crash_after)
        log = self.tmp / f"agent-{len(self.agents)}.log"
        port = free_port()
        args = [
            "--node-name", self.name,
            "--namespace", NAMESPACE,
            "--configmap", CONFIGMAP,
            "--kubeconfig", str(kubeconfig or self.kubeconfig),
            "--driver-root", str(self.root),
            "--device-plugin-dir", str(self.kubelet.device_plugin_dir),
            "--pod-resources-socket", str(self.kubelet.pod_resources_socket),
            "--journal", str(self.tmp / "journal.jsonl"),
            "--log-format", "json",
            "--http-port", str(port),
            "--cdi-spec-dir", str(self.tmp / "cdi"),
            *extra,
        ]  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "sharing", "agent", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.agent = AgentProcess(process, log, port)
        self.agents.append(self.agent)
        return self.agent

    def stop_agent(self) -> None:
        """Stop the agent and wait until the kubelet has seen its plugins go (nothing of ours is
        allocatable): a device the kubelet offers after this is the next agent's, registered anew."""
        self.agent.stop()
        self.kubelet.wait_resources(
            lambda r: all(v["allocatable"] == 0 for k, v in r.items() if k.startswith("nvidia.com/")),
            timeout=30,
        )

    def bind_pod(self, name: str, containers: dict[str, dict[str, int]]) -> None:
        """The API server's side of a pod the kubelet harness admits: a Pod bound to this node
        (`spec.nodeName`) with these limits, as the scheduler leaves it; nothing runs it, so it
        stays Pending. The agent compares PodResources with these."""
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": self.name,
                "containers": [
                    {
                        "name": c,
                        "image": "gpu-sharing:placeholder",
                        "resources": {"limits": {r: str(n) for r, n in limits.items()}},
                    }
                    for c, limits in containers.items()
                ],
            },
        }
        self.control_plane.api.request("POST", "/api/v1/namespaces/default/pods", manifest, merge=False)
        self.bound.add(name)

    def unbind_pod(self, name: str) -> None:
        """Delete the API server's Pod at once (no kubelet confirms a graceful deletion here), as
        `kubectl delete --grace-period=0 --force --ignore-not-found` does."""
        try:
            self.control_plane.api.request(
                "DELETE", f"/api/v1/namespaces/default/pods/{name}?gracePeriodSeconds=0"
            )
        except ApiError as err:
            if err.status != 404:
                raise
        self.bound.discard(name)

    def kubectl(self, *args: str) -> str:
        return self.control_plane.kubectl(*args, check=True).stdout

    def label(self, config: str) -> None:
        self.control_plane.api.request(
            "PATCH", f"/api/v1/nodes/{self.name}", {"metadata": {"labels": {CONFIG_LABEL: config}}}
        )

    def put_config(self, text: str, name: str | None = None) -> str:
        """Add or replace one named config in the shared ConfigMap (removed again after the test)."""
        name = name or f"test-{uuid.uuid4().hex[:8]}"
        if name not in self.configs:
            self.configs.append(name)
        self.patch_configs({name: text})
        return name

    def patch_configs(self, data: dict[str, str | None]) -> None:
        """`kubectl patch configmap --type=merge` of the shared ConfigMap's data (None removes a key)."""
        self.control_plane.api.request(
            "PATCH", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIGMAP}", {"data": data}
        )

    def node(self) -> dict[str, Any]:
        return dict(self.control_plane.api.request("GET", f"/api/v1/nodes/{self.name}"))

    def wait_node(self, ok: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
        return dict(poll(f"node {self.name}", self.node, ok, timeout))

    def wait_labels(self, ok: Callable[[dict[str, str]], bool], timeout: float = 60) -> dict[str, str]:
        node = self.wait_node(lambda n: ok(n["metadata"].get("labels", {})), timeout)
        return dict(node["metadata"]["labels"])

    def events(self, reason: str) -> list[dict[str, Any]]:
        """The Events of this reason about the Node."""
        selector = f"involvedObject.kind=Node,involvedObject.name={self.name},reason={reason}"
        query = urllib.parse.urlencode({"fieldSelector": selector})
        return list(
            self.control_plane.api.request("GET", f"/api/v1/namespaces/default/events?{query}")["items"]
        )

    def wait_event(self, reason: str, timeout: float = 60) -> dict[str, Any]:
        return dict(poll(f"event {reason}", lambda: self.events(reason), bool, timeout)[-1])

    def agent_requests(self, start: float, end: float) -> list[str]:
        """API requests the agent's ServiceAccount sent in [start, end) (wall clock), per the audit log:
        `VERB URI` each, in the order received."""
        seen: dict[str, str] = {}
        with open(self.control_plane.audit_log) as log:  # type: ignore[attr-defined]
            for line in log:
                event = json.loads(line)
                if event.get("user", {}).get("username") != AGENT_USER:
                    continue
                received = datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()
                if start <= received < end:
                    seen.setdefault(event["auditID"], f"{event.get('verb')} {event.get('requestURI')}")
        return list(seen.values())

    def export(self) -> dict[str, Any]:
        return dict(json.loads(self.sharing("export", "--driver-root", str(self.root), "--json")))

    def export_mig_uuids(self) -> set[str]:
        exported = json.loads(self.sharing("export", "--driver-root", str(self.root), "--json"))
        return {i["uuid"] for g in exported["gpus"] for i in g["instances"]}


def install_driver(root: Path) -> Path:
    """The fake NVIDIA driver installed under `root`, as a driver installer puts it on a node."""
    done = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh"), "--install", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"hack/fakedriver/build.sh --install failed:\n{done.stderr}")
    return root


@pytest.fixture
def gpu_node(
    control_plane: lab.ControlPlane,
    make_kubelet: Callable[..., lab.KubeletHarness],
    deployed: lab.ControlPlane,
    tmp_path: Path,
) -> Iterator[GpuNode]:
    """2x A100-SXM4-40GB + 2x H100 80GB HBM3 (fake driver), the kubelet harness and the agent."""
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    kubelet = make_kubelet(node_name=name)
    kubeconfig = control_plane.token_kubeconfig(agent_token(control_plane, name), f"agent-{name}")
    node = GpuNode(name, control_plane, kubelet, kubeconfig, install_driver(tmp_path / "root"), tmp_path)
    node.sharing("sim", "init", "--sim-state", str(node.sim), "--gpus", GPUS)
    node.start_agent()
    yield node
    for agent in node.agents:
        agent.stop()
    for pod in sorted(node.bound):
        node.unbind_pod(pod)
    for agent in node.agents:
        sys.stderr.write(f"--- {agent.log.name} (last lines) ---\n{tail(agent.log, 40)}\n")
    # The kubelet's side of a failure (its root, and this log with it, goes with the harness): a
    # panic in the device manager shows here ("http: panic serving"), an admission's outcome too.
    running = "running" if kubelet.pid is not None else "exited"
    sys.stderr.write(f"--- {kubelet.log.name} (last lines; the harness {running}) ---\n")
    sys.stderr.write(f"{tail(kubelet.log, 60)}\n")
    if node.configs:
        node.patch_configs(dict.fromkeys(node.configs))
