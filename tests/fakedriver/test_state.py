"""The fake driver's state file: shared by processes, locked, counted, gated; and its files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from tests.fakedriver.conftest import REPO, Nvml, State, driver_env
from tests.polling import poll

A100 = "A100-SXM4-40GB"


def test_two_processes_see_each_others_changes(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(A100)
    one, two = nvml_for(machine), nvml_for(machine)
    gpu1, gpu2 = one.call("nvmlDeviceGetHandleByIndex", 0), two.call("nvmlDeviceGetHandleByIndex", 0)
    one.call("nvmlDeviceSetMigMode", gpu1, 1)
    assert two.call("nvmlDeviceGetMigMode", gpu2) == [1, 1]
    gi = two.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu2, 19, {"placement": [0, 1]})
    two.call("nvmlGpuInstanceCreateComputeInstance", gi, 0)
    uuid = two.call("nvmlDeviceGetUUID", two.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu2, 0))
    assert one.call("nvmlDeviceGetUUID", one.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu1, 0)) == uuid
    # The other process's instance is in the file every other tool reads too.
    (gpu,) = machine.read()["gpus"]
    assert gpu["gpuInstances"][0]["computeInstances"][0]["uuid"] == uuid


def test_changes_are_counted_as_the_simulator_counts_them(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    n.call("nvmlDeviceSetMigMode", gpu, 1)
    assert n.code("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, 9, {"placement": [1, 4]}) != 0
    n.call("nvmlDeviceGetMigMode", gpu)  # reads change nothing
    state = machine.read()
    assert (state["mutatingCalls"], state["mutations"]) == (2, 1)


def test_the_gate_holds_a_change_until_a_test_lets_it_through(
    driver_root: Path, machine: State, tmp_path: Path
) -> None:
    machine.init(A100)
    gate = tmp_path / "gate"
    n = Nvml(driver_root, machine, {**driver_env(driver_root, machine.path), "SHARING_SIM_GATE": str(gate)})
    try:
        n.call("nvmlInit")
        gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
        n.send("nvmlDeviceSetMigMode", gpu, 1)
        poll("the change waits at the gate", Path(f"{gate}.waiting").exists, bool)
        assert machine.read()["gpus"][0]["migCurrent"] == 0
        gate.touch()
        assert n.receive() == pynvml.NVML_SUCCESS
        assert machine.read()["gpus"][0]["migCurrent"] == 1
        assert not gate.exists()
        assert not Path(f"{gate}.waiting").exists()
    finally:
        n.close()


def test_the_state_is_found_from_the_driver_root_without_any_variable(
    driver_root: Path, machine: State
) -> None:
    """In a container the agent sets nothing: the library finds <root>/var/lib/fake-nvidia/gpus.json."""
    uuids = machine.init(A100)
    install = [str(REPO / "hack/fakedriver/build.sh"), "--install", str(machine.root)]
    subprocess.run(install, check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML")}
    n = Nvml(driver_root, machine, {**env, "LD_LIBRARY_PATH": str(machine.root / "usr/lib/x86_64-linux-gnu")})
    try:
        n.call("nvmlInit")
        assert n.call("nvmlDeviceGetUUID", n.call("nvmlDeviceGetHandleByIndex", 0)) == uuids[0]
    finally:
        n.close()
    # nvidia-smi finds its library (and so the GPUs) next to itself.
    smi = subprocess.run(
        [str(machine.root / "usr/bin/nvidia-smi"), "-L"], check=False, capture_output=True, text=True, env=env
    )
    assert smi.stdout.splitlines() == [f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {uuids[0]})"], smi.stderr


def test_device_files_follow_the_instances(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    machine.init(f"{A100}:2")
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 1)
    dev, caps = machine.root / "dev", machine.root / "proc/driver/nvidia/capabilities"
    root = os.geteuid() == 0  # mknod needs CAP_MKNOD; elsewhere the nodes are skipped quietly
    nodes = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1")
    assert all((dev / name).is_char_device() == root for name in nodes)
    n.call("nvmlDeviceSetMigMode", gpu, 1)
    gi = n.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, 19, {"placement": [0, 1]})
    ci = n.call("nvmlGpuInstanceCreateComputeInstance", gi, 0)
    # /proc/driver/nvidia-caps/mig-minors: GPU 1's GI 0 is minor 3 + 135, its CI 0 the next.
    assert (caps / "gpu1/mig/gi0/access").read_text().startswith("DeviceFileMinor: 138\n")
    assert (caps / "gpu1/mig/gi0/ci0/access").read_text().startswith("DeviceFileMinor: 139\n")
    assert (dev / "nvidia-caps/nvidia-cap138").is_char_device() == root
    n.call("nvmlComputeInstanceDestroy", ci)
    n.call("nvmlGpuInstanceDestroy", gi)
    assert not (caps / "gpu1/mig/gi0").exists()
    assert not (dev / "nvidia-caps/nvidia-cap138").exists()


# r580: the profiles are read before MIG is on (r535: tests/fakedriver/test_defects.py).
@pytest.mark.parametrize("machine", ["r580"], indirect=True)
def test_the_agents_backend_over_the_real_pynvml(driver_root: Path, machine: State) -> None:
    """NvmlBackend as the agent opens it (open_nvml over a driver root: the real pynvml) observes,
    creates and destroys on the fake driver, with nothing in its environment about the driver."""
    machine.init(f"{A100},T4")
    installed = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh"), "--install", str(machine.root)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    script = """
import asyncio, json, sys
from pathlib import Path
from sharing.mig import default_catalog
from sharing.gpu.nvml import open_nvml

async def main():
    backend = open_nvml(default_catalog(), Path(sys.argv[1]))
    before = await backend.observe()
    a100 = before.gpus[0]
    await backend.set_mig_mode(a100.uuid, True)
    made = await backend.create_instance(a100.uuid, "3g.20gb", 4)
    after = await backend.observe()
    gpu = after.gpus[0]
    files = backend.device_files.for_mig(gpu, gpu.instances[0], gpu.instances[0].compute_instances[0])
    await backend.destroy_instance(a100.uuid, made.id)
    final = await backend.observe()
    await backend.close()
    print(json.dumps({
        "products": [g.product for g in before.gpus], "mig_capable": [g.mig_capable for g in before.gpus],
        "profiles": [p.name for p in a100.profiles.profiles], "created": [made.profile, made.start],
        "observed": [[i.profile, i.start, i.compute_instances[0].uuid] for i in gpu.instances],
        "files": [f.host_path for f in files], "final": len(final.gpus[0].instances),
        "driver": final.driver.version,
    }))

asyncio.run(main())
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(machine.root)],
        capture_output=True, text=True, check=False, cwd=REPO,
        env={k: v for k, v in driver_env(driver_root, machine.path).items()
             if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_STATE", "FAKE_NVML_ROOT")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["products"] == ["NVIDIA A100-SXM4-40GB", "Tesla T4"]
    assert seen["mig_capable"] == [True, False]
    assert "1g.5gb" in seen["profiles"]
    assert "7g.40gb" in seen["profiles"]
    assert seen["created"] == ["3g.20gb", 4]
    ((profile, start, uuid),) = seen["observed"]
    assert (profile, start) == ("3g.20gb", 4)
    assert uuid.startswith("MIG-")
    assert seen["files"][0] == str(machine.root / "dev/nvidia0")
    assert len(seen["files"]) == (3 if os.geteuid() == 0 else 1)
    assert (seen["final"], seen["driver"]) == (0, "580.65.06")


@pytest.mark.parametrize("machine", ["r580"], indirect=True)
def test_a_state_file_without_the_new_fields_plays_the_current_branch(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    machine.edit(lambda s: s.pop("personality"))  # as `sharing sim init` writes it
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    assert n.call("nvmlDeviceGetGpuInstanceProfileInfo", gpu, 0)["name"] == "MIG 1g.5gb"  # MIG still off
    assert n.call("nvmlSystemGetDriverVersion") == "580.65.06"
