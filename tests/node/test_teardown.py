"""`down` leaves nothing on the host: no process, mount, cgroup, network interface or iptables rule.

A cluster of its own, two nodes (another name and subnet than the session's and the bench's),
compared before `up` and after `down`, in the host's namespaces. Only what names the cluster or its
subnet is compared: other nodes may come and go on the host meanwhile (the tests run on several
workers).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import lab
import pytest
from lab.cgroups import hierarchies

pytestmark = pytest.mark.node


NAME, INDEX = "teardown", 5
SUBNET = f"10.{200 + INDEX}.0."


def host_view() -> dict[str, set[str]]:
    """What this node could leave behind, as seen from the host: what names it or its subnet."""
    mounts = {" ".join(line.split()[3:5]) for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    cgroups = {str(d) for h in hierarchies(unified=True) for d in h.iterdir() if d.is_dir()}
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    view = {
        "mounts": mounts,
        "cgroups": cgroups,
        "links": {line.split(":")[1].strip().partition("@")[0] for line in links.splitlines()},
        # Counters and the timestamp comment change by themselves; rules do not.
        "iptables": {re.sub(r"\[\d+:\d+\]", "", r) for r in rules.splitlines() if not r.startswith("#")},
    }
    return {what: {e for e in entries if NAME in e or SUBNET in e} for what, entries in view.items()}


def namespaces(pid: int) -> tuple[str, str]:
    return os.readlink(f"/proc/{pid}/ns/net"), os.readlink(f"/proc/{pid}/ns/mnt")


def processes_in(ns: tuple[str, str]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if ns[0] in namespaces(int(entry.name)) or ns[1] in namespaces(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_down_leaves_nothing_on_the_host(cluster_binaries: lab.Binaries) -> None:
    if os.geteuid() != 0:
        pytest.skip("the real node needs root")
    before = host_view()
    node = lab.RealNode(NAME, "teardown-node", index=INDEX).up()
    held: list[int] = []
    try:
        joined = node.join("teardown-node-2", "A100-SXM4-80GB:1")
        holders = [next(r for r in n.records if r.name == "namespace-holder").pid for n in (node, joined)]
        spaces = [namespaces(pid) for pid in holders]
        # Held open so that the kernel cannot give their numbers to new namespaces once the nodes are
        # down: it reuses a freed one at once, and other workers make namespaces all the time (pods,
        # nodes), so a process of theirs looked like one left in ours (1 of 3 runs under load).
        held = [os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY) for pid in holders for kind in ("net", "mnt")]
        assert namespaces(os.getpid()) not in spaces
        assert spaces[0] != spaces[1]
        running = host_view()
        # The cluster's bridge and the host end of each node's veth.
        assert {"gs5-teardown", "gs5-0-teardown", "gs5-1-teardown"} == running["links"] - before["links"]
        assert before["mounts"] == running["mounts"]  # the nodes' mounts are in their own namespaces
        assert len(processes_in(spaces[0])) >= len(node.records)
        assert len(processes_in(spaces[1])) >= len(joined.records)
        records = node.records + joined.records
    finally:
        stopped = lab.RealNode.load(NAME).down()
    try:
        assert sorted(r.name for r in records) == sorted(stopped)
        assert not any(r.alive() for r in records)
        assert [] == [pid for ns in spaces for pid in processes_in(ns)]
    finally:
        for fd in held:
            os.close(fd)
    after = host_view()
    for what in before:
        assert before[what] == after[what], what
