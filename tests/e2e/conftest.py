"""A simulated GPU node run by the real agent: control plane, kubelet harness, deploy/ and a sim state.

The agent authenticates with its ServiceAccount's token (TokenRequest), never as admin; the test
drives it the way an operator does: `kubectl label`, `kubectl patch configmap`, `kubectl get`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lab
import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGMAP = "gpu-sharing-config"
NAMESPACE = "gpu-sharing"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
GPUS = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"


def poll(what: str, read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float) -> Any:
    """Read until `ok(value)`; a deadline, not a sleep, bounds it (the API has no change feed here)."""
    deadline = time.monotonic() + timeout
    value = read()
    while not ok(value):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s; last: {value}")
        time.sleep(0.1)
        value = read()
    return value


@pytest.fixture(scope="session")
def agent_kubeconfig(control_plane: lab.ControlPlane) -> Path:
    """deploy/ applied to the API server, the user's ConfigMap made from the presets; a kubeconfig
    with the agent ServiceAccount's own token."""
    control_plane.kubectl("apply", "-f", str(REPO / "deploy"), check=True)
    # The tests label nodes with preset names and add their own configs to the user's ConfigMap,
    # which deploy/ leaves to the user: make it, holding the presets (same names, same texts).
    presets = json.loads(
        control_plane.kubectl(
            "get", "configmap", "gpu-sharing-presets", "-n", NAMESPACE, "-o", "json", check=True
        ).stdout
    )
    user = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP, "namespace": NAMESPACE}}
    control_plane.kubectl("apply", "-f", "-", input=json.dumps({**user, "data": presets["data"]}), check=True)
    token = control_plane.kubectl(
        "create", "token", "gpu-sharing", "-n", NAMESPACE, "--duration=2h", check=True
    ).stdout.strip()
    return control_plane.token_kubeconfig(token, "gpu-sharing-agent")


@dataclass
class AgentProcess:
    """`sharing agent` as the DaemonSet runs it, with its log in a file."""

    process: subprocess.Popen[bytes]
    log: Path

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

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
    """One simulated GPU node and the handles a test needs."""

    name: str
    control_plane: lab.ControlPlane
    kubelet: lab.KubeletHarness
    kubeconfig: Path
    sim: Path
    tmp: Path
    agent: AgentProcess = field(init=False)
    configs: list[str] = field(default_factory=list)
    agents: list[AgentProcess] = field(default_factory=list)

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

    def start_agent(self, crash_after: int | None = None, kubeconfig: Path | None = None) -> AgentProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if crash_after is not None:
            env["SHARING_SIM_CRASH_AFTER"] = str(crash_after)
        log = self.tmp / f"agent-{len(self.agents)}.log"
        args = [
            "--node-name", self.name,
            "--namespace", NAMESPACE,
            "--configmap", CONFIGMAP,
            "--kubeconfig", str(kubeconfig or self.kubeconfig),
            "--backend", "sim",
            "--sim-state", str(self.sim),
            "--device-plugin-dir", str(self.kubelet.device_plugin_dir),
            "--pod-resources-socket", str(self.kubelet.pod_resources_socket),
            "--journal", str(self.tmp / "journal.jsonl"),
            "--log-format", "json",
        ]  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "sharing", "agent", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.agent = AgentProcess(process, log)
        self.agents.append(self.agent)
        return self.agent

    def kubectl(self, *args: str) -> str:
        return self.control_plane.kubectl(*args, check=True).stdout

    def label(self, config: str) -> None:
        self.kubectl("label", "node", self.name, f"{CONFIG_LABEL}={config}", "--overwrite")

    def put_config(self, text: str, name: str | None = None) -> str:
        """Add or replace one named config in the shared ConfigMap (removed again after the test)."""
        name = name or f"test-{uuid.uuid4().hex[:8]}"
        if name not in self.configs:
            self.configs.append(name)
        patch = json.dumps({"data": {name: text}})
        self.kubectl("patch", "configmap", CONFIGMAP, "-n", NAMESPACE, "--type=merge", "-p", patch)
        return name

    def node(self) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("get", "node", self.name, "-o", "json")))

    def wait_node(self, ok: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
        return dict(poll(f"node {self.name}", self.node, ok, timeout))

    def wait_labels(self, ok: Callable[[dict[str, str]], bool], timeout: float = 60) -> dict[str, str]:
        node = self.wait_node(lambda n: ok(n["metadata"].get("labels", {})), timeout)
        return dict(node["metadata"]["labels"])

    def wait_event(self, reason: str, timeout: float = 60) -> dict[str, Any]:
        selector = f"involvedObject.kind=Node,involvedObject.name={self.name},reason={reason}"

        def read() -> list[dict[str, Any]]:
            out = self.kubectl("get", "events", "-n", "default", "--field-selector", selector, "-o", "json")
            return list(json.loads(out)["items"])

        return dict(poll(f"event {reason}", read, bool, timeout)[-1])

    def export_mig_uuids(self) -> set[str]:
        exported = json.loads(
            self.sharing("export", "--backend", "sim", "--sim-state", str(self.sim), "--json")
        )
        return {i["uuid"] for g in exported["gpus"] for i in g["instances"]}


@pytest.fixture
def gpu_node(
    control_plane: lab.ControlPlane,
    make_kubelet: Callable[..., lab.KubeletHarness],
    agent_kubeconfig: Path,
    tmp_path: Path,
) -> Iterator[GpuNode]:
    """2x A100-SXM4-40GB + 2x H100 80GB HBM3 (simulated), the kubelet harness and the agent."""
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    kubelet = make_kubelet(node_name=name)
    sim = tmp_path / "gpus.json"
    node = GpuNode(name, control_plane, kubelet, agent_kubeconfig, sim, tmp_path)
    node.sharing("sim", "init", "--state", str(sim), "--gpus", GPUS)
    node.start_agent()
    yield node
    for agent in node.agents:
        agent.stop()
    for agent in node.agents:
        sys.stderr.write(f"--- {agent.log.name} (last lines) ---\n")
        sys.stderr.write("\n".join(agent.log.read_text(errors="replace").splitlines()[-40:]) + "\n")
    if node.configs:
        patch = json.dumps({"data": dict.fromkeys(node.configs)})
        control_plane.kubectl("patch", "configmap", CONFIGMAP, "-n", NAMESPACE, "--type=merge", "-p", patch)
