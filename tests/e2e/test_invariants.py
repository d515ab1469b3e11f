"""The soak's judges catch what they are meant to catch (a judge that cannot fail proves nothing).

Pure: no cluster. One A100 in MIG mode (a 3g.20gb, a 2g.10gb, two 1g.5gb) and one whole H100.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.invariants import GpuHw, Hardware, violations
from tests.e2e.wanted import GpuWant, Wanted, expected_devices

A100 = "GPU-a100"
H100 = "GPU-h100"
G3, G2, G1A, G1B = "MIG-3g", "MIG-2g", "MIG-1ga", "MIG-1gb"
HW = Hardware(
    (
        GpuHw(0, A100, "A100-SXM4-40GB", True, {G3: "3g.20gb", G2: "2g.10gb", G1A: "1g.5gb", G1B: "1g.5gb"}),
        GpuHw(1, H100, "H100-80GB-HBM3", False, {}),
    )
)


def pod(name: str, **devices: list[str]) -> dict[str, Any]:
    """A harness `/pods` entry; keyword `mig_1g_5gb` means resource `nvidia.com/mig-1g.5gb`."""
    named = {"nvidia.com/" + k.replace("_", "-", 1).replace("_", "."): v for k, v in devices.items()}
    return {"namespace": "default", "name": name, "containers": [{"name": "main", "devices": named}]}


@pytest.mark.parametrize(
    ("offered", "pods", "busy", "expected"),
    [
        ({"nvidia.com/mig-3g.20gb": [G3], "nvidia.com/gpu": [f"{H100}::0", f"{H100}::1"]}, [], {}, []),
        ({"nvidia.com/gpu": [A100]}, [], {}, [f"offers nvidia.com/gpu {A100}, but that GPU is in MIG mode"]),
        (
            {"nvidia.com/mig-3g.20gb": [G2]},
            [],
            {},
            [f"{G2}, but it is a 2g.10gb on the hardware, not a 3g.20gb"],
        ),
        (
            {"nvidia.com/mig-1g.5gb.shared": ["MIG-gone::0"]},
            [],
            {},
            ["offers nvidia.com/mig-1g.5gb.shared MIG-gone::0, but no such MIG device exists"],
        ),
        (
            {},
            [pod("a", mig_1g_5gb=["MIG-gone"])],
            {},
            ["default/a holds nvidia.com/mig-1g.5gb MIG-gone, but no"],
        ),
        (
            {},
            [pod("a", gpu=[f"{H100}::0"]), pod("b", gpu=[f"{H100}::0"])],
            {},
            [f"device ID {H100}::0 is held by pods ['default/a', 'default/b']"],
        ),
        ({}, [pod("a", gpu=[f"{H100}::0"]), pod("b", gpu=[f"{H100}::1"])], {}, []),
        (
            {},
            [pod("a", mig_3g_20gb=[G3]), pod("b", mig_3g_20gb=[f"{G3}::0"])],
            {},
            [f"{G3} is held exclusively by default/a and also by ['default/b']"],
        ),
        ({}, [], {G1A: "1g.5gb", H100: "gpu"}, []),
        ({}, [], {"MIG-gone": "1g.5gb"}, ["MIG-gone runs processes as a 1g.5gb, but it is now gone"]),
    ],
    ids=[
        "all-well",
        "gpu-in-mig-mode-offered-whole",
        "wrong-profile",
        "destroyed-replica-offered",
        "held-device-destroyed",
        "same-id-two-pods",
        "two-replicas-two-pods",
        "exclusive-and-replica",
        "busy-devices-intact",
        "busy-device-destroyed",
    ],
)
def test_violations(
    offered: dict[str, list[str]], pods: list[dict[str, Any]], busy: dict[str, str], expected: list[str]
) -> None:
    """Each violation found, and only those (`expected`: a telling part of each message)."""
    found = violations(HW, offered, pods, busy)
    assert len(expected) == len(found), found
    for part, message in zip(expected, found, strict=True):
        assert part in message


def test_expected_devices_follow_replicas_and_rename() -> None:
    want = Wanted("x", (GpuWant({"3g.20gb": 1}, {"1g.5gb": 2}), GpuWant(None, {"*": 2})), rename=True)
    assert {
        "nvidia.com/mig-3g.20gb": {G3},
        "nvidia.com/mig-2g.10gb": {G2},
        "nvidia.com/mig-1g.5gb.shared": {f"{G1A}::0", f"{G1A}::1", f"{G1B}::0", f"{G1B}::1"},
        "nvidia.com/gpu.shared": {f"{H100}::0", f"{H100}::1"},
    } == expected_devices(want, HW)
