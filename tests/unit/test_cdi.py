"""The CDI spec the agent writes, from a driver root laid out as NVIDIA's installer lays it out.

The driver root is a directory in tmp_path shaped like the fake driver's (hack/fakedriver/README.md)
and a real node's: versioned libraries with their `.so.1` links under usr/lib/x86_64-linux-gnu,
nvidia-smi under usr/bin, device nodes under dev/ (plain files: only their paths matter here) and
the MIG capability files under proc/driver/nvidia/capabilities. The agent sees it at `root`, the
node at HOST: every host path in the spec is the node's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from sharing.devices import DeviceIdStrategy
from sharing.devices.inventory import Device, DeviceId, Health, Inventory, ResourceName
from sharing.gpu.cdi import SPEC_FILE, build_spec, write_spec
from sharing.gpu.devfiles import DriverFiles
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState

HOST = Path("/run/nvidia/driver")
LIB = "usr/lib/x86_64-linux-gnu"
VERSION = "580.65.06"
RO = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
MIG_A, MIG_B = (
    MigUuid("MIG-aaaaaaaa-0000-0000-0000-000000000000"),
    MigUuid("MIG-bbbbbbbb-0000-0000-0000-000000000000"),
)
GPU0, GPU1 = (
    GpuUuid("GPU-00000000-0000-0000-0000-000000000000"),
    GpuUuid("GPU-11111111-0000-0000-0000-000000000000"),
)
# GPU 0 (minor 0) in MIG mode with two MIG devices; GPU 1 (minor 1) whole.
NODE = NodeState(
    gpus=(
        Gpu(
            0, GPU0, "NVIDIA A100-SXM4-40GB", 40960, True, True, True, minor=0,
            instances=(
                GpuInstance(1, "3g.20gb", 0, 4, (ComputeInstance(0, MIG_A, mig_index=0),)),
                GpuInstance(2, "3g.20gb", 4, 4, (ComputeInstance(0, MIG_B, mig_index=1),)),
            ),
        ),
        Gpu(1, GPU1, "NVIDIA A100-SXM4-40GB", 40960, True, False, False, minor=1),
    )
)  # fmt: skip
# The capability minors the driver gives each instance (gpu0/mig/gi<g>[/ci<c>]/access).
CAPS = {"gi1": 30, "gi1/ci0": 31, "gi2": 39, "gi2/ci0": 40}


def touch(path: Path, text: str = "", mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A driver root: libraries, nvidia-smi, control nodes, both GPUs' nodes, the MIG caps."""
    lib = tmp_path / LIB
    for name in ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler"):
        touch(lib / f"{name}.so.{VERSION}", "\x7fELF", 0o755)
        link(lib / f"{name}.so.1", f"{name}.so.{VERSION}")
    link(lib / "libcuda.so", "libcuda.so.1")  # the development link, the toolkit makes it too
    touch(tmp_path / "usr/bin/nvidia-smi", "#!", 0o755)
    for node in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1"):
        touch(tmp_path / "dev" / node)
    caps = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig"
    for where, minor in CAPS.items():
        touch(caps / where / "access", f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\n")
        touch(tmp_path / f"dev/nvidia-caps/nvidia-cap{minor}")
    return tmp_path


def inventory(*devices: Device) -> Inventory:
    return Inventory(resources=((ResourceName("nvidia.com/x"), devices),))


def whole(index: int = 1) -> Device:
    return Device(DeviceId(str(GPU1)), Health.HEALTHY, None, GPU1, index=str(index))


def mig(uuid: MigUuid, index: str) -> Device:
    return Device(DeviceId(uuid), Health.HEALTHY, None, GPU0, uuid, index=index)


def node(path: str) -> dict[str, str]:
    return {"path": path, "hostPath": f"{HOST}{path}", "permissions": "rw"}


def mount(path: str, host: str | None = None) -> dict[str, Any]:
    return {"containerPath": path, "hostPath": f"{HOST}{host or path}", "options": RO}


def lib(name: str) -> str:
    return f"/{LIB}/{name}"


COMMON: dict[str, Any] = {
    "env": ["NVIDIA_VISIBLE_DEVICES=void"],
    "deviceNodes": [node("/dev/nvidiactl"), node("/dev/nvidia-uvm"), node("/dev/nvidia-uvm-tools")],
    "mounts": [
        mount(lib("libcuda.so"), lib(f"libcuda.so.{VERSION}")),
        mount(lib("libcuda.so.1"), lib(f"libcuda.so.{VERSION}")),
        mount(lib(f"libcuda.so.{VERSION}")),
        mount(lib("libnvidia-ml.so.1"), lib(f"libnvidia-ml.so.{VERSION}")),
        mount(lib(f"libnvidia-ml.so.{VERSION}")),
        mount(lib("libnvidia-ptxjitcompiler.so.1"), lib(f"libnvidia-ptxjitcompiler.so.{VERSION}")),
        mount(lib(f"libnvidia-ptxjitcompiler.so.{VERSION}")),
        mount("/usr/bin/nvidia-smi"),
    ],
}


def spec(root: Path, *devices: Device, ids: DeviceIdStrategy = DeviceIdStrategy.UUID) -> dict[str, Any]:
    built = build_spec(inventory(*devices), NODE, DriverFiles(root, HOST), ids)
    assert built is not None
    return built


def entries(built: dict[str, Any]) -> dict[str, Any]:
    """Each device's own edits, by name."""
    return {d["name"]: d["containerEdits"] for d in built["devices"]}


def test_a_whole_gpu_gets_its_node_and_the_driver_in_the_common_edits(root: Path) -> None:
    assert {
        "cdiVersion": "0.6.0",
        "kind": "k8s.gpu-sharing.io/gpu",
        "devices": [
            {
                "name": GPU1,
                "containerEdits": {
                    "env": [f"GPU_SHARING_DEVICE_{GPU1.upper().replace('-', '_')}={GPU1}"],
                    "deviceNodes": [node("/dev/nvidia1")],
                },
            }
        ],
        "containerEdits": COMMON,
    } == spec(root, whole())


def test_a_mig_device_gets_its_gpus_node_and_its_own_capabilities_only(root: Path) -> None:
    edits = entries(spec(root, mig(MIG_A, "0:0"), mig(MIG_B, "0:1"), whole(), ids=DeviceIdStrategy.INDEX))
    assert {
        "0:0": [
            node("/dev/nvidia0"),
            node("/dev/nvidia-caps/nvidia-cap30"),
            node("/dev/nvidia-caps/nvidia-cap31"),
        ],
        "0:1": [
            node("/dev/nvidia0"),
            node("/dev/nvidia-caps/nvidia-cap39"),
            node("/dev/nvidia-caps/nvidia-cap40"),
        ],
        "1": [node("/dev/nvidia1")],
    } == {name: e["deviceNodes"] for name, e in edits.items()}
    assert [f"GPU_SHARING_DEVICE_0_0={MIG_A}"] == edits["0:0"]["env"]


def test_replicas_of_a_device_share_its_one_entry(root: Path) -> None:
    replicas = [
        Device(DeviceId(f"{MIG_A}::{n}"), Health.HEALTHY, None, GPU0, MIG_A, n, "0:0") for n in range(3)
    ]
    assert {
        MIG_A: {
            "env": [f"GPU_SHARING_DEVICE_{MIG_A.upper().replace('-', '_')}={MIG_A}"],
            "deviceNodes": [
                node("/dev/nvidia0"),
                node("/dev/nvidia-caps/nvidia-cap30"),
                node("/dev/nvidia-caps/nvidia-cap31"),
            ],
        }
    } == entries(spec(root, *replicas))


def test_a_library_the_driver_lacks_is_left_out(root: Path) -> None:
    (root / LIB / "libnvidia-ptxjitcompiler.so.1").unlink()
    (root / LIB / f"libnvidia-ptxjitcompiler.so.{VERSION}").unlink()
    (root / "usr/bin/nvidia-smi").unlink()
    (root / "dev/nvidia-uvm-tools").unlink()
    common = spec(root, whole())["containerEdits"]
    kept = [
        m for m in COMMON["mounts"] if not ("ptxjit" in m["containerPath"] or "smi" in m["containerPath"])
    ]
    assert kept == common["mounts"]
    assert [node("/dev/nvidiactl"), node("/dev/nvidia-uvm")] == common["deviceNodes"]


def test_a_root_without_a_driver_gives_devices_without_mounts(tmp_path: Path) -> None:
    built = build_spec(inventory(whole()), NODE, DriverFiles(tmp_path, HOST), DeviceIdStrategy.UUID)
    assert built is not None
    assert {"env": ["NVIDIA_VISIBLE_DEVICES=void"], "deviceNodes": [], "mounts": []} == built[
        "containerEdits"
    ]
    assert [] == entries(built)[GPU1]["deviceNodes"]


def test_only_the_version_the_links_lead_to_is_mounted(root: Path) -> None:
    lib_dir = root / LIB
    for name in ("libcuda", "libnvidia-ml"):  # an older driver's leftovers, named first
        touch(lib_dir / f"{name}.so.535.261.03", "\x7fELF", 0o755)
    touch(lib_dir / "libz.so.1.3", "\x7fELF")
    link(lib_dir / "libz.so.1", "libz.so.1.3")  # not the driver's
    assert COMMON["mounts"] == spec(root, whole())["containerEdits"]["mounts"]


def test_without_the_links_the_version_is_read_off_the_names(root: Path) -> None:
    for link_name in ("libcuda.so", "libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"):
        (root / LIB / link_name).unlink()
    versioned = [m for m in COMMON["mounts"] if m["containerPath"] == m["hostPath"].removeprefix(str(HOST))]
    assert versioned == spec(root, whole())["containerEdits"]["mounts"]


def test_an_absolute_link_is_followed_inside_the_driver_root(root: Path) -> None:
    (root / LIB / "libnvidia-ml.so.1").unlink()
    link(root / LIB / "libnvidia-ml.so.1", f"/{LIB}/libnvidia-ml.so.{VERSION}")
    assert COMMON["mounts"] == spec(root, whole())["containerEdits"]["mounts"]


def test_a_merged_usr_root_lists_each_library_once(root: Path) -> None:
    link(root / "lib", "usr/lib")  # /lib/x86_64-linux-gnu is /usr/lib/x86_64-linux-gnu
    assert COMMON["mounts"] == spec(root, whole())["containerEdits"]["mounts"]


def test_the_driver_root_mounted_at_its_node_path_names_the_same_paths(root: Path) -> None:
    files = DriverFiles(root)
    (nvidia1,) = files.for_gpu(NODE.gpus[1])
    assert ("/dev/nvidia1", str(root / "dev/nvidia1")) == (nvidia1.path, nvidia1.host_path)
    smi = next(f for f in files.mounts() if f.path == "/usr/bin/nvidia-smi")
    assert str(root / "usr/bin/nvidia-smi") == smi.host_path


def test_no_device_no_spec(root: Path, tmp_path: Path) -> None:
    assert build_spec(Inventory(), NODE, DriverFiles(root, HOST), DeviceIdStrategy.UUID) is None
    out = tmp_path / "cdi"
    assert write_spec(out, spec(root, whole()))
    assert not write_spec(out, spec(root, whole()))  # unchanged: not rewritten
    assert GPU1 == json.loads((out / SPEC_FILE).read_text())["devices"][0]["name"]
    assert write_spec(out, None)
    assert [] == os.listdir(out)
