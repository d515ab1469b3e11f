"""Where things live: the repository, the cache outside it, and the host tools the lab calls.

Everything the lab builds or starts keeps its state under the cache (``SHARING_CACHE``, default
``~/.cache/gpu-sharing``), never in the repository, so a fresh clone reuses a warm machine.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack" / "build-go.sh"


def kubectl_path() -> str:
    """The kubectl the lab runs: built at the lab's Kubernetes release (hack/go/kubectl), or
    ``SHARING_KUBECTL``. Not the machine's own: kubectl is supported one minor either way of its API
    server, and an older one's exec over WebSocket loses a fast command's output under load (client-go
    tools/remotecommand/websocket.go started reading before the streams were made; v0.37.2 waits)."""
    from lab.binaries import binaries  # noqa: PLC0415  (binaries imports this module)

    return str(binaries().kubectl)


def cache_dir() -> Path:
    """The cache root, read at call time so tests can point ``SHARING_CACHE`` elsewhere."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("SHARING_CACHE") or xdg / "gpu-sharing")
