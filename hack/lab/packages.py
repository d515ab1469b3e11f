"""Debian packages the real node and the image builds need, installed on first use.

Each package is named with a file it provides, so a machine that already has them pays nothing
(no apt run) and a fresh one gets them in one ``apt-get install`` (~15 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lab.errors import ClusterError

NEEDED = {
    "runc": "/usr/sbin/runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "iptables": "/usr/sbin/iptables",
    "conntrack": "/usr/sbin/conntrack",
    "busybox-static": "/bin/busybox",
    "umoci": "/usr/bin/umoci",
    "skopeo": "/usr/bin/skopeo",
    "mmdebstrap": "/usr/bin/mmdebstrap",
    "buildah": "/usr/bin/buildah",
}


def missing() -> list[str]:
    return [name for name, path in NEEDED.items() if not Path(path).exists()]


def ensure() -> None:
    """Install what is missing (needs root and the Debian mirror)."""
    wanted = missing()
    if not wanted:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"missing Debian packages {' '.join(wanted)}; install them as root")
    print(f"==> installing {' '.join(wanted)} (apt-get, once per machine)", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *wanted],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
