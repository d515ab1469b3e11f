"""What a config should give on the simulated hardware, computed from the test's own description of it.

`Wanted` says per GPU index what the test means a config to do; the expectation is derived from it
and the hardware, never by the agent's parser, so the two can be wrong only in different ways.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from tests.e2e.invariants import GPU, MIG_PREFIX, REPLICA, SHARED, Hardware


@dataclass(frozen=True)
class GpuWant:
    """What one GPU should be: MIG instances (None: MIG off) and replicas per kind (`gpu` or profile)."""

    mig: Mapping[str, int] | None = None
    replicas: Mapping[str, int] = field(default_factory=dict)

    def replicas_of(self, kind: str) -> int:
        return self.replicas.get(kind, self.replicas.get("*", 1))


@dataclass(frozen=True)
class Wanted:
    """A config as the test means it, per GPU index (`render` writes the ones the test owns)."""

    name: str
    gpus: tuple[GpuWant, ...]
    rename: bool = False
    strategy: str = "mixed"

    def render(self) -> str:
        """The config as a native YAML document: one rule per GPU index."""
        lines = [
            "version: v1",
            f"migStrategy: {self.strategy}",
            "sharing:",
            f"  renameByDefault: {str(self.rename).lower()}",
            "gpus:",
        ]
        for index, want in enumerate(self.gpus):
            lines.append(f"  - devices: [{index}]")
            if want.mig is None:
                lines.append("    mig: disabled")
            else:
                lines.append("    mig: {" + ", ".join(f"{p}: {n}" for p, n in sorted(want.mig.items())) + "}")
            if set(want.replicas) == {"*"}:
                lines.append(f"    replicas: {want.replicas['*']}")
            elif want.replicas:
                lines.append(
                    "    replicas: {" + ", ".join(f"{k}: {n}" for k, n in sorted(want.replicas.items())) + "}"
                )
        return "\n".join(lines) + "\n"


def layout_problems(want: Wanted, hw: Hardware) -> list[str]:
    """How the hardware differs from the layout the config asks for."""
    found = []
    for gpu, w in zip(hw.gpus, want.gpus, strict=True):
        if w.mig is None:
            if gpu.mig:
                found.append(f"GPU {gpu.index} is in MIG mode; {want.name} wants it whole")
            continue
        have = sorted(gpu.devices.values())
        wanted = sorted(p for p, n in w.mig.items() for _ in range(n))
        if not gpu.mig or have != wanted:
            found.append(f"GPU {gpu.index} has {have if gpu.mig else 'MIG off'}; {want.name} wants {wanted}")
    return found


def expected_devices(want: Wanted, hw: Hardware) -> dict[str, set[str]]:
    """{resource: device IDs} the node should advertise once the config is applied to `hw`."""
    found: dict[str, set[str]] = defaultdict(set)

    def add(resource: str, uuid: str, replicas: int) -> None:
        if replicas <= 1:
            found[resource].add(uuid)
            return
        shared = resource + SHARED if want.rename else resource
        found[shared].update(f"{uuid}{REPLICA}{n}" for n in range(replicas))

    for gpu, w in zip(hw.gpus, want.gpus, strict=True):
        if not gpu.mig:
            add(GPU, gpu.uuid, w.replicas_of("gpu"))
        elif want.strategy != "none":
            for uuid, profile in gpu.devices.items():
                add(MIG_PREFIX + profile.replace("+", "."), uuid, w.replicas_of(profile))
    return dict(found)


# --- the configs the soak walks between -------------------------------------------------------

W = GpuWant
A100_BALANCED = W({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})


def _fleet(a100: GpuWant, h100: GpuWant) -> tuple[GpuWant, ...]:
    """The node of the `gpu_node` fixture: GPUs 0-1 A100-SXM4-40GB, GPUs 2-3 H100 80GB HBM3."""
    return (a100, a100, h100, h100)


PRESETS = (
    Wanted("all-1g", _fleet(W({"1g.5gb": 7}), W({"1g.10gb": 7}))),
    Wanted("all-3g", _fleet(W({"3g.20gb": 2}), W({"3g.40gb": 2}))),
    Wanted("all-balanced", _fleet(A100_BALANCED, W({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}))),
    Wanted("all-replicas-2", _fleet(W(None, {"*": 2}), W(None, {"*": 2})), strategy="none"),
    Wanted("a100-mig-h100-time-sliced", _fleet(A100_BALANCED, W(None, {"*": 4}))),
    Wanted("all-disabled", _fleet(W(None), W(None))),
)
OWN = (
    # Replicas of MIG devices, per profile and per GPU, beside a time-sliced whole GPU.
    Wanted(
        "soak-mig-replicas",
        (
            W({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}, {"1g.5gb": 2, "3g.20gb": 3}),
            W({"2g.10gb": 3}, {"*": 2}),
            W({"3g.40gb": 2}, {"*": 2}),
            W(None, {"*": 3}),
        ),
    ),
    # renameByDefault: replicas under `.shared` names, beside the same kinds unshared.
    Wanted(
        "soak-renamed",
        (W({"3g.20gb": 2}, {"*": 2}), W(None, {"*": 2}), W(None), W({"1g.10gb": 7})),
        rename=True,
    ),
)
EDITED = "soak-edit"
EDITS = (
    Wanted(EDITED, _fleet(W(None, {"*": 2}), W(None, {"*": 2}))),
    Wanted(EDITED, _fleet(W(None, {"*": 3}), W(None))),
    Wanted(
        EDITED,
        (
            W({"4g.20gb": 1, "3g.20gb": 1}),
            W({"1g.5gb+me": 1, "1g.5gb": 6}),
            W({"7g.80gb": 1}, {"*": 2}),
            W({"1g.20gb": 4}),
        ),
    ),
    Wanted(EDITED, _fleet(W({"2g.10gb": 3}, {"2g.10gb": 2}), W(None, {"*": 2}))),
    None,  # an edit that breaks the config: the node keeps its last good state
)
BROKEN = "version: v1\ngpus:\n  - devices: all\n    replicas: 0\n"
MISSING = "soak-no-such-config"
