"""XID and recovery events through the fake driver's event sets."""

from __future__ import annotations

from collections.abc import Callable

import pynvml
import pytest

from tests.fakedriver.conftest import Nvml, State

A100 = "A100-SXM4-40GB"
XID = pynvml.nvmlEventTypeXidCriticalError
RECOVERY = pynvml.nvmlEventTypeGpuRecoveryAction
NA = 0xFFFFFFFF


@pytest.mark.parametrize("machine", ["r580"], indirect=True)
def test_an_xid_on_a_gpu_and_on_a_mig_device(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    (uuid,) = machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    n.call("nvmlDeviceSetMigMode", gpu, 1)
    gi = n.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, 19, {"placement": [3, 1]})
    n.call("nvmlGpuInstanceCreateComputeInstance", gi, 0)
    mig = n.call("nvmlDeviceGetUUID", n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0))
    events = n.call("nvmlEventSetCreate")
    n.call("nvmlDeviceRegisterEvents", gpu, XID | RECOVERY, events)
    assert n.code("nvmlEventSetWait", events, 0) == pynvml.NVML_ERROR_TIMEOUT
    machine.sim("xid", "--uuid", uuid, "--xid", "79")
    machine.sim("xid", "--uuid", mig, "--xid", "94")
    first, second = n.call("nvmlEventSetWait", events, 1000), n.call("nvmlEventSetWait", events, 1000)
    assert (first["device"], first["eventType"], first["eventData"]) == (gpu, XID, 79)
    assert (first["gpuInstanceId"], first["computeInstanceId"]) == (NA, NA)
    gi_id = n.call("nvmlGpuInstanceGetInfo", gi)["id"]
    assert (second["eventData"], second["gpuInstanceId"], second["computeInstanceId"]) == (94, gi_id, 0)
    n.call("nvmlEventSetFree", events)
    assert n.code("nvmlEventSetWait", events, 0) == pynvml.NVML_ERROR_INVALID_ARGUMENT


@pytest.mark.parametrize("machine", ["r580"], indirect=True)
def test_a_reset_reports_that_no_recovery_action_is_needed(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    (uuid,) = machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    events = n.call("nvmlEventSetCreate")
    n.call("nvmlDeviceRegisterEvents", gpu, XID | RECOVERY, events)
    machine.sim("reset", "--uuid", uuid)
    event = n.call("nvmlEventSetWait", events, 1000)
    assert (event["eventType"], event["eventData"]) == (RECOVERY, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)


def test_events_before_registration_are_not_recorded(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    (uuid,) = machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    events = n.call("nvmlEventSetCreate")
    machine.sim("xid", "--uuid", uuid, "--xid", "48")
    n.call("nvmlDeviceRegisterEvents", gpu, XID, events)
    assert n.code("nvmlEventSetWait", events, 0) == pynvml.NVML_ERROR_TIMEOUT


@pytest.mark.parametrize("machine", ["r535"], indirect=True)
def test_the_old_branch_has_no_recovery_events(nvml_for: Callable[[State], Nvml], machine: State) -> None:
    (uuid,) = machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    events = n.call("nvmlEventSetCreate")
    assert n.code("nvmlDeviceRegisterEvents", gpu, XID | RECOVERY, events) == pynvml.NVML_ERROR_NOT_SUPPORTED
    n.call("nvmlDeviceRegisterEvents", gpu, XID, events)  # "event set can still be used"
    machine.sim("reset", "--uuid", uuid)
    machine.sim("xid", "--uuid", uuid, "--xid", "79")
    assert n.call("nvmlEventSetWait", events, 1000)["eventType"] == XID


def test_events_are_registered_on_gpus_not_mig_devices(
    nvml_for: Callable[[State], Nvml], machine: State
) -> None:
    machine.init(A100)
    n = nvml_for(machine)
    gpu = n.call("nvmlDeviceGetHandleByIndex", 0)
    n.call("nvmlDeviceSetMigMode", gpu, 1)
    gi = n.call("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, 19, {"placement": [0, 1]})
    n.call("nvmlGpuInstanceCreateComputeInstance", gi, 0)
    mig = n.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, 0)
    events = n.call("nvmlEventSetCreate")
    assert n.code("nvmlDeviceRegisterEvents", mig, XID, events) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert n.code("nvmlDeviceRegisterEvents", gpu, 1 << 40, events) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    machine.sim("lost", "--gpu", "0")
    assert n.code("nvmlDeviceRegisterEvents", gpu, XID, events) == pynvml.NVML_ERROR_GPU_IS_LOST
