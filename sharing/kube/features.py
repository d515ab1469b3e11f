"""What the cluster's API server keeps of the ResourceSlice fields the agent publishes: asked once.

A kube-apiserver whose feature gate is off drops the fields the gate guards from every ResourceSlice
it is given, without an error (`dropDisabledFields` in k8s.io/kubernetes
pkg/registry/resource/resourceslice/strategy.go, run by `PrepareForCreate`). Kubernetes 1.34 has all
three gates below off by default (alpha; pkg/features/kube_features.go of v1.34.4); 1.36 turns them on.
So the agent asks before it needs them: two ResourceSlices of its own pool, created with
`dryRun=All` (validated, admitted, never stored), come back as the API server would store them, and
a field missing from the answer names a gate that is off. Neither the discovery document nor the
OpenAPI schema tells: both list the fields whatever the gates say.
"""

from __future__ import annotations

from dataclasses import dataclass

from sharing.kube.api import (
    Capacity,
    CounterSet,
    DeviceTaint,
    KubeClient,
    RequestPolicy,
    SliceDevice,
    SliceSpec,
)

PARTITIONABLE = "DRAPartitionableDevices"
"""Counter sets and what a device consumes of them (KEP-4815): the on-demand MIG devices of `mig: dynamic`."""
TAINTS = "DRADeviceTaints"
"""Device taints (KEP-5055): an XID or a lost GPU keeps new claims off its devices."""
CONSUMABLE = "DRAConsumableCapacity"
"""`allowMultipleAllocations` and capacity request policies (KEP-5075): a time-sliced or MPS GPU
allocated to several claims at once."""

LOST = {
    PARTITIONABLE: "mig: dynamic (on-demand MIG devices) is refused",
    TAINTS: "an unhealthy GPU's devices are not tainted (new claims may be allocated them)",
    CONSUMABLE: "a shared GPU is allocated to one claim at a time",
}
"""What the agent cannot offer without each gate."""

PROBE = "gpu-sharing-probe"


@dataclass(frozen=True, slots=True)
class ClusterFeatures:
    """The gates the API server was seen to have off (`missing`); `known` False while not asked yet."""

    missing: frozenset[str] = frozenset()
    known: bool = False

    def lacks(self, gate: str) -> bool:
        """The API server was seen to drop the fields of `gate`."""
        return self.known and gate in self.missing


def probes(driver: str, node: str) -> tuple[SliceSpec, SliceSpec]:
    """The two slices that ask: a counter set alone (since 1.35 a slice holds counter sets or devices,
    never both), and one device with a taint, `allowMultipleAllocations` and a request policy."""
    counters = SliceSpec(
        driver, node, node, 1, 1, (), shared_counters=(CounterSet(PROBE, (("memory", "1"),)),)
    )
    device = SliceDevice(
        PROBE,
        capacity=(("memory", Capacity("1", RequestPolicy(default="1", min="1"))),),
        taints=(DeviceTaint(f"gpu.nvidia.com/{PROBE}", "", "NoSchedule"),),
        allow_multiple_allocations=True,
    )
    return counters, SliceSpec(driver, node, node, 1, 1, (device,))


def missing_gates(answers: tuple[SliceSpec, SliceSpec]) -> frozenset[str]:
    """The gates whose fields the API server left out of its answers to `probes`."""
    counters, device = answers
    missing = set()
    if not counters.shared_counters:
        missing.add(PARTITIONABLE)
    back = device.devices[0] if device.devices else SliceDevice(PROBE)
    if not back.taints:
        missing.add(TAINTS)
    if not back.allow_multiple_allocations or not any(c.policy for _, c in back.capacity):
        missing.add(CONSUMABLE)
    return frozenset(missing)


def probe(kube: KubeClient, driver: str, node: str) -> ClusterFeatures:
    """Ask the API server (blocking: three requests, nothing stored); raises KubeError."""
    owner = kube.get_node(node)
    counters, device = (kube.dry_run_resource_slice(p, owner).spec for p in probes(driver, node))
    return ClusterFeatures(missing_gates((counters, device)), known=True)


def described(missing: frozenset[str]) -> str:
    """One line for the log: each gate that is off and what it takes away."""
    return "; ".join(f"{gate} off: {LOST[gate]}" for gate in sorted(missing))
