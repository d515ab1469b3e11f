"""The fake driver's GPUs as the hardware has them, read from its state file on the host: for tests
that watch what the hardware does (instances made, destroyed) without starting `sharing export` in
the agent's pod for every look (a kubectl process and the command: 0.8 CPU-s a poll)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sharing.gpu import simstate
from sharing.mig.observed import device_profile
from sharing.model import ComputeInstance, GpuInstance


def mig_devices(state: Path, product: str | None = None) -> dict[int, list[dict[str, Any]]]:
    """{GPU index: its MIG devices} of the GPUs in MIG mode (of `product` only, `NVIDIA
    A100-SXM4-40GB`, where given): each device's profile (as `sharing export` names it: `1c.3g.20gb`
    for a compute instance smaller than its GPU instance), start slot and UUID; a GPU instance without
    a compute instance is one row, its UUID None, as `export` shows it."""
    found = {}
    for gpu in simstate.read(state)["gpus"]:
        if gpu["migCurrent"] != 1 or product not in (None, gpu["name"]):
            continue
        names = {p["id"]: p["name"] for p in gpu["mig"]["profiles"]}
        rows = []
        for raw in gpu["gpuInstances"]:
            gi = GpuInstance(raw["id"], names[raw["profileId"]], raw["start"], raw["size"])
            for ci in raw["computeInstances"]:
                profile = device_profile(gi, ComputeInstance(ci["id"], ci["uuid"], slices=ci["size"]))
                rows.append({"profile": profile, "start": gi.start, "uuid": ci["uuid"]})
            if not raw["computeInstances"]:
                rows.append({"profile": gi.profile, "start": gi.start, "uuid": None})
        found[gpu["index"]] = rows
    return found
