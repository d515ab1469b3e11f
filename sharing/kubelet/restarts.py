"""How the agent tells that the kubelet restarted: its device manager makes kubelet.sock anew at
every start (k8s.io/kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/server.go, Start removes
the directory's sockets and listens again), so the socket's identity changes.

A stat() needs no inotify instance (NVIDIA's plugin runs into "too many open files" there) and
cannot miss a restart that happened before the look began. Both front-ends use it: the device
plugins register again, the DRA pool waits for the new kubelet's registration.
"""

from __future__ import annotations

import os
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
