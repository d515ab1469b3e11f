"""The kubelet harness: the kubelet's own device manager without the rest of the kubelet.

``hack/go/k8s/kubelet-harness`` runs the real device-manager code (registration, ListAndWatch,
Allocate, checkpoint, PodResources) in a private mount namespace and copies capacity into the Node
like the kubelet does. Tests drive it through a small HTTP+JSON API on a unix socket; this module is
that API's client, the process wrapper, and the Go stub plugin used as a peer in its own tests.
It is the fast path: no container runtime, no pods, seconds to start.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lab.binaries import binaries
from lab.deadlines import scaled
from lab.errors import AdmissionError, ClusterError
from lab.process import Process, wait_until


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


Containers = Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]


def _containers(containers: Containers) -> list[dict[str, Any]]:
    """Accept ``[{"name": "c", "limits": {"r": 1}}]`` or ``{"c": {"r": 1}}``; quantities as str."""
    items: list[dict[str, Any]]
    if isinstance(containers, Mapping):
        items = [{"name": n, "limits": dict(lim)} for n, lim in containers.items()]
    else:
        items = [dict(c) for c in containers]
    for c in items:
        c["limits"] = {k: str(v) for k, v in dict(c.get("limits") or {}).items()}
    return items


class HarnessClient:
    """Client of the kubelet harness control API (HTTP+JSON on a unix socket)."""

    def __init__(self, control_socket: str | os.PathLike[str]) -> None:
        self.control_socket = Path(control_socket)

    def _request(self, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
        conn = _UnixHTTPConnection(str(self.control_socket), timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
        finally:
            conn.close()

    def _ok(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        status, reply = self._request(method, path, body, timeout)
        if status != 200:
            raise ClusterError(f"harness {method} {path}: HTTP {status}: {reply}")
        return reply

    def healthy(self) -> bool:
        try:
            return self._request("GET", "/healthz", timeout=2)[0] == 200
        except OSError:
            return False

    def resources(self) -> dict[str, Any]:
        """``{"resources": {name: {"capacity", "allocatable", "healthy", "removed"?}}, "generation": g}``."""
        return dict(self._ok("GET", "/resources"))

    def wait_resources(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30
    ) -> dict[str, Any]:
        """Wait until ``predicate(reply["resources"])`` is true; return the whole reply.

        Uses the harness's long-poll (``?after=<generation>``), so it wakes on each change.
        ``timeout`` is for an idle machine (`lab.deadlines`).
        """
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        reply = self.resources()
        while not predicate(reply["resources"]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"resources did not match within {timeout}s; last: {reply}")
            wait = min(left, 10.0)
            reply = dict(
                self._ok(
                    "GET", f"/resources?after={reply['generation']}&timeout={wait:.3f}s", timeout=wait + 10
                )
            )
        return reply

    def admit(
        self,
        name: str,
        containers: Containers,
        *,
        namespace: str = "default",
        init_containers: Containers = (),
        uid: str | None = None,
    ) -> dict[str, Any]:
        """Admit a pod like the kubelet (Allocate per container, then run options).

        Returns ``{"uid", "containers": [{"name", "devices": {res: [ids]}, "envs", "annotations",
        "cdiDevices", "mounts", "deviceNodes"}]}``; raises ``AdmissionError`` on HTTP 409.
        """
        body: dict[str, Any] = {"namespace": namespace, "name": name, "containers": _containers(containers)}
        if init_containers:
            body["initContainers"] = _containers(init_containers)
        if uid:
            body["uid"] = uid
        status, reply = self._request("POST", "/pods", body, timeout=scaled(120))
        if status == 409:
            raise AdmissionError(reply.get("error", ""), reply.get("reason", ""), reply.get("stage", ""))
        if status != 200:
            raise ClusterError(f"harness POST /pods: HTTP {status}: {reply}")
        return dict(reply)

    def pods(self) -> list[dict[str, Any]]:
        return list(self._ok("GET", "/pods")["pods"])

    def delete_pod(self, uid_or_name: str, namespace: str = "default") -> None:
        """Make a pod inactive, by UID or by name (in ``namespace``)."""
        for pod in self.pods():
            if pod["uid"] == uid_or_name:
                self._ok("DELETE", f"/pods/{urllib.parse.quote(uid_or_name, safe='')}")
                return
        q = urllib.parse.quote
        self._ok("DELETE", f"/pods/{q(namespace, safe='')}/{q(uid_or_name, safe='')}")

    def restart(self, *, learn_later: bool = False) -> None:
        """Simulated kubelet restart: a new device manager reads the checkpoint, deletes the plugin
        sockets and re-creates kubelet.sock; plugins must register again. Pods are kept.

        With ``learn_later``, PodResources ``List`` names none of the earlier pods until ``learn()``
        (pods admitted since are named), as a starting kubelet's is short until its sync loop has
        received its pods from the API server."""
        self._ok("POST", "/restart?learn=later" if learn_later else "/restart", timeout=scaled(60))

    def learn(self) -> None:
        """The restarted kubelet has learned its pods: PodResources lists them again."""
        self._ok("POST", "/learn")


class KubeletHarness(HarnessClient):
    """The kubelet harness process (needs root).

    ``device_plugin_dir`` is where plugins put their sockets and where ``kubelet.sock`` (and the
    checkpoint) appear. With ``kubeconfig`` and ``node_name``, the Node is registered and its
    status capacity/allocatable follow the device manager.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        node_name: str | None = None,
        node_status_interval: str = "500ms",
        extra_args: Sequence[str] = (),
        keep: bool | None = None,
        detached: bool = False,
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        self._root_arg = Path(root) if root is not None else None
        self.kubeconfig = Path(kubeconfig) if kubeconfig is not None else None
        self.node_name = node_name
        self._interval = node_status_interval
        self._extra = list(extra_args)
        self._keep = keep if keep is not None else bool(os.environ.get("SHARING_KEEP_CLUSTER"))
        self._detached = detached
        self._binary = Path(binary) if binary is not None else None
        self.root = Path()
        self.device_plugin_dir = Path()
        self.pod_resources_socket = Path()
        self.log = Path()
        self._proc: Process | None = None
        self._owns_root = False
        super().__init__(Path())

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / "kubelet.sock"

    @property
    def checkpoint(self) -> Path:
        return self.device_plugin_dir / "kubelet_internal_checkpoint"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.running() else None

    def __enter__(self) -> KubeletHarness:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> KubeletHarness:
        if os.geteuid() != 0:
            raise ClusterError(
                "the kubelet harness needs root (private mount namespace over /var/lib/kubelet)"
            )
        binary = self._binary or binaries().kubelet_harness
        if self._root_arg is None:
            self.root = Path(tempfile.mkdtemp(prefix="sharing-kubelet-"))
            self._owns_root = True
        else:
            self.root = self._root_arg.resolve()
            self.root.mkdir(parents=True, exist_ok=True)
        self.device_plugin_dir = self.root / "device-plugins"
        self.device_plugin_dir.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket = self.root / "pod-resources" / "kubelet.sock"
        self.control_socket = self.root / "harness.sock"
        self.log = self.root / "kubelet-harness.log"
        args = [
            str(binary),
            f"--root={self.root}",
            f"--control={self.control_socket}",
            f"--pod-resources-socket={self.pod_resources_socket}",
            f"--node-status-interval={self._interval}",
        ]
        if self.node_name:
            if self.kubeconfig is None:
                raise ClusterError("node_name needs a kubeconfig")
            args += [f"--kubeconfig={self.kubeconfig}", f"--node-name={self.node_name}"]
        args += self._extra
        self._proc = Process("kubelet-harness", args, self.log, detached=self._detached)
        try:
            self._proc.start()
            wait_until(self.healthy, self._proc, "kubelet-harness /healthz", 30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        if self._owns_root and not self._keep and self.root != Path():
            shutil.rmtree(self.root, ignore_errors=True)
            self._owns_root = False

    def restart_process(self) -> None:
        """Kill and start the harness process again on the same root (a kubelet crash/restart as a
        process, rather than ``restart()``'s in-process simulation). Active pods are lost."""
        if self._proc is None:
            raise ClusterError("harness not started")
        self._proc.stop()
        self._proc.start()
        wait_until(self.healthy, self._proc, "kubelet-harness /healthz", 30)

    def state(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "device_plugin_dir": str(self.device_plugin_dir),
            "kubelet_socket": str(self.kubelet_socket),
            "pod_resources_socket": str(self.pod_resources_socket),
            "control_socket": str(self.control_socket),
            "node_name": self.node_name,
            "pid": self.pid,
            "log": str(self.log),
        }
