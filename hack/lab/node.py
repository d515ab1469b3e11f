"""A real Kubernetes cluster of one node or several: the first node runs the control plane,
containerd, kubelet, scheduler, controller-manager and kube-proxy, every further node its own
containerd, kubelet and kube-proxy; each node in its own private namespaces and cgroups, with its own
fake NVIDIA driver and GPUs.

``RealNode.up()`` starts the first node detached and ``join()`` another one; each records its PIDs
(with their start times) in ``<state>/node.json``, the first node also the nodes that joined.
``RealNode.load(name).down()`` stops every node from those records alone, kills what they left in
their cgroups (shims, containers), removes the cgroups and the cluster's bridge, and lets the kernel
drop the namespaces with their mounts, interfaces and iptables rules. ``kubectl`` on the host works
with the admin kubeconfig: the API server listens on the first node's address, on the cluster's
bridge (lab.netns).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import components, containerd, driver, packages
from lab.api import Api, ApiError, close_api
from lab.binaries import KUBELET_VERSION_ENV, Binaries, binaries
from lab.cgroups import CgroupTree
from lab.controlplane import ControlPlane, NodeNetwork
from lab.deadlines import scaled
from lab.errors import ClusterError
from lab.netns import Namespaces
from lab.paths import cache_dir, kubectl_path
from lab.process import PidRecord, Process, stop_all, tail

READY_TIMEOUT = 120.0


class RealNode:
    """Node ``node_name`` of the lab cluster ``name``; ``index`` keeps two clusters apart (subnet).

    ``member`` 0 is the cluster's first node (the control plane runs on it, as on a kubeadm
    control-plane node that also runs pods); the nodes that ``join`` it are members 1, 2, ...
    ``gpus`` are the node's simulated GPUs (`sharing sim init --gpus`), their UUIDs seeded with the
    node's name so no two nodes share one. ``k8s`` is the cluster's Kubernetes release (``"1.34"``;
    default ``SHARING_K8S_VERSION``, else hack/go/k8s's). ``kubelet`` runs the node's kubelet from
    another release than the cluster's (``"1.34"``: version skew, within the kubelet's three minors
    behind the API server; default ``SHARING_KUBELET_VERSION``, else the cluster's release).
    """

    def __init__(
        self,
        name: str = "demo",
        node_name: str = "demo-gpu-node",
        *,
        index: int = 0,
        member: int = 0,
        gpus: str = driver.GPUS,
        k8s: str | None = None,
        kubelet: str | None = None,
    ) -> None:
        self.name = name
        self.k8s_version = k8s
        self.node_name = node_name
        self.index = index
        self.member = member
        self.gpus = gpus
        self.kubelet_version = kubelet or os.environ.get(KUBELET_VERSION_ENV) or None
        cluster = cache_dir() / "node" / name
        self.state = cluster if member == 0 else cluster.with_name(f"{name}-n{member}")
        self.cgroup = CgroupTree(f"gpu-sharing-{name}" + (f"-n{member}" if member else ""))
        self.ns = Namespaces(name, self.state, index, member)
        self.records: list[PidRecord] = []
        self.members: list[RealNode] = []
        """The nodes that joined this one (on the first node)."""
        self._recorded_members: list[int] = []
        self.kubeconfig = cluster / "control-plane" / "admin.kubeconfig"
        self.api_address = f"10.{200 + index}.0.2"
        """Where the cluster's API server listens: the first node's address."""
        self._bins: Binaries | None = None
        self._cp: ControlPlane | None = None

    @property
    def driver_root(self) -> Path:
        """The node's driver root as the host sees it (the node sees it at driver.NODE_DRIVER_ROOT)."""
        return self.state / "driver"

    @property
    def gpus_state(self) -> Path:
        """The fake driver's state file (`sharing sim ... --sim-state`)."""
        return self.driver_root / driver.STATE

    @property
    def state_file(self) -> Path:
        return self.state / "node.json"

    @property
    def address(self) -> str:
        return self.ns.address

    @property
    def bins(self) -> Binaries:
        if self._bins is None:
            self._bins = binaries(self.k8s_version)
        return self._bins

    @property
    def kubelet_bins(self) -> Binaries:
        """Where the node's kubelet comes from: its own release's binaries, else the cluster's."""
        return binaries(self.kubelet_version) if self.kubelet_version else self.bins

    # -- up ----------------------------------------------------------------------------------

    def up(self, images: Sequence[Path] = ()) -> RealNode:
        """Start the cluster's first node and import ``images`` (docker archives); return once the
        Node is Ready."""
        if self.member != 0:
            raise ClusterError("a further node joins the first one: first.join(...)")
        if self.state_file.exists():
            RealNode.load(self.name).down()
        self._fresh_state()
        packages.ensure()
        try:
            self._up(self.bins, images)
        except BaseException:
            self.down()
            raise
        return self

    def join(
        self,
        node_name: str,
        gpus: str = driver.GPUS,
        images: Sequence[Path] = (),
        *,
        kubelet: str | None = None,
    ) -> RealNode:
        """Start another node of this cluster (its containerd, kubelet and kube-proxy, its own GPUs)
        with ``images`` imported; return it once its Node is Ready. Called on the first node, the
        one that started the control plane (it holds the CA that signs the kubelet's identity).
        ``kubelet``: the node's kubelet from that Kubernetes release (``"1.34"``), as for ``RealNode``."""
        if self.member != 0 or self._cp is None:
            raise ClusterError("only the first node, as `up` returned it, can take another")
        member = len(self.members) + 1
        node = RealNode(
            self.name,
            node_name,
            index=self.index,
            member=member,
            gpus=gpus,
            k8s=self.k8s_version,
            kubelet=kubelet,
        )
        node._bins, node._cp = self._bins, self._cp
        if node.state_file.exists():
            RealNode.load_member(self.name, node.member).down()
        node._fresh_state()
        self.members.append(node)
        self._save()
        try:
            node._join(images)
        except BaseException:
            node.down()
            self.members.remove(node)
            self._save()
            raise
        return node

    def _fresh_state(self) -> None:
        shutil.rmtree(self.state, ignore_errors=True)
        (self.state / "logs").mkdir(parents=True)

    def _isolate(self) -> tuple[Path, ...]:
        """The node's cgroups, driver (its own GPUs) and namespaces; the daemons' cgroup.procs."""
        self.cgroup.create()
        procs = self.cgroup.daemon_procs()
        # A GPU node: the fake NVIDIA driver and its GPUs, under the node's driver root.
        driver.install(self.driver_root, self.gpus, seed=self.node_name)
        mounts = {
            "/var/lib/kubelet": self.state / "kubelet",
            "/var/log": self.state / "log",
            driver.NODE_DRIVER_ROOT: self.driver_root,
        }
        self.records.append(self.ns.start(procs, mounts))
        self._save()
        return procs

    def _runtime(self, images: Sequence[Path], procs: tuple[Path, ...]) -> None:
        """containerd, with ``images`` imported."""
        bins = self.bins
        runtime = containerd.process(bins, self.ns, self.state, procs)
        self._start(runtime, keep=True)
        containerd.wait_ready(runtime, self.ns, bins)
        runtime.forget()
        for archive in images:
            containerd.import_image(self.ns, bins, archive)

    def _join(self, images: Sequence[Path]) -> None:
        procs = self._isolate()
        self._runtime(images, procs)
        self._start_kubelet()
        proxy = self._control_plane().user_kubeconfig("system:kube-proxy")
        self._start(self._daemon("kube-proxy", components.proxy_args(self.bins, self.node_name, proxy)))
        self.wait_ready()

    def _up(self, bins: Binaries, images: Sequence[Path]) -> None:
        procs = self._isolate()
        net = NodeNetwork(self.ns.address, self.ns.launcher, procs)
        cp = self._cp = ControlPlane(
            base_dir=self.state / "control-plane", detached=True, keep=True, bins=bins, network=net
        )
        cp.start()
        self.records += cp.records()
        cp.forget()
        self._save()
        self._runtime(images, procs)
        self._start_kubelet()
        scheduler = cp.user_kubeconfig("system:kube-scheduler")
        manager = cp.user_kubeconfig("system:kube-controller-manager")
        proxy = cp.user_kubeconfig("system:kube-proxy")
        self._start(self._daemon("kube-scheduler", components.scheduler_args(bins, scheduler)))
        self._start(
            self._daemon("kube-controller-manager", components.controller_manager_args(bins, cp, manager))
        )
        self._start(self._daemon("kube-proxy", components.proxy_args(bins, self.node_name, proxy)))
        self.wait_ready()
        # Pods need their namespace's ServiceAccount, which the controller-manager creates.
        self._wait(
            "the default ServiceAccount",
            lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
        )

    def _exists(self, path: str) -> bool:
        """Whether the API server has the object (False while it answers 404 or not at all)."""
        try:
            self.api.request("GET", path)
        except (OSError, ApiError, http.client.HTTPException):
            return False
        return True

    def _daemon(self, name: str, args: list[str]) -> Process:
        return Process(
            name,
            args,
            self.state / "logs" / f"{name}.log",
            detached=True,
            launcher=self.ns.launcher,
            cgroup_procs=self.cgroup.daemon_procs(),
        )

    def _start(self, proc: Process, *, keep: bool = False) -> Process:
        proc.start()
        self.records.append(proc.record())
        self._save()
        if not keep:  # stopped through its record, like every daemon of a detached node
            proc.forget()
        return proc

    def _start_kubelet(self) -> None:
        cp = self._control_plane()
        kubeconfig = cp.user_kubeconfig(f"system:node:{self.node_name}", ["system:nodes"])
        config = components.kubelet_config(cp, self.cgroup.name, self.state, containerd.pod_cidr(self.member))
        args = components.kubelet_args(self.kubelet_bins, self.node_name, self.ns.address, config, kubeconfig)
        self._start(self._daemon("kubelet", args))

    def _control_plane(self) -> ControlPlane:
        if self._cp is None:  # loaded from the state file: only the paths are needed
            where = self.kubeconfig.parent
            self._cp = ControlPlane(base_dir=where, keep=True)
            self._cp.dir = where
            self._cp.ca_path = where / "ca.crt"
            self._cp.server = f"https://{self.api_address}:6443"
        return self._cp

    # -- while up ------------------------------------------------------------------------------

    @functools.cached_property
    def api(self) -> Api:
        """The API server as admin on a kept-alive connection: a read without a process."""
        return Api(f"https://{self.api_address}:6443", self.kubeconfig.parent)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = False, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl`` as admin, from the host."""
        return subprocess.run(
            [kubectl_path(), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True, text=True, input=input, check=check, timeout=timeout,
        )  # fmt: skip

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the Node reports Ready."""

        def ready() -> bool:
            try:
                node = self.api.request("GET", f"/api/v1/nodes/{self.node_name}")
            except (OSError, ApiError, http.client.HTTPException):  # not up yet, or no Node yet
                return False
            conditions = node["status"].get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        self._wait(f"node {self.node_name} Ready", ready, timeout)

    def _wait(self, what: str, check: Any, timeout: float = READY_TIMEOUT) -> None:
        """Poll ``check`` until true; fail early, with the kubelet's log, when the kubelet died."""
        record = next(r for r in self.records if r.name == "kubelet")
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        while not check():
            if not record.alive() or time.monotonic() > deadline:
                state = "exited" if not record.alive() else f"not reached within {timeout:.0f}s"
                log = self.state / "logs" / "kubelet.log"
                raise ClusterError(f"{what}: {state}\n--- last lines of {log} ---\n{tail(log)}")
            time.sleep(0.2)

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM) and start a new one on the same state; wait for Ready."""
        old = next(r for r in self.records if r.name == "kubelet")
        old.stop()
        self.records.remove(old)
        self._start_kubelet()
        # The Node still says Ready from before the restart: wait for the new kubelet's own server
        # (exec, logs) to answer too.
        self._wait("the kubelet's port 10250", lambda: _listening(self.ns.address, 10250))
        self.wait_ready()

    def import_image(self, archive: Path) -> None:
        containerd.import_image(self.ns, self.bins, archive)

    def logs(self) -> Path:
        return self.state / "logs"

    # -- down ----------------------------------------------------------------------------------

    def _save(self) -> None:
        data = {
            "name": self.name,
            "node": self.node_name,
            "index": self.index,
            "member": self.member,
            "gpus": self.gpus,
            "k8s": self.k8s_version,
            "kubelet": self.kubelet_version,
            "address": self.ns.address,
            "kubeconfig": str(self.kubeconfig),
            "pids": [r.to_json() for r in self.records],
            "members": [m.member for m in self.members],
        }
        self.state_file.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, name: str) -> RealNode:
        """The cluster ``name`` (its first node, with the nodes that joined in ``members``) as the
        state files record it (raises when there is none)."""
        node = cls._load(cache_dir() / "node" / name / "node.json")
        for member in node._recorded_members:
            with contextlib.suppress(FileNotFoundError):  # it had not started yet
                node.members.append(cls.load_member(name, member))
        return node

    @classmethod
    def load_member(cls, name: str, member: int) -> RealNode:
        """Node ``member`` of cluster ``name`` as its state file records it."""
        return cls._load(cache_dir() / "node" / f"{name}-n{member}" / "node.json")

    @classmethod
    def _load(cls, state: Path) -> RealNode:
        data = json.loads(state.read_text())
        node = cls(
            data["name"],
            data["node"],
            index=data["index"],
            member=data.get("member", 0),
            gpus=data.get("gpus", driver.GPUS),
            k8s=data.get("k8s"),
            kubelet=data.get("kubelet"),
        )
        node.records = [PidRecord.from_json(r) for r in data["pids"]]
        node._recorded_members = data.get("members", [])
        if node.records and node.records[0].name == "namespace-holder":
            node.ns.record = node.records[0]
        return node

    def running(self) -> bool:
        return any(r.alive() for r in self.records)

    def down(self) -> list[str]:
        """Stop everything (on the first node: every node of the cluster, the joined ones first),
        empty and remove the cgroups; return the names of what was running."""
        close_api(self)
        stopped = [name for m in reversed(self.members) for name in m.down()]
        self.members = []
        holder = [r for r in self.records if r.name == "namespace-holder"]
        daemons = [r for r in self.records if r.name != "namespace-holder"]
        # Nothing on the node is kept, so nothing needs a long graceful shutdown.
        stopped += stop_all(list(reversed(daemons)), timeout=0.5)
        stopped += stop_all(holder, timeout=0.5)
        # Shims and containers have no record: they are found by cgroup.
        self.cgroup.kill_all()
        self.ns.remove_host_interfaces()
        deadline = time.monotonic() + 10
        while (left := self.cgroup.remove()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            raise ClusterError(f"could not remove cgroups {', '.join(map(str, left))}")
        self.records = []
        self.state_file.unlink(missing_ok=True)
        # Keep the logs for a post-mortem (the daemons', the control plane's, the pods' /var/log);
        # the rest (etcd, kubelet, images) is rebuilt by `up`.
        keep = {self.state / "logs", self.state / "log", self.state / "control-plane"}
        for entry in self.state.iterdir() if self.state.exists() else ():
            if entry not in keep:
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        for entry in (self.state / "control-plane").glob("*"):
            if entry.name != "logs":
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        return stopped


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True
