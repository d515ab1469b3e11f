"""The DRA kubelet plugin over its real unix sockets, with claims in a real kube-apiserver.

The kubelet is played twice over. `dra-kubelet` (hack/go/k8s/dra-kubelet) is the kubelet's own
plugin watcher and DRA plugin manager (k8s.io/kubernetes v1.36.3): it finds the registration
socket, validates what GetInfo says and calls prepare, unprepare and the health stream through
the kubelet's client, as a kubelet does. For the finer cases a gRPC client in the test dials the
same sockets and calls GetInfo, NotifyRegistrationStatus, NodePrepareResources,
NodeUnprepareResources and NodeWatchResources itself. Claims are created in the
API server and allocated the way the scheduler allocates them: `status.allocation` written through
the status subresource. The plugin reads them through the agent's own client (`sharing.kube.ApiClient`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import lab
import pytest
from lab.deadlines import scaled

from sharing.config.spec import MigStrategy, Replicas, Rule, Selector, SharingConfig
from sharing.devices.inventory import HealthState, Inventory, build_inventory
from sharing.dra import DraPaths, DraPlugin
from sharing.dra.names import DRIVER
from sharing.gpu.devfiles import DriverFiles
from sharing.kube import ApiClient
from sharing.kubelet.api import dra_v1_pb2 as dra
from sharing.kubelet.api import dra_v1_pb2_grpc as dra_grpc
from sharing.kubelet.api import drahealth_v1alpha1_pb2 as health
from sharing.kubelet.api import drahealth_v1alpha1_pb2_grpc as health_grpc
from sharing.kubelet.api import pluginregistration_v1_pb2 as reg
from sharing.kubelet.api import pluginregistration_v1_pb2_grpc as reg_grpc
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, HealthEvent, MigUuid, NodeState
from sharing.ops.metrics import Metrics
from tests.apiserver import allocated_claim

pytestmark = pytest.mark.integration

A100 = "NVIDIA A100-SXM4-40GB"
GPU0, GPU1 = (
    GpuUuid("GPU-00000000-0000-0000-0000-000000000000"),
    GpuUuid("GPU-11111111-0000-0000-0000-000000000000"),
)
MIG_A = MigUuid("MIG-aaaaaaaa-0000-0000-0000-000000000000")
# GPU 0 in MIG mode with one 3g.20gb (MIG device 0:0), GPU 1 whole and time-sliced twice.
NODE = NodeState(
    (
        Gpu(
            0, GPU0, A100, 40960, True, True, True, minor=0,
            instances=(GpuInstance(1, "3g.20gb", 0, 4, (ComputeInstance(0, MIG_A, mig_index=0),)),),
        ),
        Gpu(1, GPU1, A100, 40960, True, False, False, minor=1),
    )
)  # fmt: skip
CONFIG = SharingConfig(
    name="it",
    mig_strategy=MigStrategy.MIXED,
    rules=(Rule(devices=Selector(all=True), replicas=Replicas(default=1, per_device_kind=(("gpu", 2),))),),
)
CDI_KIND = "k8s.gpu.nvidia.com/claim"


@dataclass
class Node:
    """What the plugin serves: the inventory it is handed, changed by the test."""

    inventory: Inventory


@pytest.fixture
def driver_root(tmp_path: Path) -> Path:
    """The driver's files as a node has them (device nodes, a library, nvidia-smi)."""
    root = tmp_path / "driver"
    for rel in ("dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia0", "dev/nvidia1", "usr/bin/nvidia-smi"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    (root / "usr/bin/nvidia-smi").chmod(0o755)
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.580.65.06").write_text("\x7fELF")
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.65.06")
    return root


@dataclass
class Setup:
    node_name: str
    paths: DraPaths
    cdi: Path
    files: DriverFiles
    kube: ApiClient
    node: Node

    def plugin(self, metrics: Metrics | None = None) -> DraPlugin:
        return DraPlugin(
            node_name=self.node_name,
            claims=self.kube,
            inventory=lambda: self.node.inventory,
            node=lambda: NODE,
            files=self.files,
            cdi_dir=self.cdi,
            paths=self.paths,
            health_resend_s=0.5,
            recorder=metrics,
        )


@pytest.fixture
def setup(tmp_path: Path, control_plane: lab.ControlPlane, driver_root: Path) -> Iterator[Setup]:
    kube = ApiClient(str(control_plane.kubeconfig))
    kubelet = Path(tempfile.mkdtemp(prefix="gs-"))  # short: a unix socket path has at most 107 bytes
    yield Setup(
        node_name=f"node-{uuid.uuid4().hex[:6]}",
        paths=DraPaths(plugins_dir=kubelet / "plugins", registry_dir=kubelet / "plugins_registry"),
        cdi=tmp_path / "cdi",
        files=DriverFiles(driver_root),
        kube=kube,
        node=Node(build_inventory(NODE, CONFIG)),
    )
    kube.close()
    shutil.rmtree(kubelet, ignore_errors=True)


@pytest.fixture
async def plugin(setup: Setup) -> AsyncIterator[DraPlugin]:
    plugin = setup.plugin()
    await plugin.start()
    yield plugin
    await plugin.stop()


class Kubelet:
    """The kubelet's side of the sockets: the plugin watcher, then the DRA manager."""

    def __init__(self, paths: DraPaths) -> None:
        self.paths = paths

    async def register(self) -> reg.PluginInfo:
        async with grpc.aio.insecure_channel(f"unix://{self.paths.registration_socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info: reg.PluginInfo = await stub.GetInfo(reg.InfoRequest(), timeout=5)
            await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=5)
        return info

    async def prepare(self, *claims: dict[str, Any]) -> dict[str, Any]:
        async with grpc.aio.insecure_channel(f"unix://{self.paths.dra_socket}") as channel:
            answer = await dra_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=[_claim(c) for c in claims]), timeout=10
            )
        return {
            uid: {
                "error": r.error,
                "devices": [
                    (
                        list(d.request_names),
                        d.pool_name,
                        d.device_name,
                        list(d.cdi_device_ids),
                        d.share_id if d.HasField("share_id") else None,
                    )
                    for d in r.devices
                ],
            }
            for uid, r in answer.claims.items()
        }

    async def unprepare(self, *claims: dict[str, Any]) -> dict[str, str]:
        async with grpc.aio.insecure_channel(f"unix://{self.paths.dra_socket}") as channel:
            answer = await dra_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                dra.NodeUnprepareResourcesRequest(claims=[_claim(c) for c in claims]), timeout=10
            )
        return {uid: r.error for uid, r in answer.claims.items()}


def _claim(obj: dict[str, Any]) -> dra.Claim:
    meta = obj["metadata"]
    return dra.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def make_claim(
    cp: lab.ControlPlane,
    namespace: str,
    name: str,
    results: list[dict[str, str]],
    *,
    requests: tuple[str, ...] = ("gpu",),
    config: list[dict[str, Any]] | None = None,
    pods: tuple[tuple[str, str], ...] = (),
    subrequests: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A claim, then its allocation (and the pods it is reserved for, (name, uid)) written as the
    scheduler writes them (status subresource)."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": r,
                        "firstAvailable": [
                            {"name": n, "deviceClassName": "mig.nvidia.com"} for n in subrequests
                        ],
                    }
                    if subrequests
                    else {"name": r, "exactly": {"deviceClassName": "gpu.nvidia.com"}}
                    for r in requests
                ]
            }
        },
    }
    status = {
        "status": {
            "allocation": {
                "devices": {"results": results, **({"config": config} if config else {})},
            },
            **({"reservedFor": [{"resource": "pods", "name": n, "uid": u} for n, u in pods]} if pods else {}),
        }
    }
    return allocated_claim(cp, claim, status)


def result(node: str, device: str, request: str = "gpu", driver: str = DRIVER) -> dict[str, str]:
    return {"request": request, "driver": driver, "pool": node, "device": device}


def spec_of(setup: Setup, uid: str) -> dict[str, Any]:
    return dict(json.loads((setup.cdi / f"k8s.gpu.nvidia.com-claim_{uid}.json").read_text()))


def devices_in(spec: dict[str, Any]) -> dict[str, list[str]]:
    """{CDI device name: its env} of a spec."""
    return {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}


def specs(setup: Setup) -> list[str]:
    return sorted(p.name for p in setup.cdi.glob("*.json")) if setup.cdi.exists() else []


# ---- the kubelet's own code ----------------------------------------------------------------


async def dra_kubelet(cp: lab.ControlPlane, setup: Setup, *args: str) -> dict[str, Any]:
    """One run of the kubelet's plugin watcher and DRA client against the plugin (a fresh kubelet)."""
    process = await asyncio.create_subprocess_exec(
        str(lab.binaries().dra_kubelet), "--registry-dir", str(setup.paths.registry_dir),
        "--kubeconfig", str(cp.kubeconfig), "--node", setup.node_name, "--driver", DRIVER, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), scaled(60))
    assert 0 == process.returncode, err.decode()[-2000:]
    return dict(json.loads(out))


def ref(claim: dict[str, Any]) -> str:
    meta = claim["metadata"]
    return f"{meta['namespace']}/{meta['name']}/{meta['uid']}"


async def test_the_kubelets_own_plugin_manager_registers_prepares_and_unprepares(
    control_plane: lab.ControlPlane, namespace: str, setup: Setup, plugin: DraPlugin
) -> None:
    node = setup.node_name
    claim = make_claim(control_plane, namespace, "c", [result(node, "gpu-0-mig-0")])
    uid = claim["metadata"]["uid"]

    got = await dra_kubelet(control_plane, setup, "--prepare", ref(claim), "--health")

    assert {
        "registered": True,
        "prepare": {
            "claims": {
                uid: {
                    "devices": [
                        {
                            "request_names": ["gpu"],
                            "pool_name": node,
                            "device_name": "gpu-0-mig-0",
                            "cdi_device_ids": [f"{CDI_KIND}={uid}-gpu-0-mig-0"],
                        }
                    ]
                }
            }
        },
    } == {k: v for k, v in got.items() if k != "health"}
    assert {("gpu-0-mig-0", 1), ("gpu-1", 1)} == {
        (d["device"]["device_name"], d["health"]) for d in got["health"]["devices"]
    }
    assert (True, "") == (plugin.registration.registered, plugin.registration.error)
    # A second kubelet (a restart) unprepares what the first prepared.
    assert {"registered": True, "unprepare": {"claims": {uid: {}}}} == await dra_kubelet(
        control_plane, setup, "--unprepare", ref(claim)
    )
    assert ([], ()) == (specs(setup), plugin.prepared().claims)


# ---- registration -------------------------------------------------------------------------


async def test_registers_as_a_dra_plugin(setup: Setup, plugin: DraPlugin) -> None:
    info = await Kubelet(setup.paths).register()
    assert ("DRAPlugin", DRIVER, str(setup.paths.dra_socket)) == (info.type, info.name, info.endpoint)
    assert ["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"] == list(info.supported_versions)
    assert setup.paths.registration_socket.name == f"gpu.nvidia.com-{setup.paths.instance}-reg.sock"
    assert (True, "") == (plugin.registration.registered, plugin.registration.error)


async def test_stop_removes_both_sockets(setup: Setup, plugin: DraPlugin) -> None:
    await plugin.stop()
    assert (False, False) == (setup.paths.registration_socket.exists(), setup.paths.dra_socket.exists())


# ---- prepare / unprepare ------------------------------------------------------------------


async def test_prepare_writes_a_cdi_spec_per_claim_and_unprepare_removes_it(
    control_plane: lab.ControlPlane, namespace: str, setup: Setup, plugin: DraPlugin
) -> None:
    node = setup.node_name
    share_a, share_b = str(uuid.uuid4()), str(uuid.uuid4())
    # A prioritized list: the scheduler took the second choice, result request `gpu/medium`.
    mig = make_claim(
        control_plane,
        namespace,
        "mig",
        [result(node, "gpu-0-mig-0", "gpu/medium")],
        subrequests=("small", "medium"),
    )
    # GPU 1 is time-sliced: one device in the pool, allocated to two claims at once (a share each).
    shared_a = make_claim(
        control_plane, namespace, "shared-a", [{**result(node, "gpu-1"), "shareID": share_a}]
    )
    shared_b = make_claim(
        control_plane, namespace, "shared-b", [{**result(node, "gpu-1"), "shareID": share_b}]
    )
    mig_uid, a_uid, b_uid = (c["metadata"]["uid"] for c in (mig, shared_a, shared_b))
    kubelet = Kubelet(setup.paths)

    answer = await kubelet.prepare(mig, shared_a, shared_b)

    assert {
        mig_uid: {
            "error": "",
            "devices": [(["gpu"], node, "gpu-0-mig-0", [f"{CDI_KIND}={mig_uid}-gpu-0-mig-0"], None)],
        },
        a_uid: {"error": "", "devices": [(["gpu"], node, "gpu-1", [f"{CDI_KIND}={a_uid}-gpu-1"], share_a)]},
        b_uid: {"error": "", "devices": [(["gpu"], node, "gpu-1", [f"{CDI_KIND}={b_uid}-gpu-1"], share_b)]},
    } == answer
    spec = spec_of(setup, mig_uid)
    env = f"GPU_SHARING_DEVICE_{mig_uid.upper().replace('-', '_')}_GPU_0_MIG_0={MIG_A}"
    assert (CDI_KIND, {f"{mig_uid}-gpu-0-mig-0": [env]}) == (spec["kind"], devices_in(spec))
    assert ["/dev/nvidia0"] == [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert ["/dev/nvidia1"] == [
        n["path"] for n in spec_of(setup, a_uid)["devices"][0]["containerEdits"]["deviceNodes"]
    ]
    assert [
        (namespace, "mig", mig_uid, (str(MIG_A),)),
        (namespace, "shared-a", a_uid, (GPU1,)),
        (namespace, "shared-b", b_uid, (GPU1,)),
    ] == sorted(
        (c.namespace, c.name, c.uid, tuple(d.uuid for d in c.devices)) for c in plugin.prepared().claims
    )
    assert ({MIG_A, GPU1}, "") == (plugin.prepared().held(), plugin.prepared().unknown)

    assert {mig_uid: "", a_uid: ""} == await kubelet.unprepare(mig, shared_a)
    assert [f"k8s.gpu.nvidia.com-claim_{b_uid}.json"] == specs(setup)
    assert {b_uid: ""} == await kubelet.unprepare(shared_b)
    assert [] == specs(setup)
    assert () == plugin.prepared().claims


async def test_prepare_and_unprepare_are_idempotent_and_counted(
    control_plane: lab.ControlPlane, namespace: str, setup: Setup
) -> None:
    metrics = Metrics("test")
    plugin = setup.plugin(metrics)
    await plugin.start()
    try:
        claim = make_claim(control_plane, namespace, "c", [result(setup.node_name, "gpu-1")])
        uid = claim["metadata"]["uid"]
        kubelet = Kubelet(setup.paths)
        first = await kubelet.prepare(claim)
        assert first == await kubelet.prepare(claim)
        assert [f"k8s.gpu.nvidia.com-claim_{uid}.json"] == specs(setup)
        assert 1 == len(plugin.prepared().claims)
        assert (1.0, 2.0) == scraped(metrics)
        assert {uid: ""} == await kubelet.unprepare(claim)
        assert {uid: ""} == await kubelet.unprepare(claim)
        assert ([], ()) == (specs(setup), plugin.prepared().claims)
        assert (0.0, 2.0) == scraped(metrics)
    finally:
        await plugin.stop()


def scraped(metrics: Metrics) -> tuple[float, float]:
    """(prepared claims, prepares timed, of every profile) as Prometheus scrapes them."""
    lines = dict(
        line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if not line.startswith("#")
    )
    timed = "gpu_sharing_dra_prepare_duration_seconds_count{"
    return (
        float(lines["gpu_sharing_dra_prepared_claims"]),
        sum(float(v) for k, v in lines.items() if k.startswith(timed)),
    )


async def test_a_restart_between_prepare_and_unprepare_loses_nothing(
    control_plane: lab.ControlPlane, namespace: str, setup: Setup, plugin: DraPlugin
) -> None:
    pod_uid = str(uuid.uuid4())
    claim = make_claim(
        control_plane, namespace, "c", [result(setup.node_name, "gpu-0-mig-0")], pods=(("trainer", pod_uid),)
    )
    uid = claim["metadata"]["uid"]
    before = await Kubelet(setup.paths).prepare(claim)
    await plugin.stop()

    again = setup.plugin()
    await again.start()
    try:
        assert [(namespace, "c", uid, ("gpu-0-mig-0",), (("trainer", pod_uid),))] == [
            (
                c.namespace,
                c.name,
                c.uid,
                tuple(d.device for d in c.devices),
                tuple((p.name, p.uid) for p in c.pods),
            )
            for c in again.prepared().claims
        ]
        assert before == await Kubelet(setup.paths).prepare(claim)  # the kubelet's retry after its restart
        # The claim and its pod are gone before the unprepare comes: the checkpoint is enough.
        control_plane.kubectl("delete", "resourceclaim", "c", "-n", namespace, "--wait=true", check=True)
        assert {uid: ""} == await Kubelet(setup.paths).unprepare(claim)
        assert ([], ()) == (specs(setup), again.prepared().claims)
    finally:
        await again.stop()


async def test_bad_claims_fail_alone_with_a_clear_error(
    control_plane: lab.ControlPlane, namespace: str, setup: Setup, plugin: DraPlugin
) -> None:
    node = setup.node_name
    good = make_claim(control_plane, namespace, "good", [result(node, "gpu-1")])
    missing_device = make_claim(control_plane, namespace, "gone", [result(node, "gpu-7")])
    other_pool = make_claim(control_plane, namespace, "elsewhere", [result("node-other", "gpu-0")])
    mps = make_claim(
        control_plane, namespace, "mps", [result(node, "gpu-1")],
        config=[{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"},
        }}}],
    )  # fmt: skip
    not_there = {"metadata": {"namespace": namespace, "name": "never-made", "uid": str(uuid.uuid4())}}
    wrong_uid = {"metadata": {**good["metadata"], "name": "good", "uid": str(uuid.uuid4())}}

    answer = await Kubelet(setup.paths).prepare(good, missing_device, other_pool, mps, not_there, wrong_uid)

    errors = {uid: a["error"] for uid, a in answer.items()}
    assert "" == errors[good["metadata"]["uid"]]
    assert (
        f"claim {namespace}/gone: status.allocation.devices.results[0]: device gpu-7 is not one this node "
        "has now (it has gpu-0-mig-0, gpu-1); the claim was allocated from an "
        "out-of-date ResourceSlice: delete the claim (or its pod) so that it is allocated again"
    ) == errors[missing_device["metadata"]["uid"]]
    assert (
        f"claim {namespace}/elsewhere: status.allocation.devices.results[0]: device gpu-0 of pool node-other "
        f"is not on this node (pool {node})"
    ) == errors[other_pool["metadata"]["uid"]]
    assert errors[mps["metadata"]["uid"]].startswith(
        f"claim {namespace}/mps: status.allocation.devices.config[0].opaque.parameters.sharing: MPS is not "
        "chosen per claim for whole GPUs on this driver"
    )
    assert (
        f"claim {namespace}/never-made does not exist in the API server"
        == errors[not_there["metadata"]["uid"]]
    )
    assert (
        f"claim {namespace}/good: the kubelet asks for UID {wrong_uid['metadata']['uid']}, the API server "
        f"has UID {good['metadata']['uid']} (the claim was deleted and made again)"
    ) == errors[wrong_uid["metadata"]["uid"]]
    assert [good["metadata"]["uid"]] == [c.uid for c in plugin.prepared().claims]
    assert [f"k8s.gpu.nvidia.com-claim_{good['metadata']['uid']}.json"] == specs(setup)


# ---- health ---------------------------------------------------------------------------------


async def test_health_streams_every_device_and_follows_the_overlay(setup: Setup, plugin: DraPlugin) -> None:
    async with grpc.aio.insecure_channel(f"unix://{setup.paths.dra_socket}") as channel:
        stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            health.NodeWatchResourcesRequest()
        )

        async def next_list() -> dict[str, int]:
            answer = await asyncio.wait_for(stream.read(), scaled(10))
            assert {setup.node_name} == {d.device.pool_name for d in answer.devices}
            return {d.device.device_name: d.health for d in answer.devices}

        healthy = {"gpu-0-mig-0": health.HEALTHY, "gpu-1": health.HEALTHY}
        assert healthy == await next_list()
        xid = HealthState().apply(HealthEvent(GPU1, healthy=False, xid=79))
        setup.node.inventory = build_inventory(NODE, CONFIG, xid)
        assert plugin.refresh()
        unhealthy = {**healthy, "gpu-1": health.UNHEALTHY}
        assert unhealthy == await next_list()
        assert unhealthy == await next_list()  # sent again before the kubelet's timeout makes it Unknown
        stream.cancel()
