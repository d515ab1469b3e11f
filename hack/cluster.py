"""A local Kubernetes control plane and kubelet harness for tests and demos.

Real ``etcd`` + ``kube-apiserver`` (built from Go modules by ``hack/build-go.sh``, cached outside
the repository, envtest style) and the kubelet harness (``hack/go/k8s/kubelet-harness``: the
kubelet's own device manager, PodResources server and Node status sync, in a private mount
namespace).

Library use (tests add ``hack/`` to ``sys.path``)::

    from cluster import ControlPlane, KubeletHarness

    with ControlPlane() as cp, KubeletHarness(kubeconfig=cp.kubeconfig, node_name="n1") as kubelet:
        cp.kubectl("get", "nodes")
        kubelet.wait_resources(lambda r: r.get("nvidia.com/gpu", {}).get("allocatable") == 2)
        kubelet.admit("p1", [{"name": "c", "limits": {"nvidia.com/gpu": 1}}])

Command line (for demos)::

    python hack/cluster.py up --state-dir DIR [--node NAME]   # detached; writes DIR/cluster.json
    python hack/cluster.py down --state-dir DIR

Only the standard library and ``cryptography`` are used. The harness needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "hack" / "build-go.sh"
KUBECTL = os.environ.get("SHARING_KUBECTL", "/usr/bin/kubectl")

START_TIMEOUT = float(os.environ.get("SHARING_CONTROLPLANE_START_TIMEOUT", "60"))
STOP_TIMEOUT = 20.0
LOG_TAIL_LINES = 30

__all__ = [
    "AdmissionError",
    "Binaries",
    "BinariesUnavailable",
    "ClusterError",
    "ControlPlane",
    "HarnessClient",
    "KubeletHarness",
    "StubDevicePlugin",
    "binaries",
]


class ClusterError(RuntimeError):
    """A component failed to build, start or answer."""


class BinariesUnavailable(ClusterError):
    """The Go binaries cannot be built here (no Go toolchain) and no overrides are set."""


class AdmissionError(ClusterError):
    """The kubelet harness rejected a pod (HTTP 409); ``error`` is the kubelet's message."""

    def __init__(self, error: str, reason: str, stage: str) -> None:
        super().__init__(f"{reason}: {error}")
        self.error = error
        self.reason = reason
        self.stage = stage


# --------------------------------------------------------------------------------------------
# binaries


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    etcd: Path
    kubelet_harness: Path
    stub_device_plugin: Path  # a minimal Go device plugin, a test peer for the harness


_ENV_OVERRIDES = {
    "kube_apiserver": "SHARING_KUBE_APISERVER",
    "etcd": "SHARING_ETCD",
    "kubelet_harness": "SHARING_KUBELET_HARNESS",
    "stub_device_plugin": "SHARING_STUB_DEVICE_PLUGIN",
}
_BIN_NAMES = {
    "kube_apiserver": "kube-apiserver",
    "etcd": "etcd",
    "kubelet_harness": "kubelet-harness",
    "stub_device_plugin": "stub-device-plugin",
}
_binaries_cache: Binaries | None = None


def binaries() -> Binaries:
    """Paths of kube-apiserver, etcd, kubelet-harness and stub-device-plugin.

    ``SHARING_KUBE_APISERVER``, ``SHARING_ETCD``, ``SHARING_KUBELET_HARNESS`` and
    ``SHARING_STUB_DEVICE_PLUGIN`` win when set;
    anything not overridden comes from ``hack/build-go.sh`` (which builds what is missing, once
    per machine: the first kube-apiserver build takes ~10 minutes). Raises
    ``BinariesUnavailable`` when Go is missing, ``ClusterError`` when a build fails.
    """
    global _binaries_cache  # noqa: PLW0603 - one build per process
    if _binaries_cache is not None:
        return _binaries_cache
    paths: dict[str, Path] = {}
    for field, env in _ENV_OVERRIDES.items():
        if os.environ.get(env):
            p = Path(os.environ[env])
            if not os.access(p, os.X_OK):
                raise ClusterError(f"{env}={p} is not an executable file")
            paths[field] = p
    missing = [f for f in _ENV_OVERRIDES if f not in paths]
    if missing:
        if shutil.which("go") is None:
            names = ", ".join(_ENV_OVERRIDES[f] for f in missing)
            raise BinariesUnavailable(
                f"Go is not installed, so hack/build-go.sh cannot build them; set {names}"
            )
        # stderr (progress lines) goes straight to the caller's terminal / pytest's capture.
        proc = subprocess.run([str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False, cwd=REPO)
        if proc.returncode != 0:
            raise ClusterError(
                f"hack/build-go.sh failed with exit code {proc.returncode} (its output is above)"
            )
        bin_dir = Path(proc.stdout.strip().splitlines()[-1])
        for f in missing:
            paths[f] = bin_dir / _BIN_NAMES[f]
    _binaries_cache = Binaries(**paths)
    return _binaries_cache


# --------------------------------------------------------------------------------------------
# processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # If the test process dies (even by SIGKILL), its servers get SIGTERM instead of lingering.
    # The kernel sends it when the *thread* that forked exits, so _Process only asks for it when
    # started from the main thread (a worker thread, e.g. asyncio.to_thread, may exit early).
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(cannot read {path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


class _Process:
    """A server process with its output in a log file."""

    def __init__(self, name: str, args: Sequence[str], log: Path, *, detached: bool = False) -> None:
        self.name = name
        self.args = list(args)
        self.log = log
        self.detached = detached
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        on_main_thread = threading.current_thread() is threading.main_thread()
        with open(self.log, "ab") as out:
            out.write(f"\n==== {time.strftime('%H:%M:%S')} starting {' '.join(self.args)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Detached (CLI "up"): own session, outlives us. Otherwise: dies with us.
                start_new_session=self.detached,
                preexec_fn=None if self.detached or not on_main_thread else _die_with_parent,  # noqa: PLW1509
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def fail(self, what: str) -> ClusterError:
        status = ""
        if self.proc is not None and self.proc.poll() is not None:
            status = f" ({self.name} exited with code {self.proc.returncode})"
        return ClusterError(
            f"{what}{status}\n--- last {LOG_TAIL_LINES} lines of {self.log} ---\n{_tail(self.log)}"
        )

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _wait_until(
    check: Callable[[], bool], proc: _Process, what: str, timeout: float, deadline: float | None = None
) -> None:
    """Poll ``check`` with backoff until it is true; fail early if ``proc`` exits."""
    end = deadline if deadline is not None else time.monotonic() + timeout
    delay = 0.05
    while True:
        if not proc.running():
            raise proc.fail(f"{proc.name} exited while waiting for {what}")
        with contextlib.suppress(OSError, http.client.HTTPException, ssl.SSLError):
            if check():
                return
        if time.monotonic() >= end:
            raise proc.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


# --------------------------------------------------------------------------------------------
# certificates


class _CA:
    """A tiny CA (ECDSA P-256, like envtest's TinyCA) that writes PEM files."""

    def __init__(self, cn: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, cn: str, *, orgs: Iterable[str] = (), server: bool = False, hosts: Iterable[str] = ()
    ) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        sans: list[x509.GeneralName] = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, b.sign(self.key, hashes.SHA256())


def _pem_cert(cert: Any) -> bytes:
    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _pem_key(key: Any) -> bytes:
    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


# --------------------------------------------------------------------------------------------
# control plane


class ControlPlane:
    """etcd + kube-apiserver on 127.0.0.1 (free random ports), RBAC on, TokenRequest working.

    ``kubeconfig`` is an admin kubeconfig (client cert CN=admin, O=system:masters), ``server``
    the API URL, ``ca_path`` the CA that signed the serving cert. All state (certs, etcd data,
    logs in ``<dir>/logs``) lives in one directory, a temp dir unless ``base_dir`` is given.
    ``extra_apiserver_args`` are appended (a repeated flag overrides the default), e.g.
    ``["--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction"]``.
    """

    def __init__(
        self,
        *,
        base_dir: str | os.PathLike[str] | None = None,
        extra_apiserver_args: Sequence[str] = (),
        keep: bool | None = None,
        detached: bool = False,
        bins: Binaries | None = None,
    ) -> None:
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self._extra = list(extra_apiserver_args)
        self._keep = keep if keep is not None else bool(os.environ.get("SHARING_KEEP_CLUSTER"))
        self._detached = detached
        self._bins = bins
        self.dir: Path = Path()
        self.kubeconfig: Path = Path()
        self.server = ""
        self.ca_path: Path = Path()
        self.etcd_url = ""
        self.start_seconds = 0.0
        self._etcd: _Process | None = None
        self._apiserver: _Process | None = None
        self._ca: _CA | None = None
        self._owns_dir = False

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        bins = self._bins or binaries()
        t0 = time.monotonic()
        if self._base_dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="sharing-cp-"))
            self._owns_dir = True
        else:
            self.dir = self._base_dir.resolve()
            self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._write_certs()
            self._start_etcd(bins)
            port = _free_port()
            self.server = f"https://127.0.0.1:{port}"
            self._apiserver = _Process(
                "kube-apiserver",
                self._apiserver_args(bins, port),
                self.dir / "logs" / "kube-apiserver.log",
                detached=self._detached,
            )
            self._apiserver.start()
            self._wait_apiserver_ready()
            self._write_kubeconfig(self.kubeconfig, cert=self.dir / "admin.crt", key=self.dir / "admin.key")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Stop kube-apiserver, then etcd; remove the temp dir (unless keep/SHARING_KEEP_CLUSTER)."""
        for p in (self._apiserver, self._etcd):
            if p is not None:
                p.stop()
        self._apiserver = self._etcd = None
        if self._owns_dir and not self._keep and self.dir != Path():
            shutil.rmtree(self.dir, ignore_errors=True)
            self._owns_dir = False

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port and etcd data; wait until ready."""
        if self._apiserver is None:
            raise ClusterError("control plane not started")
        self._apiserver.stop()
        self._apiserver.start()
        self._wait_apiserver_ready()

    @property
    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in (self._etcd, self._apiserver) if p is not None and p.running()}

    @property
    def logs(self) -> dict[str, Path]:
        return {p.name: p.log for p in (self._etcd, self._apiserver) if p is not None}

    # -- pieces -----------------------------------------------------------------------------

    def _write_certs(self) -> None:
        d = self.dir
        ca = _CA("gpu-sharing-test-ca")
        self._ca = ca
        self.ca_path = d / "ca.crt"
        self.ca_path.write_bytes(_pem_cert(ca.cert))
        key, cert = ca.issue("localhost", server=True, hosts=["127.0.0.1", "localhost"])
        (d / "apiserver.crt").write_bytes(_pem_cert(cert))
        _write_private(d / "apiserver.key", _pem_key(key))
        key, cert = ca.issue("admin", orgs=["system:masters"])
        (d / "admin.crt").write_bytes(_pem_cert(cert))
        _write_private(d / "admin.key", _pem_key(key))
        # Service-account signing pair: tokens from TokenRequest are signed with the private key,
        # verified with the public one.
        sa = ec.generate_private_key(ec.SECP256R1())
        _write_private(d / "sa.key", _pem_key(sa))
        (d / "sa.pub").write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        self.kubeconfig = d / "admin.kubeconfig"

    def _start_etcd(self, bins: Binaries) -> None:
        client, peer = _free_port(), _free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        args = [
            str(bins.etcd),
            "--name=default",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]
        self._etcd = _Process("etcd", args, self.dir / "logs" / "etcd.log", detached=self._detached)
        self._etcd.start()

        def healthy() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", client, timeout=2)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            finally:
                conn.close()

        _wait_until(healthy, self._etcd, "etcd /health", START_TIMEOUT)

    def _apiserver_args(self, bins: Binaries, port: int) -> list[str]:
        d = self.dir
        return [
            str(bins.kube_apiserver),
            f"--etcd-servers={self.etcd_url}",
            f"--cert-dir={d}",
            f"--tls-cert-file={d / 'apiserver.crt'}",
            f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={self.ca_path}",
            f"--secure-port={port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--authorization-mode=RBAC",
            "--disable-admission-plugins=ServiceAccount",
            "--endpoint-reconciler-type=none",
            f"--service-account-issuer={self.server}",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            f"--api-audiences={self.server}",
            *self._extra,
        ]

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        ctx.load_cert_chain(self.dir / "admin.crt", self.dir / "admin.key")
        return ctx

    def _get(self, path: str) -> int:
        u = urllib.parse.urlsplit(self.server)
        conn = http.client.HTTPSConnection(u.hostname or "", u.port, context=self._ssl_context(), timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def _wait_apiserver_ready(self) -> None:
        assert self._apiserver is not None
        deadline = time.monotonic() + START_TIMEOUT
        # /readyz includes the RBAC bootstrap post-start hooks.
        _wait_until(
            lambda: self._get("/readyz") == 200,
            self._apiserver,
            "kube-apiserver /readyz",
            START_TIMEOUT,
            deadline,
        )
        _wait_until(
            lambda: self._get("/api/v1/namespaces/default") == 200,
            self._apiserver,
            "the default namespace",
            START_TIMEOUT,
            deadline,
        )

    # -- clients ----------------------------------------------------------------------------

    def _write_kubeconfig(
        self,
        path: Path,
        *,
        cert: Path | None = None,
        key: Path | None = None,
        token: str | None = None,
        user: str = "admin",
    ) -> Path:
        user_entry: dict[str, Any] = {}
        if cert is not None and key is not None:
            user_entry = {"client-certificate": str(cert), "client-key": str(key)}
        if token is not None:
            user_entry = {"token": token}
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "sharing",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_path)},
                }
            ],
            "users": [{"name": user, "user": user_entry}],
            "contexts": [{"name": "sharing", "context": {"cluster": "sharing", "user": user}}],
            "current-context": "sharing",
        }
        # JSON is valid YAML; kubectl and the kubernetes Python client read it.
        path.write_text(json.dumps(cfg, indent=2))
        path.chmod(0o600)
        return path

    def user_kubeconfig(self, name: str, groups: Iterable[str] = ()) -> Path:
        """A kubeconfig authenticating as ``name`` (client cert, O=groups), e.g. a node identity:
        ``user_kubeconfig("system:node:n1", ["system:nodes"])``."""
        if self._ca is None:
            raise ClusterError("control plane not started")
        safe = "".join(c if c.isalnum() else "_" for c in name)
        key, cert = self._ca.issue(name, orgs=list(groups))
        (self.dir / f"user-{safe}.crt").write_bytes(_pem_cert(cert))
        _write_private(self.dir / f"user-{safe}.key", _pem_key(key))
        return self._write_kubeconfig(
            self.dir / f"user-{safe}.kubeconfig",
            cert=self.dir / f"user-{safe}.crt",
            key=self.dir / f"user-{safe}.key",
            user=name,
        )

    def token_kubeconfig(self, token: str, name: str = "token") -> Path:
        """A kubeconfig that authenticates with a bearer token (e.g. from TokenRequest)."""
        safe = "".join(c if c.isalnum() else "_" for c in name)
        return self._write_kubeconfig(self.dir / f"token-{safe}.kubeconfig", token=token, user=name)

    def kubectl(
        self,
        *args: str,
        kubeconfig: str | os.PathLike[str] | None = None,
        input: str | None = None,
        check: bool = False,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl --kubeconfig <admin or given> args...``; text output captured."""
        return subprocess.run(
            [KUBECTL, f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            check=check,
            timeout=timeout,
        )

    def state(self) -> dict[str, Any]:
        return {
            "dir": str(self.dir),
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "ca_path": str(self.ca_path),
            "etcd_url": self.etcd_url,
            "pids": self.pids,
            "logs": {k: str(v) for k, v in self.logs.items()},
        }


# --------------------------------------------------------------------------------------------
# kubelet harness


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
        """
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
        status, reply = self._request("POST", "/pods", body, timeout=120)
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

    def restart(self) -> None:
        """Simulated kubelet restart: a new device manager reads the checkpoint, deletes the plugin
        sockets and re-creates kubelet.sock; plugins must register again. Pods are kept."""
        self._ok("POST", "/restart", timeout=60)


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
        self._proc: _Process | None = None
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
        self._proc = _Process("kubelet-harness", args, self.log, detached=self._detached)
        try:
            self._proc.start()
            _wait_until(self.healthy, self._proc, "kubelet-harness /healthz", 30)
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
        _wait_until(self.healthy, self._proc, "kubelet-harness /healthz", 30)

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


class StubDevicePlugin:
    """The Go stub device plugin (``hack/go/k8s/stubplugin``) as a context manager.

    Registers ``resource`` with the kubelet (harness) whose ``kubelet.sock`` is in ``plugin_dir``,
    re-registers when kubelet.sock is re-created, and advertises ``devices`` (``"ID"`` or
    ``"ID Unhealthy"``). ``set_devices`` changes them (sent on ListAndWatch). Allocate returns env
    ``STUB_VISIBLE_DEVICES``; with ``preferred`` it offers GetPreferredAllocation and prefers the
    highest IDs.
    """

    def __init__(
        self,
        plugin_dir: str | os.PathLike[str],
        resource: str = "example.com/dev",
        devices: Iterable[str] = ("Dev-1", "Dev-2"),
        *,
        preferred: bool = False,
        prestart: bool = False,
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.resource = resource
        self._devices = list(devices)
        self._preferred = preferred
        self._prestart = prestart
        self._binary = Path(binary) if binary is not None else None
        self._dir: Path | None = None
        self._proc: _Process | None = None
        self.log = Path()

    @property
    def devices_file(self) -> Path:
        assert self._dir is not None
        return self._dir / "devices"

    def set_devices(self, devices: Iterable[str]) -> None:
        """Replace the device list; the plugin notices within ~100 ms and sends it on ListAndWatch."""
        self._devices = list(devices)
        tmp = self.devices_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{d}\n" for d in self._devices) or "# none\n")
        tmp.replace(self.devices_file)

    def start(self) -> StubDevicePlugin:
        binary = self._binary or binaries().stub_device_plugin
        self._dir = Path(tempfile.mkdtemp(prefix="sharing-stubplugin-"))
        self.set_devices(self._devices)
        self.log = self._dir / "stub-device-plugin.log"
        args = [
            str(binary),
            f"--plugin-dir={self.plugin_dir}",
            f"--resource={self.resource}",
            "--devices=",
            f"--devices-file={self.devices_file}",
            f"--preferred={str(self._preferred).lower()}",
            f"--prestart={str(self._prestart).lower()}",
        ]
        self._proc = _Process("stub-device-plugin", args, self.log)
        self._proc.start()
        return self

    def stop(self) -> None:
        """Stop the plugin (its ListAndWatch stream ends, so the kubelet marks the devices unhealthy)."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> StubDevicePlugin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# CLI


def _pid_alive(pid: int, expect: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    # Guard against PID reuse: the process must still be the binary we started (argv[0] or, for
    # the harness after its re-exec through unshare, any argument).
    return any(expect.encode() in part for part in cmdline if part)


def _cmd_up(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir).resolve()
    state_file = state_dir / "cluster.json"
    if state_file.exists():
        old = json.loads(state_file.read_text())
        if any(_pid_alive(pid, name) for name, pid in old.get("pids", {}).items()):
            print(f"a cluster is already running from {state_file}; run 'down' first", file=sys.stderr)
            return 1
    state_dir.mkdir(parents=True, exist_ok=True)
    cp = ControlPlane(base_dir=state_dir / "control-plane", detached=True, keep=True)
    cp.start()
    kubelet: KubeletHarness | None = None
    try:
        kubelet = KubeletHarness(
            state_dir / "kubelet", kubeconfig=cp.kubeconfig, node_name=args.node, detached=True, keep=True
        )
        kubelet.start()
        if args.node:  # wait until the Node exists, so the caller can label it right away
            deadline = time.monotonic() + 30
            while cp.kubectl("get", "node", args.node).returncode != 0:
                if time.monotonic() > deadline:
                    raise ClusterError(f"node {args.node} was not registered; see {kubelet.log}")
                time.sleep(0.2)
    except BaseException:
        if kubelet is not None:
            kubelet.stop()
        cp.stop()
        raise
    state = {
        **cp.state(),
        "kubelet": kubelet.state(),
        "pids": {**cp.pids, "kubelet-harness": kubelet.pid},
        "node": args.node,
        "state_dir": str(state_dir),
        "start_seconds": round(cp.start_seconds, 2),
    }
    state_file.write_text(json.dumps(state, indent=2) + "\n")
    print(json.dumps(state, indent=2))
    # Leave the servers running: forget the handles without stopping them.
    cp._apiserver = cp._etcd = None
    kubelet._proc = None
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    state_file = Path(args.state_dir).resolve() / "cluster.json"
    if not state_file.exists():
        print(f"no {state_file}; nothing to stop", file=sys.stderr)
        return 0
    state = json.loads(state_file.read_text())
    # Stop in reverse order of start: harness, apiserver, etcd.
    for name in ("kubelet-harness", "kube-apiserver", "etcd"):
        pid = state.get("pids", {}).get(name)
        if not pid or not _pid_alive(pid, name):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _pid_alive(pid, name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(pid, name):
            os.kill(pid, signal.SIGKILL)
        print(f"stopped {name} (pid {pid})", file=sys.stderr)
    state["pids"] = {}
    state_file.write_text(json.dumps(state, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start etcd, kube-apiserver and the kubelet harness, detached")
    up.add_argument("--state-dir", required=True, help="where state, logs and cluster.json go")
    up.add_argument("--node", default=None, help="Node name the harness registers and keeps in sync")
    down = sub.add_parser("down", help="stop what 'up' started")
    down.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    try:
        return _cmd_up(args) if args.cmd == "up" else _cmd_down(args)
    except ClusterError as e:
        print(f"cluster.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
