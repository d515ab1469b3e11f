"""MPS at run time, the pure parts: each GPU's daemon limits, what Allocate and the CDI spec hand a
client, and what status and metrics say about the daemons."""

from __future__ import annotations

import pytest

from sharing.config.spec import MigMode, MpsLimits, Replicas, Rule, Selector, Sharing, SharingConfig
from sharing.deviceplugin.allocation import AllocationError, allocate
from sharing.devices import (
    DeviceIdStrategy,
    DeviceListStrategy,
    Injection,
    MpsSettings,
    build_inventory,
    mps_layout,
    mps_settings,
)
from sharing.gpu.cdi import build_spec
from sharing.gpu.devfiles import DriverFiles
from sharing.mig.catalog import default_catalog
from sharing.model import Gpu, GpuUuid, NodeState
from sharing.ops import ConfigStatus, Metrics, status_document
from sharing.ops.status import mps_daemon

CATALOG = default_catalog()
A100 = "NVIDIA A100-SXM4-40GB"
GPU0, GPU1 = (
    GpuUuid("GPU-00000000-0000-0000-0000-000000000000"),
    GpuUuid("GPU-11111111-0000-0000-0000-000000000000"),
)
NODE = NodeState(
    (Gpu(0, GPU0, A100, 40960, True, False, False), Gpu(1, GPU1, A100, 40960, True, False, False))
)


def mps(replicas: int, limits: MpsLimits | None = None, mig: MigMode = MigMode.DISABLED) -> SharingConfig:
    rule = Rule(
        Selector(indices=(0,)),
        mig,
        replicas=Replicas(replicas),
        sharing=Sharing.MPS,
        mps=limits or MpsLimits(),
    )
    return SharingConfig(name="mps", rules=(rule,))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param(mps(4), MpsSettings(4, 25, 10240), id="defaults-100/N-memory/N"),
        pytest.param(mps(3), MpsSettings(3, 33, 13653), id="rounded-down"),
        pytest.param(mps(4, MpsLimits(40, 2048)), MpsSettings(4, 40, 2048), id="overrides"),
        pytest.param(mps(2, mig=MigMode.UNCHANGED), MpsSettings(2, 50, 20480), id="nvidia-config-unchanged"),
        pytest.param(mps(2, mig=MigMode.ENABLED), None, id="mig-instances-no-mps"),
        pytest.param(
            SharingConfig(name="ts", rules=(Rule(Selector(all=True), replicas=Replicas(4)),)),
            None,
            id="timeslicing",
        ),
    ],
)
def test_the_daemon_limits_of_gpu_0(config: SharingConfig, expected: MpsSettings | None) -> None:
    assert expected == mps_settings(config, NODE.gpus[0], CATALOG)


def test_only_the_gpus_a_rule_shares_with_mps_get_a_daemon_and_a_gpu_in_mig_mode_none() -> None:
    assert {GPU0: MpsSettings(4, 25, 10240)} == mps_layout(NODE, mps(4), CATALOG)
    in_mig = NodeState((Gpu(0, GPU0, A100, 40960, True, True, True),))
    assert {} == mps_layout(in_mig, mps(4), CATALOG)
    assert {} == mps_layout(NODE, mps(4), CATALOG, per_gpu={GPU0: None})  # the config in effect: none


ROOT = "/run/nvidia/mps"


def test_allocate_hands_an_mps_replica_the_pipe_directory_and_the_shared_memory() -> None:
    devices = build_inventory(NODE, mps(4), catalog=CATALOG).devices("nvidia.com/gpu")
    got = allocate("nvidia.com/gpu", devices, [f"{GPU0}::2"], injection=Injection(mps_root=ROOT))
    pipe = f"/mps/{GPU0}/pipe"
    assert (("NVIDIA_VISIBLE_DEVICES", GPU0), ("CUDA_MPS_PIPE_DIRECTORY", pipe)) == got.envs
    assert [(pipe, f"{ROOT}/{GPU0}/pipe", False), ("/dev/shm", f"{ROOT}/shm", False)] == [
        (m.container_path, m.host_path, m.read_only) for m in got.mounts
    ]
    whole = allocate("nvidia.com/gpu", devices, [GPU1], injection=Injection(mps_root=ROOT))
    assert ((("NVIDIA_VISIBLE_DEVICES", GPU1),), ()) == (whole.envs, whole.mounts)


def test_allocate_refuses_replicas_of_two_mps_gpus() -> None:
    both = SharingConfig(
        name="both", rules=(Rule(Selector(all=True), replicas=Replicas(2), sharing=Sharing.MPS),)
    )
    devices = build_inventory(NODE, both, catalog=CATALOG).devices("nvidia.com/gpu")
    with pytest.raises(AllocationError) as refused:
        allocate("nvidia.com/gpu", devices, [f"{GPU0}::0", f"{GPU1}::0"])
    assert "a container is the client of one MPS control daemon" in str(refused.value)


def test_with_cdi_the_spec_carries_the_mps_edits_and_allocate_only_the_name(tmp_path: object) -> None:
    inventory = build_inventory(NODE, mps(2), catalog=CATALOG)
    cdi = Injection(frozenset({DeviceListStrategy.CDI_CRI}), mps_root=ROOT)
    got = allocate("nvidia.com/gpu", inventory.devices("nvidia.com/gpu"), [f"{GPU0}::1"], injection=cdi)
    assert ((), (), (f"k8s.gpu-sharing.io/gpu={GPU0}",)) == (got.envs, got.mounts, got.cdi_devices)
    spec = build_spec(inventory, NODE, DriverFiles(), DeviceIdStrategy.UUID, mps_root=ROOT)
    assert spec is not None
    entries = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert f"CUDA_MPS_PIPE_DIRECTORY=/mps/{GPU0}/pipe" in entries[GPU0]["env"]
    options = ["rw", "nosuid", "nodev", "rbind"]
    assert [
        {"hostPath": f"{ROOT}/{GPU0}/pipe", "containerPath": f"/mps/{GPU0}/pipe", "options": options},
        {"hostPath": f"{ROOT}/shm", "containerPath": "/dev/shm", "options": options},
    ] == entries[GPU0]["mounts"]
    assert "mounts" not in entries[GPU1]


def test_status_and_metrics_show_each_daemon_its_limits_and_health() -> None:
    daemons = {
        GPU0: mps_daemon(f"{ROOT}/{GPU0}/pipe", (25, 10240), (25, 10240), 0),
        GPU1: mps_daemon(f"{ROOT}/{GPU1}/pipe", (50, 20480), None, 2, "it did not answer"),
    }
    inventory = build_inventory(NODE, mps(4), catalog=CATALOG)
    document = status_document("n", NODE, inventory, (), ConfigStatus("mps"), mps=daemons)
    assert [
        {
            "pipeDirectory": f"{ROOT}/{GPU0}/pipe",
            "activeThreadPercentage": 25,
            "pinnedMemoryMiB": 10240,
            "enforced": {"activeThreadPercentage": 25, "pinnedMemoryMiB": 10240},
            "healthy": True,
            "restarts": 0,
            "error": "",
        },
        {
            "pipeDirectory": f"{ROOT}/{GPU1}/pipe",
            "activeThreadPercentage": 50,
            "pinnedMemoryMiB": 20480,
            "enforced": None,
            "healthy": False,
            "restarts": 2,
            "error": "it did not answer",
        },
    ] == [g["mps"] for g in document["gpus"]]
    metrics = Metrics("test")
    metrics.snapshot(document, ())
    text = metrics.render().decode()
    for line in (
        f'gpu_sharing_mps_daemon_healthy{{gpu="0",uuid="{GPU0}"}} 1.0',
        f'gpu_sharing_mps_daemon_healthy{{gpu="1",uuid="{GPU1}"}} 0.0',
        f'gpu_sharing_mps_active_thread_percentage{{gpu="0",uuid="{GPU0}"}} 25.0',
        f'gpu_sharing_mps_pinned_memory_limit_bytes{{gpu="1",uuid="{GPU1}"}} 2.147483648e+10',
        f'gpu_sharing_mps_daemon_restarts_total{{gpu="1",uuid="{GPU1}"}} 2.0',
    ):
        assert line in text.splitlines()
