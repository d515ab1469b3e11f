"""What a claim's prepare time is recorded by (`gpu_sharing_dra_prepare_duration_seconds{profile,
ondemand}`): the MIG profile of its devices, pre-made or made at prepare, and whether it made one."""

from __future__ import annotations

import pytest

from sharing.dra.prepare import prepare_labels
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.store import OwnedInstance, PreparedDevice

MIG_GPU, WHOLE_GPU = GpuUuid("GPU-a"), GpuUuid("GPU-b")
NODE = NodeState(
    (
        Gpu(
            0, MIG_GPU, "NVIDIA A100-SXM4-40GB", 40960, mig_capable=True, mig_enabled=True, mig_pending=True,
            instances=(
                GpuInstance(1, "3g.20gb", 0, 4, (ComputeInstance(0, MigUuid("MIG-3g"), mig_index=0),)),
                GpuInstance(2, "1g.5gb", 4, 1, (ComputeInstance(0, MigUuid("MIG-1g"), mig_index=1),)),
            ),
        ),
        Gpu(1, WHOLE_GPU, "H100", 81559, mig_capable=True, mig_enabled=False, mig_pending=False),
    ),
)  # fmt: skip


def device(uuid: str, gpu: GpuUuid = MIG_GPU, made: str | None = None) -> PreparedDevice:
    instance = None if made is None else OwnedInstance(gpu, made, 5, 1, 3, 0)
    return PreparedDevice(("r",), "node-a", "d", uuid, gpu, (), instance=instance)


@pytest.mark.parametrize(
    ("devices", "labels"),
    [
        pytest.param([device("MIG-1g")], ("1g.5gb", False), id="pre-made"),
        pytest.param([device("MIG-new", made="1g.5gb")], ("1g.5gb", True), id="on-demand"),
        pytest.param([device("", made="2g.10gb")], ("2g.10gb", True), id="on-demand-before-its-uuid"),
        pytest.param([device("MIG-1g"), device("MIG-x", made="1g.5gb")], ("1g.5gb", True), id="same-profile"),
        pytest.param([device(WHOLE_GPU, WHOLE_GPU)], ("gpu", False), id="whole-gpu"),
        pytest.param([device(WHOLE_GPU, WHOLE_GPU), device("MIG-3g")], ("several", False), id="several"),
        pytest.param([device("MIG-gone")], ("unknown", False), id="unknown-mig-device"),
        pytest.param([], ("none", False), id="failed"),
    ],
)
def test_a_prepare_is_labelled_by_its_devices_profile(
    devices: list[PreparedDevice], labels: tuple[str, bool]
) -> None:
    assert labels == prepare_labels(devices, NODE)
