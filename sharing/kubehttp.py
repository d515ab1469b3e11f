"""HTTPS to the Kubernetes API with the standard library: credentials from a kubeconfig or from the
pod's ServiceAccount, one kept-alive connection for requests and one connection per watch.

Why not the official client's transport: importing `kubernetes` costs the agent ~17 MB of memory
(requests, pydantic, aiohttp, oauthlib and the client's own modules come with it), a quarter of an
idle agent, for the six calls it makes. Those calls need TLS to the cluster's CA, a client
certificate or a bearer token (the ServiceAccount's is read again when the kubelet rotates it) and
JSON, which is what this module does. A kubeconfig that needs anything else (exec plugins, auth
providers, passwords, proxies, a TLS server name) raises `Unsupported`, and `sharing.kube` hands
it to the official client instead.
"""

from __future__ import annotations

import base64
import http.client
import os
import ssl
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_USER_KEYS = frozenset(
    {"client-certificate", "client-certificate-data", "client-key", "client-key-data", "token", "tokenFile"}
)
_CLUSTER_KEYS = frozenset(
    {"server", "certificate-authority", "certificate-authority-data", "insecure-skip-tls-verify"}
)


class Unsupported(Exception):
    """The kubeconfig authenticates in a way only the official client knows."""


class TransportError(Exception):
    """The API server could not be reached, or the connection broke."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """Where the API server is and how to prove who we are."""

    server: str
    ca_file: str | None = None
    ca_data: str | None = None
    insecure: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    token: str | None = None
    token_file: str | None = None


def from_kubeconfig(path: str) -> Credentials:
    """The current context of a kubeconfig file; `Unsupported` for what only the official client does."""
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    base = Path(path).resolve().parent
    context_name = config.get("current-context")
    context = _named(config, "contexts", context_name, "context")
    cluster = _named(config, "clusters", context.get("cluster"), "cluster")
    user = _named(config, "users", context.get("user"), "user") if context.get("user") else {}
    if set(user) - _USER_KEYS or set(cluster) - _CLUSTER_KEYS:
        raise Unsupported(f"{path}: {sorted((set(user) - _USER_KEYS) | (set(cluster) - _CLUSTER_KEYS))}")

    def file(value: str | None) -> str | None:
        return None if value is None else str(base / value)

    def data(value: str | None) -> bytes | None:
        return None if value is None else base64.b64decode(value)

    ca_data = data(cluster.get("certificate-authority-data"))
    return Credentials(
        server=str(cluster["server"]),
        ca_file=file(cluster.get("certificate-authority")),
        ca_data=ca_data.decode() if ca_data else None,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        cert_file=file(user.get("client-certificate")),
        key_file=file(user.get("client-key")),
        cert_data=data(user.get("client-certificate-data")),
        key_data=data(user.get("client-key-data")),
        token=user.get("token"),
        token_file=file(user.get("tokenFile")),
    )


def _named(config: Mapping[str, Any], section: str, name: object, field: str) -> dict[str, Any]:
    for entry in config.get(section) or []:
        if entry.get("name") == name:
            return dict(entry.get(field) or {})
    raise ValueError(f"kubeconfig has no {section[:-1]} named {name!r}")


def in_cluster() -> Credentials:
    """The pod's ServiceAccount, as the kubelet mounts it."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ValueError("not in a pod: KUBERNETES_SERVICE_HOST/PORT are not set")
    host = f"[{host}]" if ":" in host else host
    return Credentials(
        server=f"https://{host}:{port}",
        ca_file=str(SERVICE_ACCOUNT / "ca.crt"),
        token_file=str(SERVICE_ACCOUNT / "token"),
    )


class Http:
    """Requests to one API server; safe to call from several threads (requests take turns)."""

    def __init__(self, credentials: Credentials, user_agent: str) -> None:
        url = urllib.parse.urlsplit(credentials.server)
        if url.scheme != "https" or not url.hostname:
            raise ValueError(f"the API server {credentials.server!r} is not an https:// URL")
        self.host, self.port = url.hostname, url.port or 443
        self._credentials = credentials
        self._context = _tls(credentials)
        self._user_agent = user_agent
        self._lock = threading.Lock()
        self._conn: http.client.HTTPSConnection | None = None
        self._token: tuple[float, str] | None = None

    def request(
        self, method: str, path: str, body: bytes | None, content_type: str, timeout: float
    ) -> tuple[int, str, bytes]:
        """(status, reason, body); a stale kept-alive connection is replaced once."""
        with self._lock:
            for attempt in (1, 2):
                fresh = self._conn is None
                if self._conn is None:
                    self._conn = self._connect(timeout)
                conn = self._conn
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                try:
                    conn.request(method, path, body=body, headers=self._headers(content_type))
                    response = conn.getresponse()
                    data = response.read()
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as err:
                    self._close()
                    if fresh or attempt == 2:
                        raise TransportError(f"{type(err).__name__}: {err}") from err
                    continue
                except (OSError, http.client.HTTPException) as err:
                    self._close()
                    raise TransportError(f"{type(err).__name__}: {err}") from err
                if response.will_close:
                    self._close()
                return response.status, response.reason, data
        raise AssertionError("unreachable")

    def watch(self, path: str, connect_timeout: float, read_timeout: float) -> Watch:
        """A watch on its own connection: status and reason, then the lines of the stream."""
        conn = self._connect(connect_timeout)
        try:
            conn.request("GET", path, headers=self._headers("application/json"))
            if conn.sock is not None:
                conn.sock.settimeout(read_timeout)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as err:
            conn.close()
            raise TransportError(f"{type(err).__name__}: {err}") from err
        return Watch(conn, response)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connect(self, timeout: float) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self._context, timeout=timeout)

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type, "User-Agent": self._user_agent}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _bearer(self) -> str | None:
        """The token; a token file is read again when it changes (the kubelet rotates it)."""
        creds = self._credentials
        if creds.token_file is None:
            return creds.token
        try:
            changed = os.stat(creds.token_file).st_mtime
            if self._token is None or self._token[0] != changed:
                self._token = (changed, Path(creds.token_file).read_text(encoding="utf-8").strip())
        except OSError as err:
            if self._token is None:
                raise TransportError(f"cannot read the token {creds.token_file}: {err.strerror}") from err
        return self._token[1] if self._token else None


class Watch:
    """An open watch: `status`, `reason`, `body()` when it failed, `lines()` when it did not."""

    def __init__(self, conn: http.client.HTTPSConnection, response: http.client.HTTPResponse) -> None:
        self._conn = conn
        self._response = response
        self.status = response.status
        self.reason = response.reason

    def body(self) -> bytes:
        try:
            return self._response.read()
        except (OSError, http.client.HTTPException):
            return b""

    def lines(self) -> Iterator[bytes]:
        """One JSON object per line, until the server ends the watch; TransportError if it breaks."""
        try:
            for line in iter(self._response.readline, b""):
                if line.strip():
                    yield line
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise TransportError(f"{type(err).__name__}: {err}") from err

    def close(self) -> None:
        self._conn.close()


def _tls(credentials: Credentials) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=credentials.ca_file, cadata=credentials.ca_data)
    if credentials.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if credentials.cert_file and credentials.key_file:
        context.load_cert_chain(credentials.cert_file, credentials.key_file)
    elif credentials.cert_data and credentials.key_data:
        # ssl loads a client certificate from files only: a private temporary file, removed at once.
        with tempfile.TemporaryDirectory(prefix="sharing-tls-") as tmp:
            cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            for path, content in ((cert, credentials.cert_data), (key, credentials.key_data)):
                path.touch(mode=0o600)
                path.write_bytes(content)
            context.load_cert_chain(str(cert), str(key))
    return context
