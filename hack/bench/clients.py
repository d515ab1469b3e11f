"""The bench's clients: the API server as admin on a kept-alive connection, watches that stamp each
event with its arrival time, and the kubelet harness's control API on a kept-alive unix socket.

Plain http.client, no Kubernetes client library: a request costs the bench as little as possible,
and the times taken are when bytes arrived here, not when a library got round to them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lab.api

NAMESPACE = "gpu-sharing"
CONFIGMAP = "gpu-sharing-config"
CONFIG_LABEL = "nvidia.com/device-plugin.config"
SERVICE_ACCOUNT = "gpu-sharing"


class Api(lab.api.Api):
    """The lab's admin client (one kept-alive connection) with what the bench does through it."""

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> None:
        self.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": dict(labels)}})

    def put_config(self, key: str, text: str) -> None:
        path = f"/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIGMAP}"
        self.request("PATCH", path, {"data": {key: text}})

    def configmap_data(self) -> dict[str, str]:
        return dict(self.request("GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIGMAP}")["data"])

    def create(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self.request("POST", path, obj, merge=False))

    def agent_token(self, node: str, hours: int = 2) -> str:
        """The agent's token as its DaemonSet pod on `node` gets it: bound to a pod scheduled there,
        so it carries the node claim the own-node admission policy in deploy/ checks."""
        pod = self.create(
            f"/api/v1/namespaces/{NAMESPACE}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"agent-{node}", "namespace": NAMESPACE},
                "spec": {
                    "nodeName": node,
                    "serviceAccountName": SERVICE_ACCOUNT,
                    "containers": [{"name": "agent", "image": "gpu-sharing:placeholder"}],
                },
            },
        )
        ref = {
            "kind": "Pod",
            "apiVersion": "v1",
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
        }
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": hours * 3600, "boundObjectRef": ref},
        }
        path = f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{SERVICE_ACCOUNT}/token"
        return str(self.create(path, request)["status"]["token"])


def node_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the benches read of a Node: labels, annotations, allocatable."""
    meta = obj.get("metadata", {})
    return {
        "labels": meta.get("labels") or {},
        "annotations": meta.get("annotations") or {},
        "allocatable": obj.get("status", {}).get("allocatable") or {},
    }


def pod_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the benches read of a Pod: Running with every container ready."""
    status = obj.get("status", {})
    ready = all(c.get("ready") for c in status.get("containerStatuses") or [{}])
    return {"running": status.get("phase") == "Running" and ready}


class Watch:
    """Watches a collection from a thread; keeps (arrival time, name, view) of every event.

    `path` is a list path (`/api/v1/nodes`), `selector` an optional field selector.
    """

    def __init__(
        self, api: Api, path: str, view: Callable[[Mapping[str, Any]], dict[str, Any]], selector: str = ""
    ) -> None:
        self.api = api
        self.path = path
        self.view = view
        self.selector = selector
        self.history: list[tuple[float, str, str, dict[str, Any]]] = []
        """(arrival, event type, object name, view)."""
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self._conn: http.client.HTTPSConnection | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch{path}", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            if self._conn is not None and self._conn.sock is not None:
                self._conn.sock.shutdown(socket.SHUT_RDWR)

    def mark(self) -> int:
        with self.cond:
            return len(self.history)

    def latest(self, name: str) -> dict[str, Any] | None:
        with self.cond:
            return next((v for _, _, n, v in reversed(self.history) if n == name), None)

    def since(self, mark: int) -> Iterator[tuple[float, str, str, dict[str, Any]]]:
        """The events from index `mark` on (a snapshot)."""
        with self.cond:
            return iter(self.history[mark:])

    def wait(self, name: str, ok: Callable[[Mapping[str, Any]], bool], since: int, timeout: float) -> float:
        """Arrival time of the first event of `name` from index `since` whose view satisfies `ok`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            index = since
            while True:
                while index < len(self.history):
                    at, _, who, view = self.history[index]
                    if who == name and ok(view):
                        return at
                    index += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{name} not as expected within {timeout}s; last: {self.latest(name)}")
                self.cond.wait(min(left, 1.0))

    def _run(self) -> None:
        query = "watch=1&timeoutSeconds=3600"
        if self.selector:
            query += "&fieldSelector=" + urllib.parse.quote(self.selector)
        while not self._stop.is_set():
            try:
                self._conn = self.api.connect(timeout=None)
                self._conn.request("GET", f"{self.path}?{query}")
                resp = self._conn.getresponse()
                for line in iter(resp.readline, b""):
                    now = time.monotonic()
                    event = json.loads(line)
                    obj = event.get("object", {})
                    name = obj.get("metadata", {}).get("name", "")
                    entry = (now, event.get("type", ""), name, self.view(obj))
                    with self.cond:
                        self.history.append(entry)
                        self.cond.notify_all()
            except (OSError, http.client.HTTPException, ValueError):
                if self._stop.wait(0.2):
                    return
            finally:
                if self._conn is not None:
                    self._conn.close()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class Harness:
    """The harness control API on one kept-alive connection (admission latency without reconnects)."""

    def __init__(self, control_socket: Path) -> None:
        self.conn = _UnixConnection(control_socket, 60)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"harness {method} {path}: HTTP {resp.status}: {raw[:300]!r}")
        return json.loads(raw) if raw else None

    def admit(self, name: str, limits: Mapping[str, str]) -> float:
        """Admit a pod (Allocate through the device manager); milliseconds; the pod is deleted untimed."""
        body = {"namespace": "bench", "name": name, "containers": [{"name": "main", "limits": dict(limits)}]}
        start = time.perf_counter()
        pod = self.call("POST", "/pods", body)
        took = (time.perf_counter() - start) * 1e3
        self.call("DELETE", f"/pods/{urllib.parse.quote(pod['uid'], safe='')}")
        return took

    def close(self) -> None:
        self.conn.close()
