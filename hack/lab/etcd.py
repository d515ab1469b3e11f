"""etcd for the control plane: one member, data in the cluster's directory, no fsync (test data).

On 127.0.0.1 with free ports for the fast tests; inside a real node's network namespace on the
fixed ports, also listening on the node's address so its health can be checked from the host.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lab.binaries import Binaries
from lab.process import Process, free_port, wait_until

if TYPE_CHECKING:
    from lab.controlplane import NodeNetwork

START_TIMEOUT = 60.0


def start(
    make: Callable[[str, list[str]], Process], bins: Binaries, data: Path, net: NodeNetwork | None
) -> tuple[Process, str]:
    """Start etcd through ``make(name, args)``; return it, healthy, and its client URL."""
    if net:
        client, peer, listen = 2379, 2380, f"http://127.0.0.1:2379,http://{net.address}:2379"
        health = (net.address, client)
    else:
        client, peer = free_port(), free_port()
        listen, health = f"http://127.0.0.1:{client}", ("127.0.0.1", client)
    url = f"http://127.0.0.1:{client}"
    args = [
        str(bins.etcd),
        "--name=default",
        f"--data-dir={data}",
        f"--listen-client-urls={listen}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=default=http://127.0.0.1:{peer}",
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]
    proc = make("etcd", args)
    proc.start()

    def healthy() -> bool:
        conn = http.client.HTTPConnection(*health, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    wait_until(healthy, proc, "etcd /health", START_TIMEOUT)
    return proc, url
