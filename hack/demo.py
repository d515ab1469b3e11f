"""The demo: a local control plane, a simulated GPU node, the agent, and `kubectl describe node`.

Run through hack/demo.sh. It builds (or reuses) the Go binaries, starts etcd + kube-apiserver and the
kubelet harness (the kubelet's own device manager) for node `demo-gpu-node`, applies deploy/, creates
2x A100-SXM4-40GB + 2x H100 80GB HBM3 simulated GPUs, starts `sharing agent` with the agent's own
ServiceAccount token, labels the node with a preset, and shows the slices on the Node.
Without --detach it stays up until Ctrl-C; --down stops what a detached run left running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NODE = "demo-gpu-node"
PRESET = "a100-mig-h100-time-sliced"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
# What the preset gives on this node: each A100 2x 1g.5gb + 2g.10gb + 3g.20gb, each H100 4 replicas.
EXPECTED = {
    "nvidia.com/mig-1g.5gb": "4",
    "nvidia.com/mig-2g.10gb": "2",
    "nvidia.com/mig-3g.20gb": "2",
    "nvidia.com/gpu": "8",
}
GPUS = "A100-SXM4-40GB:2,H100-80GB-HBM3:2"
XDG_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
CACHE = Path(os.environ.get("SHARING_CACHE") or XDG_CACHE / "gpu-sharing")


def say(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


def run(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=True, text=True, capture_output=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "hack" / "cluster.py"), *args], check=False, text=True)


def sharing(*args: str) -> list[str]:
    return [sys.executable, "-m", "sharing", *args]


def down(state: Path) -> None:
    """Stop the agent, then the harness and the control plane."""
    pid_file = state / "agent.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
        except ProcessLookupError:
            pass
        pid_file.unlink()
    cluster("down", "--state-dir", str(state))
    # Nothing in the state is worth keeping (etcd data, certificates, simulated GPUs): the next
    # demo starts from scratch, so old labels and capacity can never pass for new ones.
    shutil.rmtree(state, ignore_errors=True)
    say("demo stopped")


def up(state: Path) -> Path:
    """Start everything and return the admin kubeconfig."""
    if state.exists():
        say("a previous demo is still registered; stopping it first")
        down(state)
    state.mkdir(parents=True)
    say("building or reusing kube-apiserver, etcd and the kubelet harness (first run: ~15 minutes)")
    subprocess.run([str(REPO / "hack" / "build-go.sh")], check=True, stdout=subprocess.DEVNULL)
    say(f"starting etcd, kube-apiserver and the kubelet harness for node {NODE}")
    if cluster("up", "--state-dir", str(state), "--node", NODE).returncode != 0:
        raise SystemExit("the local control plane did not start; see the logs under " + str(state))
    info = json.loads((state / "cluster.json").read_text())
    kubeconfig = Path(info["kubeconfig"])
    kubectl = ["kubectl", f"--kubeconfig={kubeconfig}"]
    say("applying deploy/ (namespace, RBAC, the presets ConfigMap gpu-sharing-config)")
    run(*kubectl, "apply", "-f", str(REPO / "deploy"))
    token = run(
        *kubectl, "create", "token", "gpu-sharing", "-n", "gpu-sharing", "--duration=24h"
    ).stdout.strip()
    agent_kubeconfig = state / "agent.kubeconfig"
    config = json.loads(run(*kubectl, "config", "view", "--raw", "-o", "json").stdout)
    config["users"] = [{"name": "gpu-sharing", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "gpu-sharing"
    agent_kubeconfig.write_text(json.dumps(config))
    sim = state / "gpus.json"
    say(f"simulating {GPUS.replace(',', ' + ').replace(':', ' x')}")
    run(*sharing("sim", "init", "--state", str(sim), "--gpus", GPUS), cwd=REPO)
    say("starting the agent (log: " + str(state / "agent.log") + ")")
    with (state / "agent.log").open("wb") as log:
        agent = subprocess.Popen(
            sharing(
                "agent", "--node-name", NODE, "--kubeconfig", str(agent_kubeconfig), "--backend", "sim",
                "--sim-state", str(sim), "--device-plugin-dir", info["kubelet"]["device_plugin_dir"],
                "--pod-resources-socket", info["kubelet"]["pod_resources_socket"],
                "--journal", str(state / "journal.jsonl"), "--log-format", "console",
            ),
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    (state / "agent.pid").write_text(str(agent.pid))
    say(f"labelling {NODE} with nvidia.com/device-plugin.config={PRESET}")
    started = time.monotonic()
    run(*kubectl, "label", "node", NODE, f"{CONFIG_LABEL}={PRESET}", "--overwrite")
    deadline = started + 120
    while True:
        node = json.loads(run(*kubectl, "get", "node", NODE, "-o", "json").stdout)
        labels = node["metadata"].get("labels", {})
        capacity = node["status"].get("capacity", {})
        if labels.get("nvidia.com/mig.config.state") == "success" and EXPECTED.items() <= capacity.items():
            break
        if agent.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the slices did not appear; see " + str(state / "agent.log"))
        time.sleep(0.2)
    say(f"slices visible on the Node {time.monotonic() - started:.1f}s after the label change")
    print(run(*kubectl, "describe", "node", NODE).stdout)
    return kubeconfig


def main() -> int:
    parser = argparse.ArgumentParser(description="gpu-sharing demo on a local control plane")
    parser.add_argument("--detach", action="store_true", help="return once the slices are visible")
    parser.add_argument("--down", action="store_true", help="stop a detached demo")
    args = parser.parse_args()
    state = CACHE / "demo"
    if args.down:
        down(state)
        return 0
    try:
        kubeconfig = up(state)
    except (subprocess.CalledProcessError, SystemExit, KeyboardInterrupt) as err:
        detail = getattr(err, "stderr", None) or err
        print(f"demo failed: {detail}", file=sys.stderr)
        down(state)
        return 1
    print(
        f"""Try next (in another shell):
  export KUBECONFIG={kubeconfig}
  kubectl label node {NODE} nvidia.com/device-plugin.config=all-1g --overwrite   # 7 x 1g on every GPU
  kubectl label node {NODE} nvidia.com/device-plugin.config=all-replicas-4 --overwrite   # MIG off, 4 replicas
  kubectl -n gpu-sharing edit configmap gpu-sharing-config   # edit a config: applied live
  kubectl get node {NODE} --show-labels; kubectl get events --field-selector involvedObject.name={NODE}
  PYTHONPATH={REPO} {sys.executable} -m sharing export --backend sim --sim-state {state / "gpus.json"}"""
    )
    if args.detach:
        print(f"stop it with: hack/demo.sh --down\nexport KUBECONFIG={kubeconfig}")
        return 0
    print("The demo runs until Ctrl-C.", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        down(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
