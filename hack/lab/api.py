"""The API server as admin on one kept-alive TLS connection: plain http.client, no Kubernetes client
library, so that a read costs the reader a few milliseconds (a `kubectl get` costs about 0.1 CPU-s:
a Go process, its kubeconfig and its discovery cache, every time)."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from pathlib import Path
from typing import Any


class ApiError(RuntimeError):
    """An answer other than 2xx: `status` is its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Api:
    """Admin requests to a kube-apiserver (`cert_dir` holds `ca.crt`, `admin.crt`, `admin.key`), one
    at a time: callers on several threads take turns."""

    def __init__(self, server: str, cert_dir: Path) -> None:
        url = urllib.parse.urlsplit(server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.context = ssl.create_default_context(cafile=str(cert_dir / "ca.crt"))
        self.context.load_cert_chain(cert_dir / "admin.crt", cert_dir / "admin.key")
        self._conn: http.client.HTTPSConnection | None = None
        self._lock = threading.Lock()

    def connect(self, timeout: float | None = 30) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, *, merge: bool = True) -> Any:
        """The JSON answer (text where it is not JSON: a pod's log); ApiError for any other status
        than 2xx. A connection the server closed (it restarted, or dropped an idle one) is opened
        again once."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/merge-patch+json" if merge else "application/json"}
        with self._lock:
            for attempt in (1, 2):
                if self._conn is None:
                    self._conn = self.connect()
                try:
                    self._conn.request(method, path, body=data, headers=headers)
                    resp = self._conn.getresponse()
                    raw = resp.read()
                except (OSError, http.client.HTTPException):
                    self._conn.close()
                    self._conn = None
                    if attempt == 2:
                        raise
                    continue
                if resp.status >= 300:
                    raise ApiError(f"{method} {path}: HTTP {resp.status}: {raw[:300]!r}", resp.status)
                if resp.getheader("Content-Type", "").startswith("application/json"):
                    return json.loads(raw)
                return raw.decode(errors="replace")  # a pod's log, a proxied page
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __del__(self) -> None:
        # An owner dropped without `close` (a node object that another, `RealNode.load`, stopped)
        # takes its connection with it.
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()


def close_api(owner: object) -> None:
    """Close the connection of an owner's `api` (a cached property: a control plane's, a node's) if
    it made one; the next use makes a new one."""
    api = vars(owner).pop("api", None)
    if api is not None:
        api.close()
