"""`sharing status` of a node with `mig: dynamic` GPUs: the instances claims made there are its slices,
each with its claim, the claim's pods and its MPS daemon, as the DRA checkpoint records them; the
metrics read the same document."""

from __future__ import annotations

from sharing.cli.status import describe
from sharing.devices import Inventory
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.ops import ConfigStatus, Metrics, status_document
from sharing.ops.status import mps_daemon
from sharing.store import OwnedInstance, PreparedClaim, PreparedDevice, PreparedPod

GPU = GpuUuid("GPU-0")
MADE, ADOPTED = "MIG-made", "MIG-adopted"


def instance(gi: int, profile: str, start: int, size: int, mig: str) -> GpuInstance:
    return GpuInstance(gi, profile, start, size, (ComputeInstance(0, MigUuid(mig)),))


NODE = NodeState(
    (
        Gpu(0, GPU, "NVIDIA A100-SXM4-40GB", 40960, True, True, True,
            (instance(1, "1g.5gb", 0, 1, MADE), instance(2, "3g.20gb", 4, 4, ADOPTED))),
    )
)  # fmt: skip
DYNAMIC = Inventory(dynamic=frozenset({GPU}))


def device(
    name: str, mig: str, profile: str, start: int, size: int, *, foreign: bool = False
) -> PreparedDevice:
    owned = OwnedInstance(GPU, profile, start, size, 1, 0, foreign=foreign)
    return PreparedDevice(
        ("mig",), "node-a", name, mig, GPU, (f"k8s.gpu.nvidia.com/claim={mig}",), instance=owned
    )


RECORDED = (
    PreparedClaim("ns", "small", "uid-s", (device("gpu-0-mig-1g-5gb-at-0", MADE, "1g.5gb", 0, 1),),
                  (PreparedPod("p1", "u1"), PreparedPod("p2", "u2"))),
    PreparedClaim("ns", "big", "uid-b",
                  (device("gpu-0-mig-3g-20gb-at-4", ADOPTED, "3g.20gb", 4, 4, foreign=True),)),
    PreparedClaim("ns", "gone", "uid-g", (device("gpu-0-mig-2g-10gb-at-2", "MIG-lost", "2g.10gb", 2, 2),)),
)  # fmt: skip
DAEMON = mps_daemon(f"/run/nvidia/mps/{MADE}/pipe", (50, 4096), None, 1, "it did not answer")


def document() -> dict[str, object]:
    return status_document(
        "node-a",
        NODE,
        DYNAMIC,
        (),
        ConfigStatus(),
        frontend="dra",
        recorded=RECORDED,
        mps={GpuUuid(MADE): DAEMON},
    )


def test_the_instances_made_for_claims_are_the_dynamic_gpus_slices_with_claim_pods_and_daemon() -> None:
    (gpu,) = document()["gpus"]  # type: ignore[attr-defined]
    assert "onDemand" == gpu["dynamic"]
    assert [
        {
            "resource": "nvidia.com/mig-3g.20gb",
            "id": ADOPTED,
            "device": ADOPTED,
            "replica": None,
            "health": "Healthy",
            "pod": None,
            "profile": "3g.20gb",
            "claims": [{"namespace": "ns", "name": "big", "pods": []}],
            "onDemand": {"device": "gpu-0-mig-3g-20gb-at-4", "start": 4, "made": False},
            "mps": None,
        },
        {
            "resource": "nvidia.com/mig-2g.10gb",
            "id": "MIG-lost",
            "device": "MIG-lost",
            "replica": None,
            "health": "Healthy",
            "pod": None,
            "profile": "2g.10gb",
            "claims": [{"namespace": "ns", "name": "gone", "pods": []}],
            "onDemand": {"device": "gpu-0-mig-2g-10gb-at-2", "start": 2, "made": True},
            "mps": None,
        },
        {
            "resource": "nvidia.com/mig-1g.5gb",
            "id": MADE,
            "device": MADE,
            "replica": None,
            "health": "Healthy",
            "pod": None,
            "profile": "1g.5gb",
            "claims": [{"namespace": "ns", "name": "small", "pods": ["ns/p1", "ns/p2"]}],
            "onDemand": {"device": "gpu-0-mig-1g-5gb-at-0", "start": 0, "made": True},
            "mps": DAEMON,
        },
    ] == gpu["slices"]


def test_a_claim_on_a_gpu_that_is_not_dynamic_is_no_slice_of_its_own() -> None:
    static = status_document("node-a", NODE, Inventory(), (), ConfigStatus(), recorded=RECORDED)
    assert [] == static["gpus"][0]["slices"]  # type: ignore[index]


def test_people_read_each_instance_its_claim_pods_and_daemon() -> None:
    text = describe(document())  # type: ignore[arg-type]
    assert "  MPS daemon of MIG-made not answering: 50% of the threads and 4096 MiB per client, pipes " \
        "/run/nvidia/mps/MIG-made/pipe, restarts 1; it did not answer" in text.splitlines()  # fmt: skip
    rows = [line.split() for line in text.splitlines() if line.startswith("  nvidia.com/mig-")]
    assert [
        ["nvidia.com/mig-3g.20gb", ADOPTED, "(gpu-0-mig-3g-20gb-at-4,", "adopted)", "3g.20gb", "Healthy",
         "claim", "ns/big"],
        ["nvidia.com/mig-2g.10gb", "MIG-lost", "(gpu-0-mig-2g-10gb-at-2)", "2g.10gb", "Healthy", "claim",
         "ns/gone"],
        ["nvidia.com/mig-1g.5gb", MADE, "(gpu-0-mig-1g-5gb-at-0)", "1g.5gb", "Healthy", "claim", "ns/small",
         "(pod", "ns/p1,", "ns/p2)"],
    ] == rows  # fmt: skip


def test_a_claims_daemon_is_in_the_mps_metrics_under_its_mig_device_and_the_slices_are_not_advertised() -> (
    None
):
    metrics = Metrics("test")
    metrics.snapshot(document(), ())
    lines = metrics.render().decode().splitlines()
    for line in (
        f'gpu_sharing_mps_daemon_healthy{{gpu="0",uuid="{MADE}"}} 0.0',
        f'gpu_sharing_mps_daemon_restarts_total{{gpu="0",uuid="{MADE}"}} 1.0',
        f'gpu_sharing_mps_active_thread_percentage{{gpu="0",uuid="{MADE}"}} 50.0',
    ):
        assert line in lines
    assert not [line for line in lines if line.startswith("gpu_sharing_slices_advertised{")]


def test_an_unhealthy_gpu_makes_its_claims_slices_unhealthy() -> None:
    sick = status_document(
        "n", NODE, DYNAMIC, (), ConfigStatus(), recorded=RECORDED, unhealthy=frozenset({GPU})
    )
    assert {"Unhealthy"} == {s["health"] for s in sick["gpus"][0]["slices"]}  # type: ignore[index]
