"""A fleet: N GPU nodes on the fake NVIDIA driver, on one kube-apiserver, each with its own agent and kubelet.

Each node is a kubelet harness (the kubelet's own device manager, registering its Node and copying
capacity into it at once on a change and every 10 s otherwise, as a kubelet's status loop does),
its own driver root with the fake driver (hack/fakedriver: 8x A100-SXM4-40GB; the agent reaches it
through --driver-root and the real pynvml), kubelet socket directory, journal and pod-bound agent
token; all node state lives on tmpfs (/dev/shm), so a hundred agents' fsyncs do not queue on one
disk as they never would on a hundred machines. Every Node is labelled with one config of the
user's ConfigMap; a ConfigMap edit switches its layout (7x 1g.5gb <-> 2x 3g.20gb on every GPU), so
every node has to destroy and create every MIG device.

- fleet_converge_s_p50/p95: from the ConfigMap PATCH (this process) until each Node, in one watch
  of all Nodes, shows state `success` with the new MIG count labels and the new allocatable; the
  percentiles are over the nodes of one edit, the median over edits.
- fleet_converge_vs_cpu_floor: that p95 over the CPU floor, the CPU-seconds every process of the
  machine used until the last node converged divided by the cores: how long the cores needed for
  that work at the least. Near 1, the fleet waits for nothing but CPU; the CPU by group (agents,
  harnesses, kube-apiserver, etcd) is shown too.
- fleet_agent_cpu_per_converge_s: an agent's CPU (all its threads) per node converge, less the time
  its threads spent inside the fake libnvidia-ml.so.1 (parsing and writing its JSON state, which a
  real driver does not do): fleet_fake_driver_cpu_per_converge_s. The fake driver counts the calls
  and that time itself (FAKE_NVML_COUNTERS, hack/fakedriver/README.md), so
  fleet_nvml_calls_per_converge is every NVML call of the agent per node converge.
- fleet_api_requests_per_converge: the agents' API requests (audit log, by node claim) from the
  PATCH until the last node converged, per node.
- fleet_idle_api_rpm: the agents' API requests (audit log, by node claim) per node per minute in a
  window with nothing changing, after every node converged; the agents' RSS and idle CPU too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lab

from bench.clients import CONFIG_LABEL, Api, Watch, node_view
from bench.cluster import audit_counts, audited_control_plane, deploy
from bench.expect import (
    Inventory,
    allocatable_match,
    expected_inventory,
    expected_labels,
    labels_match,
    mig_config,
)
from bench.procs import (
    cpu_seconds,
    free_port,
    install_driver,
    rss_mb,
    start_agent,
    stop_all,
    thread_cpu_seconds,
)
from bench.report import Budget, Results, percentile, say
from sharing.cli.sim import parse_gpus
from sharing.config import parse_config
from sharing.gpu import simstate
from sharing.mig.catalog import default_catalog

GPUS = "A100-SXM4-40GB:8"
LAYOUTS = ({"1g.5gb": 7}, {"3g.20gb": 2})
KEY = "fleet"
CONVERGE_TIMEOUT_S = 900.0


@dataclass
class Node:
    name: str
    harness: lab.KubeletHarness
    driver: Path
    """The node's driver root."""
    kubeconfig: Path
    agent: subprocess.Popen[bytes] | None = None


def _state_dir() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="gs-bench-fleet-", dir=shm if shm.is_dir() else None))


def bench_fleet(n: int, budget: Budget, results: Results) -> None:
    bins = lab.binaries()
    root = _state_dir()
    products = [s.product for s in parse_gpus(GPUS)]
    catalog = default_catalog()
    inventories = [
        expected_inventory(parse_config(KEY, mig_config(layout), products=products)[0], products, catalog)
        for layout in LAYOUTS
    ]
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, root, True)
        cp, audit_log = audited_control_plane(root, bins)
        stack.enter_context(cp)
        api = Api(cp.server, cp.dir)
        stack.callback(api.close)
        deploy(cp, {KEY: mig_config(LAYOUTS[0])})
        watch = Watch(api, "/api/v1/nodes", node_view).start()
        stack.callback(watch.stop)
        fleet = Fleet(cp, api, watch, audit_log, results)
        say(f"fleet: {n} nodes ({GPUS} each): kubelet harnesses")
        start = time.monotonic()
        stack.callback(fleet.stop)
        fleet.add_nodes(root, n, bins)
        say(f"fleet: {n} agents, until every node shows its config done")
        since = watch.mark()
        fleet.start_agents()
        fleet.converged(inventories[0], since, time.monotonic())
        results.note(
            f"fleet: {n} nodes up, every agent started and converged", f"{time.monotonic() - start:.0f} s"
        )
        results.add("fleet_nodes", n)
        fleet.idle(budget.fleet_idle_s)
        for edit in range(budget.fleet_edits):
            index = (edit + 1) % 2
            fleet.edit(LAYOUTS[index], inventories[index])
        say("fleet: stopping")


@dataclass
class Fleet:
    """The control plane, the clients and the nodes of one fleet."""

    cp: lab.ControlPlane
    api: Api
    watch: Watch
    audit_log: Path
    results: Results
    nodes: list[Node] = field(default_factory=list)

    def add_nodes(self, root: Path, n: int, bins: lab.Binaries, config: str = KEY) -> None:
        """Harnesses (each registers its Node), the label of `config`, pod-bound tokens, the fake
        driver and its GPUs."""
        for i in range(n):
            name = f"fleet-{i:03d}"
            harness = lab.KubeletHarness(
                root / name, kubeconfig=self.cp.kubeconfig, node_name=name, node_status_interval="10s",
                binary=bins.kubelet_harness,
            )  # fmt: skip
            self.nodes.append(Node(name, harness, root / name / "driver", Path()))
            harness.start()
        for node in self.nodes:
            self.watch.wait(node.name, lambda v: True, 0, 60)
            self.api.label_node(node.name, {CONFIG_LABEL: config})
            node.kubeconfig = self.cp.token_kubeconfig(self.api.agent_token(node.name), f"agent-{node.name}")
            simstate.init_state(install_driver(node.driver), parse_gpus(GPUS))

    def start_agents(self, extra: Callable[[Node], Sequence[str]] = lambda node: ()) -> None:
        """Every node's agent, with the flags `extra` gives for its node."""
        for node in self.nodes:
            harness, driver = node.harness, node.driver
            node.agent = start_agent(
                node=node.name, kubeconfig=node.kubeconfig, driver_root=driver,
                plugin_dir=harness.device_plugin_dir,
                pod_resources=harness.pod_resources_socket, log=driver.with_suffix(".log"),
                http_port=free_port(), env={"FAKE_NVML_COUNTERS": str(_counters(node))}, extra=extra(node),
            )  # fmt: skip

    def nvml_counters(self) -> tuple[int, float]:
        """Every agent's NVML calls so far and the seconds its threads spent inside the fake library."""
        calls, ns = 0, 0
        for node in self.nodes:
            with contextlib.suppress(OSError):
                raw = _counters(node).read_bytes()[:16]
                if len(raw) == 16:
                    c, n = struct.unpack("=QQ", raw)
                    calls, ns = calls + c, ns + n
        return calls, ns / 1e9

    def stop(self) -> None:
        stop_all([node.agent for node in self.nodes if node.agent is not None])
        for node in self.nodes:
            node.harness.stop()

    def converged(self, inventory: Inventory, since: int, start: float) -> list[float]:
        """Seconds from `start` until each node's view shows `inventory` done (labels and allocatable)."""
        labels = labels_match(expected_labels(inventory), KEY)
        allocatable = allocatable_match(inventory)
        pending = {node.name for node in self.nodes}
        done: dict[str, float] = {}
        index = since
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while pending:
            for at, _, name, view in self.watch.since(index):
                index += 1
                if name in pending and labels(view) and allocatable(view):
                    pending.discard(name)
                    done[name] = at - start
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(pending)} of {len(self.nodes)} nodes did not converge: {sorted(pending)[:3]}"
                )
            for node in self.nodes:
                if node.agent is not None and node.agent.poll() is not None:
                    raise RuntimeError(
                        f"the agent of {node.name} exited; see {node.driver.with_suffix('.log')}"
                    )
            time.sleep(0.05)
        return [done[node.name] for node in self.nodes]

    def groups(self) -> dict[str, list[int]]:
        """The processes whose CPU is reported, by kind."""
        return {
            "agents": [node.agent.pid for node in self.nodes if node.agent is not None],
            "harnesses": [node.harness.pid for node in self.nodes if node.harness.pid is not None],
            "kube-apiserver": [self.cp.pids["kube-apiserver"]],
            "etcd": [self.cp.pids["etcd"]],
            "bench": [os.getpid()],
        }

    def idle(self, window_s: float) -> None:
        n = len(self.nodes)
        time.sleep(5)  # the last nodes' Events and label patches land before the window
        say(f"fleet: idle window of {window_s:.0f} s")
        agents = self.groups()["agents"]
        wall = time.time()
        start = time.monotonic()
        per_agent = [cpu_seconds(p) for p in agents]
        with _cpu(self.groups()) as used:
            time.sleep(window_s)
        elapsed = time.monotonic() - start
        idle = [100 * (cpu_seconds(p) - c) / elapsed for p, c in zip(agents, per_agent, strict=True)]
        rss = [rss_mb(p) for p in agents]
        counts = audit_counts(self.audit_log, wall, time.time())
        requests = sum(r for r, _ in counts.values())
        watches = sum(w for _, w in counts.values())
        self.results.add("fleet_idle_api_rpm", requests / n / (elapsed / 60))
        self.results.add("fleet_agent_rss_mb_p50", percentile(rss, 50))
        self.results.add("fleet_agent_idle_cpu_pct_p50", percentile(idle, 50))
        self.results.note(
            "fleet idle: agent requests (watch renewals) in the window; agent RSS p50/max; idle CPU p50/max",
            f"{requests} ({watches}); {percentile(rss, 50):.1f}/{max(rss):.1f} MB; "
            f"{percentile(idle, 50):.2f}/{max(idle):.2f} %",
        )
        self.results.note("fleet idle: CPU by group", _shares(used, elapsed, n))
        memory = sum(rss) + sum(rss_mb(p) for p in self.groups()["harnesses"])
        self.results.note(
            "fleet: memory, RSS of agents + harnesses (shared pages in each) / the machine's in use",
            f"{memory / 1024:.1f} GiB / {_memory_in_use() / 1024:.1f} of {_memory_total() / 1024:.1f} GiB",
        )

    def edit(self, layout: dict[str, int], inventory: Inventory) -> None:
        n = len(self.nodes)
        say(f"fleet: ConfigMap edit to {layout} on every GPU, until all {n} nodes show it")
        since = self.watch.mark()
        agents = self.groups()["agents"]
        nvml_before = sum(thread_cpu_seconds(p, "nvml") for p in agents)
        calls, fake = self.nvml_counters()
        wall_start = time.time()
        with _cpu(self.groups()) as used:
            start = time.monotonic()
            self.api.put_config(KEY, mig_config(layout))
            times = self.converged(inventory, since, start)
        calls_after, fake_after = self.nvml_counters()
        calls, fake = calls_after - calls, fake_after - fake
        requests = sum(r for r, _ in audit_counts(self.audit_log, wall_start, time.time()).values())
        # The agent's NVML worker thread (named "nvml"): the backend's reads and changes, pynvml and
        # the fake libnvidia-ml.so.1 all run on it; the rest of the agent is its other threads.
        nvml = (sum(thread_cpu_seconds(p, "nvml") for p in agents) - nvml_before) / n
        agent, fake = used["agents"] / n, fake / n
        self.results.add("fleet_agent_cpu_per_converge_s", agent - fake)
        self.results.add("fleet_fake_driver_cpu_per_converge_s", fake)
        self.results.add("fleet_nvml_calls_per_converge", calls / n)
        self.results.add("fleet_api_requests_per_converge", requests / n)
        self.results.note(
            "fleet converge: agent CPU per node, off its NVML thread / on it (reads, pynvml) / in fake NVML",
            f"{agent - nvml:.3f} s / {nvml - fake:.3f} s / {fake:.3f} s; {calls / n:.0f} NVML calls",
        )
        wall = max(times)
        cost = sum(v for k, v in used.items() if k not in ("machine", "bench")) / n
        cores = os.cpu_count() or 1
        p95 = percentile(times, 95)
        floor = used["machine"] / cores
        self.results.add("fleet_cpu_s_per_node_converge", cost)
        self.results.add("fleet_converge_s_p50", percentile(times, 50))
        self.results.add("fleet_converge_s_p95", p95)
        self.results.add("fleet_converge_vs_cpu_floor", p95 / floor)
        self.results.add("_fleet_converge_max", wall)
        say(f"   p50/p95/max {percentile(times, 50):.1f}/{p95:.1f}/{wall:.1f} s, CPU floor {floor:.1f} s")
        self.results.note(
            f"fleet converge to {layout}: CPU by group during the {wall:.1f} s", _shares(used, wall, n)
        )
        self.results.note(
            f"fleet converge to {layout}: all processes' CPU / what {cores} cores give in that time",
            f"{used['machine'] / (cores * wall):.0%} of the machine (others' work included); "
            f"{cost:.2f} CPU-s per node (agent + harness + API server + etcd): "
            f"{cores} cores converge about {cores * 10 / cost:.0f} nodes in 10 s",
        )


def _counters(node: Node) -> Path:
    """Where the fake driver of the node's agent counts its calls (FAKE_NVML_COUNTERS)."""
    return node.driver.with_suffix(".nvml-counters")


@contextlib.contextmanager
def _cpu(pids: dict[str, list[int]]) -> Iterator[dict[str, float]]:
    """CPU seconds each group of processes used inside the block (and the machine's, all cores)."""
    used: dict[str, float] = {}
    before = {group: sum(cpu_seconds(p) for p in members) for group, members in pids.items()}
    machine = _machine_cpu()
    yield used
    for group, members in pids.items():
        used[group] = sum(cpu_seconds(p) for p in members) - before[group]
    used["machine"] = _machine_cpu() - machine


def _meminfo(key: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _memory_total() -> float:
    return _meminfo("MemTotal")


def _memory_in_use() -> float:
    return _memory_total() - _meminfo("MemAvailable")


def _machine_cpu() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(v) for v in fields) - int(fields[3]) - int(fields[4])  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _shares(used: dict[str, float], wall: float, n: int) -> str:
    parts = [f"{group} {100 * seconds / wall:.0f} %" for group, seconds in used.items()]
    per_node = f"per node: agent {used['agents'] / n:.2f} s, harness {used['harnesses'] / n:.2f} s"
    return ", ".join(parts) + f" of one core; {per_node}"
