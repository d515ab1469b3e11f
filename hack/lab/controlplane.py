"""etcd + kube-apiserver: the one control plane, for the fast tests and for the real node alike.

For tests beside the kubelet harness it binds 127.0.0.1 on free ports (envtest style: no
controllers, so the ServiceAccount admission plugin and the endpoint reconciler are off). Given a
``NodeNetwork`` it runs inside the real node's namespaces instead, bound to the node's address with
the SANs, admission plugins and kubelet client certificate a real node needs (Node authorizer,
NodeRestriction, ServiceAccounts, ``kubectl exec``/``logs`` through the kubelet).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from lab import etcd
from lab import kubeconfig as kc
from lab.api import Api, close_api
from lab.binaries import Binaries, binaries
from lab.certs import CA, pem_cert, pem_key, write_pair, write_private
from lab.deadlines import scaled
from lab.errors import ClusterError
from lab.paths import kubectl_path
from lab.process import PidRecord, Process, free_port, wait_until

APISERVER_STOP_S = 2.0
"""How long kube-apiserver gets to exit after SIGTERM before SIGKILL. It does not exit while a client
holds a watch open (20 s, then killed: a test's teardown and every outage waited that long); for
these throwaway servers an abrupt end is as good an outage as a graceful one."""
START_TIMEOUT = float(os.environ.get("SHARING_CONTROLPLANE_START_TIMEOUT", "60"))
# The first address of the service range: the `kubernetes` Service's ClusterIP.
SERVICE_RANGE, SERVICE_IP = "10.0.0.0/24", "10.0.0.1"


@dataclass(frozen=True)
class NodeNetwork:
    """Where a real node's control plane runs: inside the node's namespaces, on the node's address."""

    address: str
    launcher: tuple[str, ...]
    cgroup_procs: tuple[Path, ...] = ()
    port: int = 6443


class ControlPlane:
    """etcd + kube-apiserver, RBAC on, TokenRequest working.

    ``kubeconfig`` is an admin kubeconfig (client cert CN=admin, O=system:masters), ``server`` the
    API URL, ``ca_path`` the CA that signed every certificate. All state (certs, etcd data, logs in
    ``<dir>/logs``) lives in one directory, a temp dir unless ``base_dir`` is given.
    ``extra_apiserver_args`` are appended (a repeated flag overrides the default).
    """

    def __init__(
        self,
        *,
        base_dir: str | os.PathLike[str] | None = None,
        extra_apiserver_args: Sequence[str] = (),
        keep: bool | None = None,
        detached: bool = False,
        bins: Binaries | None = None,
        network: NodeNetwork | None = None,
    ) -> None:
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self._extra = list(extra_apiserver_args)
        self._keep = keep if keep is not None else bool(os.environ.get("SHARING_KEEP_CLUSTER"))
        self._detached = detached
        self._bins = bins
        self._network = network
        self.dir = Path()
        self.kubeconfig = Path()
        self.server = ""
        self.ca_path = Path()
        self.etcd_url = ""
        self.start_seconds = 0.0
        self._etcd: Process | None = None
        self._apiserver: Process | None = None
        self._ca: CA | None = None
        self._owns_dir = False

    def __enter__(self) -> ControlPlane:
        return self.start()

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
        net = self._network
        host = net.address if net else "127.0.0.1"
        port = net.port if net else free_port()
        self.server = f"https://{host}:{port}"
        try:
            self._write_certs(host)
            self._etcd, self.etcd_url = etcd.start(self._process, bins, self.dir / "etcd", self._network)
            self._apiserver = self._process("kube-apiserver", self._apiserver_args(bins, port))
            self._apiserver.start()
            self._wait_apiserver_ready()
            kc.write(
                self.kubeconfig,
                self.server,
                self.ca_path,
                cert=self.dir / "admin.crt",
                key=self.dir / "admin.key",
            )
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Stop kube-apiserver, then etcd; remove the temp dir (unless keep/SHARING_KEEP_CLUSTER)."""
        close_api(self)
        for p in (self._apiserver, self._etcd):
            if p is not None:
                p.stop(timeout=APISERVER_STOP_S)
        self._apiserver = self._etcd = None
        if self._owns_dir and not self._keep and self.dir != Path():
            shutil.rmtree(self.dir, ignore_errors=True)
            self._owns_dir = False

    def forget(self) -> None:
        """Leave etcd and kube-apiserver running (their records are kept by the caller)."""
        for p in (self._apiserver, self._etcd):
            if p is not None:
                p.forget()
        self._apiserver = self._etcd = None

    def restart_apiserver(self, down_s: float = 0) -> None:
        """Stop kube-apiserver, keep it down `down_s` (an outage its clients live through), start it
        again on the same port and etcd data; wait until ready."""
        with self.outage():
            time.sleep(down_s)

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """kube-apiserver down for the block (what happens meanwhile happens during an outage), then
        started again on the same port and etcd data; ready when the block has ended."""
        if self._apiserver is None:
            raise ClusterError("control plane not started")
        self._apiserver.stop(timeout=APISERVER_STOP_S)
        try:
            yield
        finally:
            self._apiserver.start()
            self._wait_apiserver_ready()

    @property
    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in (self._etcd, self._apiserver) if p is not None and p.running()}

    def records(self) -> list[PidRecord]:
        """etcd and kube-apiserver as a state file keeps them."""
        return [p.record() for p in (self._etcd, self._apiserver) if p is not None and p.running()]

    @property
    def logs(self) -> dict[str, Path]:
        return {p.name: p.log for p in (self._etcd, self._apiserver) if p is not None}

    def _process(self, name: str, args: list[str]) -> Process:
        net = self._network
        return Process(
            name,
            args,
            self.dir / "logs" / f"{name}.log",
            detached=self._detached,
            launcher=net.launcher if net else (),
            cgroup_procs=net.cgroup_procs if net else (),
        )

    def _write_certs(self, host: str) -> None:
        d = self.dir
        ca = self._ca = CA("gpu-sharing-test-ca")
        self.ca_path = d / "ca.crt"
        self.ca_path.write_bytes(pem_cert(ca.cert))
        hosts = ["127.0.0.1", "localhost", host]
        if self._network:
            hosts += [SERVICE_IP, "kubernetes", "kubernetes.default", "kubernetes.default.svc"]
            hosts += ["kubernetes.default.svc.cluster.local"]
            # kube-apiserver -> kubelet (exec, logs): a client the kubelet's webhook authorizer admits.
            write_pair(
                d,
                "apiserver-kubelet-client",
                *ca.issue("kube-apiserver-kubelet-client", orgs=["system:masters"]),
            )
        write_pair(d, "apiserver", *ca.issue("kube-apiserver", server=True, hosts=dict.fromkeys(hosts)))
        write_pair(d, "admin", *ca.issue("admin", orgs=["system:masters"]))
        # Service-account signing pair: TokenRequest signs with the private key, the API verifies
        # with the public one (the controller-manager signs with the same private key).
        sa = ec.generate_private_key(ec.SECP256R1())
        write_private(d / "sa.key", pem_key(sa))
        public = sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        (d / "sa.pub").write_bytes(public)
        self.kubeconfig = d / "admin.kubeconfig"

    def _apiserver_args(self, bins: Binaries, port: int) -> list[str]:
        d, net = self.dir, self._network
        args = [
            str(bins.kube_apiserver),
            f"--etcd-servers={self.etcd_url}",
            f"--cert-dir={d}",
            f"--tls-cert-file={d / 'apiserver.crt'}",
            f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={self.ca_path}",
            f"--secure-port={port}",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--allow-privileged=true",
            f"--service-account-issuer={self.server}",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            f"--api-audiences={self.server}",
        ]
        if net is None:
            # envtest style: no controllers, so no ServiceAccount tokens to admit, no endpoints.
            args += ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--authorization-mode=RBAC"]
            args += ["--disable-admission-plugins=ServiceAccount", "--endpoint-reconciler-type=none"]
        else:
            args += [
                "--bind-address=0.0.0.0",
                f"--advertise-address={net.address}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                # Without it `kubectl exec/logs` try the node's name in DNS, which there is none of.
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={d / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={d / 'apiserver-kubelet-client.key'}",
            ]
        return [*args, *self._extra]

    def _get(self, path: str) -> int:
        u = urllib.parse.urlsplit(self.server)
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        ctx.load_cert_chain(self.dir / "admin.crt", self.dir / "admin.key")
        conn = http.client.HTTPSConnection(u.hostname or "", u.port, context=ctx, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def _wait_apiserver_ready(self) -> None:
        assert self._apiserver is not None
        deadline = time.monotonic() + scaled(START_TIMEOUT)
        # /readyz includes the RBAC bootstrap post-start hooks.
        for path, what in (
            ("/readyz", "kube-apiserver /readyz"),
            ("/api/v1/namespaces/default", "the default namespace"),
        ):
            wait_until(lambda p=path: self._get(p) == 200, self._apiserver, what, START_TIMEOUT, deadline)  # type: ignore[misc]

    def user_kubeconfig(self, name: str, groups: Iterable[str] = ()) -> Path:
        """A kubeconfig authenticating as ``name`` (client cert, O=groups), e.g. a node identity:
        ``user_kubeconfig("system:node:n1", ["system:nodes"])``."""
        if self._ca is None:
            raise ClusterError("control plane not started")
        safe = "".join(c if c.isalnum() else "_" for c in name)
        crt, key = write_pair(self.dir, f"user-{safe}", *self._ca.issue(name, orgs=list(groups)))
        return kc.write(
            self.dir / f"user-{safe}.kubeconfig", self.server, self.ca_path, cert=crt, key=key, user=name
        )

    def token_kubeconfig(self, token: str, name: str = "token") -> Path:
        """A kubeconfig that authenticates with a bearer token (e.g. from TokenRequest)."""
        safe = "".join(c if c.isalnum() else "_" for c in name)
        return kc.write(
            self.dir / f"token-{safe}.kubeconfig", self.server, self.ca_path, token=token, user=name
        )

    @functools.cached_property
    def api(self) -> Api:
        """The API server as admin on a kept-alive connection (opened again after a restart): a
        read without a process."""
        return Api(self.server, self.dir)

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
            [kubectl_path(), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            check=check,
            timeout=timeout,
        )

    def state(self) -> dict[str, object]:
        return {
            "dir": str(self.dir),
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "ca_path": str(self.ca_path),
            "etcd_url": self.etcd_url,
            "pids": self.pids,
            "logs": {k: str(v) for k, v in self.logs.items()},
        }
