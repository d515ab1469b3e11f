"""A real node's private namespaces: one sleeping process holds a mount and a network namespace.

Everything node-side (control plane, containerd, kubelet, pods) runs inside them, entered with
``nsenter``, so the host keeps its own ``/run``, ``/var/lib``, ``/var/log``, routes and iptables
rules. What the host sees while a cluster is up: one bridge (``gs<index>-<name>``) with the gateway
address, the cluster's network, and on it the host end of each node's veth pair
(``gs<index>-<member>-<name>``). The nodes of a cluster reach each other across the bridge (a
worker's kubelet the API server, the API server a kubelet's port), ``kubectl`` on the host reaches
the API server at the first node's address, and the host forwards nothing. The kernel removes a veth
with its namespace; the first node's ``down`` removes the bridge. Killing the holder (after every
process it hosts) takes the namespaces, their mounts and their rules with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lab.errors import ClusterError
from lab.process import PidRecord, Process

# The holder only waits; its argv names the node so `ps` says what it is.
_HOLDER = "import signal; signal.pause()"
INTERFACE = "node0"


class Namespaces:
    """The holder of node ``member`` of cluster ``name``; ``index`` picks the cluster's subnet
    ``10.(200+index).0.0/24``, where the node's address is ``.(2+member)``."""

    def __init__(self, name: str, state: Path, index: int = 0, member: int = 0) -> None:
        self.name = name
        self.state = state
        self.member = member
        self.gateway = f"10.{200 + index}.0.1"
        self.address = f"10.{200 + index}.0.{2 + member}"
        # Interface names have at most 15 bytes; the index (one subnet per cluster on the host)
        # keeps them apart, the cluster's name says whose they are.
        self.bridge = f"gs{index}-{name}"[:15]
        self.host_interface = f"gs{index}-{member}-{name}"[:15]
        self.record: PidRecord | None = None

    @property
    def launcher(self) -> tuple[str, ...]:
        """The prefix that runs a command inside the node (nsenter execs it: same PID)."""
        if self.record is None:
            raise ClusterError("the node's namespaces are not set up")
        return ("nsenter", f"--target={self.record.pid}", "--mount", "--net", "--")

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a short command inside the node; its output captured."""
        done = subprocess.run([*self.launcher, *args], capture_output=True, text=True, check=False)
        if check and done.returncode != 0:
            raise ClusterError(f"in node {self.name}: {' '.join(args)}: {done.stderr.strip()}")
        return done

    def start(self, cgroup_procs: tuple[Path, ...], mounts: dict[str, Path]) -> PidRecord:
        """Start the holder, wire its network, make its mounts; ``mounts`` maps node path -> state dir."""
        holder = Process(
            "namespace-holder",
            [sys.executable, "-c", _HOLDER, f"gpu-sharing-node:{self.name}"],
            self.state / "logs" / "holder.log",
            detached=True,
            launcher=("unshare", "--mount", "--net", "--propagation", "private", "--"),
            cgroup_procs=cgroup_procs,
        )
        holder.start()
        # Popen returns before unshare has made the namespaces: wiring the veth earlier would put
        # its node end into the host's network namespace.
        deadline = time.monotonic() + 10
        while _ns_inode(holder.pid, "net") in (None, _ns_inode(os.getpid(), "net")) or _ns_inode(
            holder.pid, "mnt"
        ) in (None, _ns_inode(os.getpid(), "mnt")):
            if not holder.running() or time.monotonic() > deadline:
                raise holder.fail("the namespace holder did not start")
            time.sleep(0.01)
        self.record = holder.record()
        holder.forget()
        self._network()
        self._mounts(mounts)
        return self.record

    def _network(self) -> None:
        assert self.record is not None
        host, bridge = self.host_interface, self.bridge
        commands = []
        if self.member == 0:  # the first node makes the cluster's network
            commands += [
                ["ip", "link", "add", bridge, "type", "bridge"],
                ["ip", "addr", "add", f"{self.gateway}/24", "dev", bridge],
                ["ip", "link", "set", bridge, "up"],
            ]
        peer = ["peer", "name", INTERFACE, "netns", str(self.record.pid)]
        commands += [
            ["ip", "link", "add", host, "type", "veth", *peer],
            ["ip", "link", "set", host, "master", bridge, "up"],
        ]
        for cmd in commands:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise ClusterError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        script = f"""set -e
ip link set lo up
ip addr add {self.address}/24 dev {INTERFACE}
ip link set {INTERFACE} up
ip route add default via {self.gateway}
# Per network namespace: pods' traffic is routed through the node, and only this node's.
echo 1 > /proc/sys/net/ipv4/ip_forward
"""
        self.run("sh", "-c", script)

    def _mounts(self, mounts: dict[str, Path]) -> None:
        # /run and /var/lib become private tmpfs (sockets, CNI and CDI state, the node's hostPaths);
        # the directories that should outlive a restart of a daemon are binds of the state dir.
        lines = [
            "set -e",
            "mount --make-rshared /",
            "mount -t tmpfs -o mode=0755 tmpfs /run",
            "mount -t tmpfs -o mode=0755 tmpfs /var/lib",
            # Where containerd looks for CDI specs and the agent writes them (a hostPath).
            "mkdir -p /run/cdi",
        ]
        for target, source in mounts.items():
            source.mkdir(parents=True, exist_ok=True)
            lines += [
                f"mkdir -p {target}",
                f"mount --bind {source} {target}",
                f"mount --make-rshared {target}",
            ]
        self.run("sh", "-c", "\n".join(lines))

    def remove_host_interfaces(self) -> None:
        """Delete the host end of the veth if it outlived the namespace (it should not) and, for the
        first node, the cluster's bridge."""
        for link in (self.host_interface, self.bridge) if self.member == 0 else (self.host_interface,):
            if Path(f"/sys/class/net/{link}").exists():
                subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None
