"""Fixtures for integration and e2e tests: a real control plane and the kubelet harness (hack/lab).

The Go binaries are built by hack/build-go.sh on first use (the first kube-apiserver build takes
~10 minutes on 2 cores; later runs reuse the cache outside the repository). Without Go, and
without SHARING_* binary overrides, these tests are skipped. The harness needs root.

With CI=true a skip is a failure, except in tests/gpu (CI machines have no GPU): a CI run that
skipped the harness, e2e or node tests (no root, no Go) did not test what it says it did.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hack"))

import lab
from lab import images
from lab.deadlines import scaled

_build_error: Exception | None = None
_TESTS = Path(__file__).resolve().parent
_MAY_SKIP_IN_CI = (_TESTS / "gpu",)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under CI=true, a test skipped outside tests/gpu fails, with the reason it was skipped for."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        _fail_in_ci(report, item.path)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """... and so does a module skipped as a whole."""
    report = yield
    if report.skipped:
        _fail_in_ci(report, collector.path)
    return report


def _fail_in_ci(report: pytest.TestReport | pytest.CollectReport, path: Path) -> None:
    if not _strict_ci() or any(path.is_relative_to(d) for d in _MAY_SKIP_IN_CI):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped, and CI=true allows skips only in tests/gpu: {reason}"


def _strict_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """pytest-timeout's limit per test is for an idle machine too: stretched like every deadline."""
    if getattr(config, "_env_timeout", None):
        config._env_timeout = scaled(config._env_timeout)  # type: ignore[attr-defined]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Build the Go binaries (and, for tests/node, the images) once, before any test runs.

    A cold build (~11 minutes) inside a fixture would count against the per-test timeout
    (pytest-timeout); here it does not. Errors are kept and reported by the fixture.
    """
    global _build_error  # noqa: PLW0603
    for item in items:  # a test's own limit (`@pytest.mark.timeout(N)`) is stretched the same way
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            item.add_marker(pytest.mark.timeout(scaled(marker.args[0])), append=False)
    # The longest units of work first (`pytest_xdist_make_scheduler`), in pytest-randomly's order.
    items.sort(key=_first_to_last)
    node = any(item.get_closest_marker("node") for item in items)
    if not node and not any(item.get_closest_marker("integration") for item in items):
        return
    capture = items[0].config.pluginmanager.getplugin("capturemanager")
    # Let hack/build-go.sh's progress lines reach the terminal (a cold build takes minutes).
    uncaptured = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with uncaptured:
            # promtool (tests/integration/test_monitoring.py) is built for the tests only.
            monitoring = any(item.nodeid.startswith("tests/integration/test_monitoring.py") for item in items)
            bins = lab.binaries(test_tools=monitoring)
            if node and os.geteuid() == 0:
                images.all_images(bins)
            if any(worker_group(item.nodeid) == "skew" for item in items):
                lab.binaries(SKEW_RELEASE)  # tests/skew's other release (~10 more minutes cold)
    except lab.BinariesUnavailable:
        pass  # the fixture skips
    except lab.ClusterError as e:
        _build_error = e


SKEW_RELEASE = "1.34"
"""The Kubernetes release tests/skew runs beside the default (hack/go/k8s-1.34)."""

_HOST_WIDE = ("tests/bench/", "tests/node/test_teardown.py")
"""Tests that start real nodes of their own and read the host as a whole (its cgroups, links and
rules before and after): never beside each other."""

_DRA_NODE = ("tests/node/test_dra.py", "tests/node/test_ondemand.py", "tests/node/test_mixed.py")
"""The modules of tests/node that take the session's node through DRA and on-demand MIG: on a second
session node (tests/node/conftest.py `dra_node`), their own worker group, so that they run beside the
other modules of tests/node (each half about five minutes) instead of after them."""

_OWN_NODE = ("tests/node/test_demo.py",)
"""Tests of tests/node that bring up a node of their own (the demo's), not the session's: each is a
module like any other, on whichever worker is free, beside the session's node."""


_LONGEST = (
    "tests/e2e/test_soak.py",
    "tests/e2e/test_safety.py",
    "tests/integration/test_apply_crash.py",
    "tests/node/test_demo.py",
    "tests/e2e/test_agent.py",
    "tests/integration/test_dra_ondemand.py",
    "tests/integration/test_ondemand_scheduling.py",
    "tests/e2e/test_operating.py",
    "tests/fakedriver/test_mig.py",
)
"""The modules that take longest, longest first (measured in a spread run: 320, 146, 94, 70, 65, 49,
48, 45 and 37 s; every other module under 32 s), handed out right after the groups in this order: a
worker that is free takes the longest left, so the run ends on short modules, not on a long one
that the random order started last while the other workers wait."""


def _first_to_last(item: pytest.Item) -> int:
    group = worker_group(item.nodeid)
    if group:
        return {"host": 0, "node": 1, "dra-node": 2, "cluster": 3, "skew": 4}[group]
    module = item.nodeid.split("::", 1)[0]
    return 5 + _LONGEST.index(module) if module in _LONGEST else 5 + len(_LONGEST)


def worker_group(nodeid: str) -> str:
    """Which tests one worker runs together when the run is spread over several: every test of one of
    the session's real nodes (the modules of a node share it), every test of the session's three-node cluster,
    the tests of other Kubernetes releases (tests/skew: one node at a time, on one subnet), and the
    tests of `_HOST_WIDE`; "" for the rest."""
    if nodeid.startswith(_HOST_WIDE):
        return "host"
    if nodeid.startswith("tests/cluster/"):
        return "cluster"
    if nodeid.startswith("tests/skew/"):
        return "skew"
    if nodeid.startswith(_DRA_NODE):
        return "dra-node"
    return "node" if nodeid.startswith("tests/node/") and not nodeid.startswith(_OWN_NODE) else ""


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's load scheduling by scope: a scope is a `worker_group`, or else a module (so a
    module's fixtures are set up once, not once per worker its tests land on). Scopes go out in the
    order collected (`_first_to_last`): the host-wide tests (the bench's smoke run) to one worker, each
    real node's to another, then the cluster's, the skew's and each module, the longest first, to
    whichever worker is free.
    pytest-xdist's own `loadgroup` cannot be used: it names groups by rewriting `item._nodeid`, which
    pytest 9 no longer reads."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415  (only when the run is spread)

    class ByGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid) or nodeid.split("::", 1)[0]

        def _reschedule(self, node: Any) -> None:
            # pytest-xdist sends the next scope while a worker still has two tests to go, so a long
            # module can wait behind a long test (the bench's) while another worker is free. A
            # worker needs one test ahead of the one it runs (pytest's `nextitem`), no more.
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


@pytest.fixture(scope="session")
def cluster_binaries() -> lab.Binaries:
    if _build_error is not None:
        raise _build_error
    try:
        return lab.binaries()
    except lab.BinariesUnavailable as e:
        pytest.skip(f"no Go-built test binaries: {e}")


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


@pytest.fixture(scope="session")
def control_plane(
    cluster_binaries: lab.Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[lab.ControlPlane]:
    """etcd + kube-apiserver for the whole session (RBAC on, admin kubeconfig in .kubeconfig).

    Requests of ServiceAccounts (the agent's) go to an audit log (`control_plane.audit_log`), so
    tests count what the agent sends as the API server saw it.
    """
    audit = tmp_path_factory.mktemp("audit")
    (audit / "policy.yaml").write_text(AUDIT_POLICY)
    args = [f"--audit-policy-file={audit / 'policy.yaml'}", f"--audit-log-path={audit / 'audit.log'}"]
    with lab.ControlPlane(bins=cluster_binaries, extra_apiserver_args=args) as cp:
        cp.audit_log = audit / "audit.log"  # type: ignore[attr-defined]
        yield cp


@pytest.fixture
def namespace(control_plane: lab.ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the session control plane for one test, named after its module; deleted after
    it (not waited for)."""
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_").replace("_", "-")
    name = f"{module}-{uuid.uuid4().hex[:8]}"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    control_plane.api.request("POST", "/api/v1/namespaces", body, merge=False)
    yield name
    control_plane.api.request("DELETE", f"/api/v1/namespaces/{name}")


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the kubelet harness needs root (private mount namespace)")


@pytest.fixture
def make_kubelet(
    control_plane: lab.ControlPlane, cluster_binaries: lab.Binaries
) -> Iterator[Callable[..., lab.KubeletHarness]]:
    """Factory: ``make_kubelet(node_name=..., **KubeletHarness kwargs)``; all stopped at teardown."""
    _need_root()
    started: list[lab.KubeletHarness] = []

    def make(**kwargs: Any) -> lab.KubeletHarness:
        kwargs.setdefault("kubeconfig", control_plane.kubeconfig)
        kwargs.setdefault("node_name", f"node-{uuid.uuid4().hex[:8]}")
        kwargs.setdefault("binary", cluster_binaries.kubelet_harness)
        k = lab.KubeletHarness(**kwargs)
        started.append(k)
        return k.start()

    yield make
    for k in reversed(started):
        k.stop()


@pytest.fixture
def kubelet(make_kubelet: Callable[..., lab.KubeletHarness]) -> lab.KubeletHarness:
    """A kubelet harness syncing a fresh Node (``kubelet.node_name``) of the session control plane."""
    return make_kubelet()


@pytest.fixture
def make_stub_plugin(
    cluster_binaries: lab.Binaries,
) -> Iterator[Callable[..., lab.StubDevicePlugin]]:
    """Factory for the Go stub device plugin: ``make_stub_plugin(kubelet.device_plugin_dir, ...)``."""
    started: list[lab.StubDevicePlugin] = []

    def make(plugin_dir: Path, *args: Any, **kwargs: Any) -> lab.StubDevicePlugin:
        kwargs.setdefault("binary", cluster_binaries.stub_device_plugin)
        p = lab.StubDevicePlugin(plugin_dir, *args, **kwargs)
        started.append(p)
        return p.start()

    yield make
    for p in reversed(started):
        p.stop()
