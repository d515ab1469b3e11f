"""How the agent tells that the kubelet restarted: its device manager makes kubelet.sock anew at
every start (k8s.io/kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go, Start removes
the directory's sockets and listens again), so the socket's identity changes.

A stat() needs no inotify instance (NVIDIA's plugin runs into "too many open files" there) and
cannot miss a restart that happened before the look began. Both front-ends use it: the device
plugins register again, the DRA pool waits for the new kubelet's registration.

`listening` tells a socket that a killed process of ours left from one that another agent serves
(a rolling update's new pod starts beside the old one): only the first may be removed.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

SocketId = tuple[int, int, int]
"""(device, inode, ctime in ns since the epoch) of a socket file."""


def socket_identity(path: Path | str) -> SocketId | None:
    """The identity of the socket at `path`, None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def listening(path: Path | str) -> bool | None:
    """Whether a process listens on the unix socket at `path`: False when nothing does (refused, or no
    file), None when it cannot be told (the caller leaves the socket alone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return None
        return True
