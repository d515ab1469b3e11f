"""On-demand MIG devices through the DRA plugin: real sockets, claims in a real kube-apiserver, GPUs
from the fake driver under the real pynvml.

The node's plugin runs as its own process (tests/integration/dra_node.py), so a test can kill it
where an agent dies: before a prepare, after the GPU instance of a prepare (the fake driver's
SHARING_SIM_CRASH_AFTER=1 exits 137 right after its first hardware change), after its compute
instance (=2). Claims are allocated as the scheduler allocates them (`status.allocation` through the
status subresource) to the device names of on-demand slices, `gpu-<i>-mig-<profile>-at-<start>`.
What the GPUs really have is read from the fake driver's own state file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import lab
import pytest
from lab.deadlines import scaled

from sharing.dra.names import DRIVER, ondemand_device_name
from sharing.gpu import simstate
from sharing.kubelet.api import dra_v1_pb2 as dra
from sharing.kubelet.api import dra_v1_pb2_grpc as dra_grpc
from sharing.kubelet.api import drahealth_v1alpha1_pb2 as health
from sharing.kubelet.api import drahealth_v1alpha1_pb2_grpc as health_grpc
from sharing.mig.catalog import default_catalog
from tests.apiserver import allocated_claim
from tests.fakedriver.test_mps import record_of
from tests.polling import poll

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NODE_SCRIPT = Path(__file__).with_name("dra_node.py")
CDI_KIND = "k8s.gpu.nvidia.com/claim"
PROFILE_ID = {"1g.5gb": 19, "2g.10gb": 14, "3g.20gb": 9, "4g.20gb": 5, "7g.40gb": 0}
"""nvidia-smi IDs of the A100-SXM4-40GB profiles (NVIDIA MIG user guide, supported profiles)."""


@pytest.fixture(scope="module")
def fake_driver() -> Path:
    built = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh")], capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, built.stderr
    return Path(built.stdout.strip())


@dataclass
class Node:
    """One node: its driver root (the fake driver's state), its kubelet directories, its plugin process."""

    name: str
    root: Path
    kubeconfig: Path
    kubelet: Path
    """The kubelet's directories (short: a unix socket path has at most 107 characters)."""
    process: asyncio.subprocess.Process | None = None

    @property
    def state(self) -> Path:
        return self.root / "var/lib/fake-nvidia/gpus.json"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet / "plugins"

    @property
    def socket(self) -> Path:
        """The DRA socket of the plugin process running now (each process has its own)."""
        sockets = sorted((self.plugins_dir / DRIVER).glob("dra-*.sock"), key=lambda p: p.stat().st_mtime)
        assert sockets, f"no DRA socket in {self.plugins_dir / DRIVER}"
        return sockets[-1]

    @property
    def journal(self) -> Path:
        return self.root / "var/lib/gpu-sharing/store/journal.jsonl"

    @property
    def cdi(self) -> Path:
        return self.root / "var/run/cdi"

    @property
    def mps_root(self) -> Path:
        """mpsRoot (short: a daemon's control socket is <root>/<MIG UUID>/pipe/control)."""
        return self.kubelet / "mps"

    def checkpoint(self) -> dict[str, Any]:
        claims: dict[str, Any] = json.loads((self.plugins_dir / DRIVER / "claims.json").read_text())["claims"]
        return claims

    def gpus(self) -> list[dict[str, Any]]:
        gpus: list[dict[str, Any]] = json.loads(self.state.read_text())["gpus"]
        return gpus

    def instances(self) -> list[list[tuple[int, int, int]]]:
        """Per GPU, (profile id, start, size) of each GPU instance, as the fake driver has them."""
        return [
            sorted((g["profileId"], g["start"], g["size"]) for g in gpu["gpuInstances"])
            for gpu in self.gpus()
        ]

    def mutations(self) -> int:
        return simstate.counters(self.state).mutations

    async def start(self, crash_after: int | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARING_", "FAKE_NVML"))}
        env["PYTHONPATH"] = str(REPO)
        if crash_after is not None:
            env["SHARING_SIM_CRASH_AFTER"] = str(crash_after)
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, str(NODE_SCRIPT), "--driver-root", str(self.root),
            "--kubeconfig", str(self.kubeconfig), "--node", self.name,
            "--plugins-dir", str(self.plugins_dir), "--registry-dir", str(self.kubelet / "plugins_registry"),
            "--cdi-dir", str(self.cdi), "--journal", str(self.journal), "--mps-root", str(self.mps_root),
            env=env, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.process.stdout is not None
        while (line := await asyncio.wait_for(self.process.stdout.readline(), scaled(60))) != b"serving\n":
            assert line, f"the node's plugin did not start (exit {await self.process.wait()})"

    async def stop(self) -> int:
        """SIGTERM, or nothing if it died; its exit status."""
        assert self.process is not None
        if self.process.returncode is None:
            self.process.terminate()
        code = await asyncio.wait_for(self.process.wait(), scaled(60))
        self.process = None
        return code

    async def killed(self) -> int:
        """It died by itself (the fake driver's crash hook): its exit status."""
        assert self.process is not None
        code = await asyncio.wait_for(self.process.wait(), scaled(60))
        self.process = None
        return code

    async def kubelet_prepare(self, *claims: dict[str, Any]) -> dict[str, Any]:
        """A fresh kubelet's plugin watcher and DRA manager (hack/go/k8s/dra-kubelet) preparing claims."""
        refs = [
            a
            for c in claims
            for a in ("--prepare", "/".join(c["metadata"][k] for k in ("namespace", "name", "uid")))
        ]
        process = await asyncio.create_subprocess_exec(
            str(lab.binaries().dra_kubelet), "--registry-dir", str(self.kubelet / "plugins_registry"),
            "--kubeconfig", str(self.kubeconfig), "--node", self.name, "--driver", DRIVER, *refs,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), scaled(60))
        assert 0 == process.returncode, err.decode()[-2000:]
        return dict(json.loads(out))

    async def prepare(self, *claims: dict[str, Any]) -> dict[str, Any]:
        async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
            answer = await dra_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=[_claim(c) for c in claims]), timeout=30
            )
        return {
            uid: {"error": r.error, "devices": [(d.device_name, list(d.cdi_device_ids)) for d in r.devices]}
            for uid, r in answer.claims.items()
        }

    async def unprepare(self, *claims: dict[str, Any]) -> dict[str, str]:
        async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
            answer = await dra_grpc.DRAPluginStub(channel).NodeUnprepareResources(
                dra.NodeUnprepareResourcesRequest(claims=[_claim(c) for c in claims]), timeout=30
            )
        return {uid: r.error for uid, r in answer.claims.items()}

    async def health(self, wanted: dict[str, int]) -> dict[str, int]:
        """The health stream's devices once it reports `wanted` ({device: HealthStatus})."""
        async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health.NodeWatchResourcesRequest(), timeout=30
            )
            got: dict[str, int] = {}
            async for answer in stream:
                got = {d.device.device_name: d.health for d in answer.devices}
                if got == wanted:
                    break
            stream.cancel()
        return got


def _claim(obj: dict[str, Any]) -> dra.Claim:
    meta = obj["metadata"]
    return dra.Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


@pytest.fixture
async def node(tmp_path: Path, control_plane: lab.ControlPlane, fake_driver: Path) -> AsyncIterator[Node]:
    """A node with two A100-SXM4-40GB in MIG mode and no instances (a dynamic node), plugin not started."""
    root = tmp_path / "node"
    done = subprocess.run(
        [str(REPO / "hack/fakedriver/build.sh"), "--install", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    catalog = default_catalog()
    simstate.init_state(
        root / "var/lib/fake-nvidia/gpus.json", [simstate.resolve_product(catalog, "A100-SXM4-40GB")] * 2
    )
    with simstate.editing(root / "var/lib/fake-nvidia/gpus.json") as state:
        for gpu in state["gpus"]:
            gpu["migCurrent"] = gpu["migPending"] = 1
    kubelet = Path(tempfile.mkdtemp(prefix="od-"))
    n = Node(f"node-{uuid.uuid4().hex[:6]}", root, control_plane.kubeconfig, kubelet)
    yield n
    if n.process is not None:
        await n.stop()
    for pipe in n.mps_root.glob("*/pipe"):  # daemons a failed test left
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
        control = root / "usr/bin/nvidia-cuda-mps-control"
        subprocess.run([str(control)], input=b"quit\n", env=env, capture_output=True, timeout=30, check=False)
    shutil.rmtree(kubelet, ignore_errors=True)


def allocated(
    cp: lab.ControlPlane, namespace: str, name: str, node: str, *devices: str, config: Any = None
) -> dict[str, Any]:
    """A claim for MIG devices, allocated as the scheduler allocates on-demand devices (with the opaque
    `config` parameters of our driver for its request, as the scheduler copies them)."""
    claim = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com",
                                                                      "count": len(devices)}}]}},
    }  # fmt: skip
    results = [{"request": "mig", "driver": DRIVER, "pool": node, "device": d} for d in devices]
    status: dict[str, Any] = {"status": {"allocation": {"devices": {"results": results}}}}
    if config is not None:
        opaque = {"driver": DRIVER, "parameters": config}
        status["status"]["allocation"]["devices"]["config"] = [
            {"source": "FromClaim", "requests": ["mig"], "opaque": opaque}
        ]
    return allocated_claim(cp, claim, status)


def uid_of(claim: dict[str, Any]) -> str:
    return str(claim["metadata"]["uid"])


def served(node: Node, claim: dict[str, Any], *devices: str) -> dict[str, Any]:
    """The answer of a prepare that served the claim's on-demand devices."""
    uid = uid_of(claim)
    return {uid: {"error": "", "devices": [(d, [f"{CDI_KIND}={uid}-{d}"]) for d in devices]}}


def owned(node: Node, claim: dict[str, Any]) -> list[tuple[int, int, int, str]]:
    """(GPU index, profile id, start, MIG UUID) of what the checkpoint says the claim owns, checked
    against the fake driver: the GPU instance and compute instance the checkpoint names are there."""
    found = []
    by_uuid = {g["uuid"]: g for g in node.gpus()}
    for d in node.checkpoint()[uid_of(claim)]["devices"]:
        i = d["instance"]
        gpu = by_uuid[i["gpuUUID"]]
        gi = next(g for g in gpu["gpuInstances"] if g["id"] == i["gpuInstance"])
        ci = next(c for c in gi["computeInstances"] if c["id"] == i["computeInstance"])
        assert (gi["start"], gi["size"], ci["uuid"]) == (i["start"], i["size"], d["uuid"])
        found.append((gpu["index"], gi["profileId"], gi["start"], ci["uuid"]))
    return found


def spec_device(node: Node, claim: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    """(CDI name, env, device node paths) of the one device in the claim's CDI spec."""
    spec = json.loads((node.cdi / f"k8s.gpu.nvidia.com-claim_{uid_of(claim)}.json").read_text())
    [device] = spec["devices"]
    edits = device["containerEdits"]
    return device["name"], edits["env"], [d["path"] for d in edits["deviceNodes"]]


async def test_prepare_makes_the_allocated_instance_and_unprepare_destroys_it(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    device = ondemand_device_name(0, "3g.20gb", 4)
    claim = allocated(control_plane, namespace, "a", node.name, device)

    assert served(node, claim, device) == await node.prepare(claim)
    assert [[(9, 4, 4)], []] == node.instances()
    [(gpu, profile, start, mig)] = owned(node, claim)
    gi = node.checkpoint()[uid_of(claim)]["devices"][0]["instance"]["gpuInstance"]
    caps = node.root / f"proc/driver/nvidia/capabilities/gpu0/mig/gi{gi}"
    minors = [
        (caps / rel).read_text().split("DeviceFileMinor:")[1].split()[0] for rel in ("access", "ci0/access")
    ]
    suffix = f"{uid_of(claim)}-{device}".upper().replace("-", "_")
    assert (
        (0, 9, 4),
        (
            f"{uid_of(claim)}-{device}",
            [f"GPU_SHARING_DEVICE_{suffix}={mig}"],
            ["/dev/nvidia0", *(f"/dev/nvidia-caps/nvidia-cap{m}" for m in minors)],
        ),
    ) == ((gpu, profile, start), spec_device(node, claim))
    # A repeated prepare (a kubelet retry, or the kubelet restarted) finds its instance.
    before = node.mutations()
    assert served(node, claim, device) == await node.prepare(claim)
    assert (before, [[(9, 4, 4)], []]) == (node.mutations(), node.instances())

    assert {uid_of(claim): ""} == await node.unprepare(claim)
    assert ([[], []], {}, []) == (node.instances(), node.checkpoint(), sorted(node.cdi.glob("*.json")))
    assert {uid_of(claim): ""} == await node.unprepare(claim)  # a retry is a no-op


async def test_a_taken_placement_fails_the_claim_and_destroys_nothing(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    first = allocated(control_plane, namespace, "first", node.name, ondemand_device_name(1, "3g.20gb", 0))
    assert "" == (await node.prepare(first))[uid_of(first)]["error"]
    # Someone else's instance (not made for a claim) at slot 4 of GPU 1.
    with simstate.editing(node.state) as state:
        state["gpus"][1]["gpuInstances"].append(
            {"id": 5, "profileId": PROFILE_ID["1g.5gb"], "start": 4, "size": 1, "computeInstances": []}
        )
    overlapping = allocated(
        control_plane, namespace, "second", node.name, ondemand_device_name(1, "2g.10gb", 2)
    )
    foreign = allocated(control_plane, namespace, "third", node.name, ondemand_device_name(1, "3g.20gb", 4))

    got = await node.prepare(overlapping, foreign)

    assert (
        f"claim {namespace}/second: 2g.10gb at slot 2 of GPU 1 ({node.gpus()[1]['uuid']}) is taken: GPU "
        f"instance 0 (3g.20gb at slot 0) is there, held by claim {namespace}/first; delete the claim (or its "
        "pod) so that it is allocated again"
    ) == got[uid_of(overlapping)]["error"]
    assert (
        "held by no claim of this agent (made by someone else; it is left alone)"
        in got[uid_of(foreign)]["error"]
    )
    assert [[], [(9, 0, 4), (19, 4, 1)]] == node.instances()
    assert [uid_of(first)] == sorted(node.checkpoint())


def someone_makes(node: Node, gpu: int, profile: str, start: int) -> str:
    """A MIG instance made outside the agent (as a static config, mig-parted or nvidia-smi would), through
    NVML in a process of its own; its MIG device's UUID."""
    script = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from sharing.gpu.nvml import open_nvml\n"
        "from sharing.mig.catalog import default_catalog\n"
        "async def main():\n"
        "    b = open_nvml(default_catalog(), Path(sys.argv[1]))\n"
        "    uuid = (await b.observe()).gpus[int(sys.argv[2])].uuid\n"
        "    gi = await b.create_instance(uuid, sys.argv[3], int(sys.argv[4]))\n"
        "    print(gi.compute_instances[0].uuid)\n"
        "    await b.close()\n"
        "asyncio.run(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARING_", "FAKE_NVML"))}
    done = subprocess.run(
        [sys.executable, "-c", script, str(node.root), str(gpu), profile, str(start)],
        capture_output=True, text=True, check=False, env={**env, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert 0 == done.returncode, done.stderr
    return done.stdout.strip()


async def test_a_claim_on_an_instance_made_by_someone_else_gets_it_and_its_unprepare_leaves_it(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    mig = someone_makes(node, 1, "3g.20gb", 4)
    await node.start()
    device = ondemand_device_name(1, "3g.20gb", 4)
    claim = allocated(control_plane, namespace, "f", node.name, device)
    before = node.mutations()

    assert served(node, claim, device) == await node.prepare(claim)

    assert (before, [[], [(9, 4, 4)]]) == (node.mutations(), node.instances())  # nothing made
    [(gpu, profile, start, owned_mig)] = owned(node, claim)
    suffix = f"{uid_of(claim)}-{device}".upper().replace("-", "_")
    assert ((1, 9, 4, mig), [f"GPU_SHARING_DEVICE_{suffix}={mig}"], True) == (
        (gpu, profile, start, owned_mig),
        spec_device(node, claim)[1],
        node.checkpoint()[uid_of(claim)]["devices"][0]["instance"]["foreign"],
    )
    assert {uid_of(claim): ""} == await node.unprepare(claim)
    assert (before, [[], [(9, 4, 4)]], {}) == (node.mutations(), node.instances(), node.checkpoint())


async def test_unprepare_refuses_while_processes_run_and_the_retry_destroys(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    claim = allocated(control_plane, namespace, "busy", node.name, ondemand_device_name(0, "1g.5gb", 6))
    await node.prepare(claim)
    [(_, _, _, mig)] = owned(node, claim)
    simstate.set_busy(node.state, mig, True)

    error = (await node.unprepare(claim))[uid_of(claim)]
    assert (
        f"claim {namespace}/busy: its MIG device {mig} (1g.5gb at slot 6) still has processes running on it; "
        "it is not destroyed while they run, and the kubelet retries the unprepare until they have ended"
    ) == error
    assert ([[(19, 6, 1)], []], [uid_of(claim)]) == (node.instances(), sorted(node.checkpoint()))
    simstate.set_busy(node.state, mig, False)
    assert {uid_of(claim): ""} == await node.unprepare(claim)
    assert [[], []] == node.instances()


@pytest.mark.parametrize(
    "crash_after",
    [None, 1, 2],
    ids=[
        "killed-between-allocation-and-prepare",
        "killed-after-the-gpu-instance",
        "killed-after-the-compute-instance",
    ],
)
async def test_an_agent_killed_around_a_prepare_loses_and_leaks_nothing(
    control_plane: lab.ControlPlane, namespace: str, node: Node, crash_after: int | None
) -> None:
    device = ondemand_device_name(0, "2g.10gb", 2)
    if crash_after is None:
        claim = allocated(control_plane, namespace, "c", node.name, device)  # while no agent runs
    else:
        await node.start(crash_after=crash_after)
        claim = allocated(control_plane, namespace, "c", node.name, device)
        with pytest.raises(grpc.aio.AioRpcError):
            await node.prepare(claim)
        assert 137 == await node.killed()
        assert [[(14, 2, 2)], []] == node.instances()  # what it left: half-built (1) or complete (2)
        assert node.checkpoint()[uid_of(claim)]["pending"] is True
    await node.start()

    assert served(node, claim, device) == await node.prepare(claim)  # the kubelet's retry
    assert [[(14, 2, 2)], []] == node.instances()
    assert [(0, 14, 2)] == [o[:3] for o in owned(node, claim)]
    assert "pending" not in node.checkpoint()[uid_of(claim)]
    assert {uid_of(claim): ""} == await node.unprepare(claim)
    assert ([[], []], {}) == (node.instances(), node.checkpoint())


async def test_an_agent_killed_in_the_middle_of_an_unprepare_leaks_nothing(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    claim = allocated(control_plane, namespace, "u", node.name, ondemand_device_name(1, "7g.40gb", 0))
    await node.prepare(claim)
    assert 0 == await node.stop()
    await node.start(crash_after=1)  # killed right after destroying the compute instance
    with pytest.raises(grpc.aio.AioRpcError):
        await node.unprepare(claim)
    assert 137 == await node.killed()
    assert ([[], [(0, 0, 8)]], []) == (
        node.instances(),
        node.gpus()[1]["gpuInstances"][0]["computeInstances"],
    )
    await node.start()

    assert {uid_of(claim): ""} == await node.unprepare(claim)  # the kubelet's retry
    assert ([[], []], {}) == (node.instances(), node.checkpoint())


async def test_restarts_with_claims_prepared_keep_their_instances(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    a = allocated(control_plane, namespace, "a", node.name, ondemand_device_name(0, "4g.20gb", 0))
    b = allocated(
        control_plane,
        namespace,
        "b",
        node.name,
        ondemand_device_name(1, "1g.5gb", 3),
        ondemand_device_name(1, "1g.5gb", 5),
    )
    answers = await node.prepare(a, b)
    owned_before = (owned(node, a), owned(node, b))
    layout = node.instances()

    assert 0 == await node.stop()  # the agent restarts ...
    await node.start()
    before = node.mutations()
    # ... and the kubelet, which prepares its claims again: the kubelet's own plugin manager.
    again = await node.kubelet_prepare(a, b)
    assert {
        uid_of(c): [
            (d["device_name"], d["cdi_device_ids"]) for d in again["prepare"]["claims"][uid_of(c)]["devices"]
        ]
        for c in (a, b)
    } == {uid: [tuple(d) for d in r["devices"]] for uid, r in answers.items()}
    assert answers == await node.prepare(a, b)
    assert (before, layout, owned_before) == (
        node.mutations(),
        node.instances(),
        (owned(node, a), owned(node, b)),
    )
    assert ({"a", "b"}, [[(5, 0, 4)], [(19, 3, 1), (19, 5, 1)]]) == (
        {c["name"] for c in node.checkpoint().values()},
        layout,
    )
    assert {uid_of(a): "", uid_of(b): ""} == await node.unprepare(a, b)
    assert [[], []] == node.instances()


async def test_an_xid_makes_the_gpus_ondemand_devices_unhealthy(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    a, b = ondemand_device_name(0, "1g.5gb", 0), ondemand_device_name(0, "2g.10gb", 2)
    c = ondemand_device_name(1, "1g.5gb", 0)
    claim = allocated(control_plane, namespace, "h", node.name, a, b, c)
    assert "" == (await node.prepare(claim))[uid_of(claim)]["error"]
    ok, bad = health.HEALTHY, health.UNHEALTHY
    assert {a: ok, b: ok, c: ok} == await node.health({a: ok, b: ok, c: ok})

    mig_of_a = next(m for g, _, start, m in owned(node, claim) if (g, start) == (0, 0))
    simstate.inject_xid(node.state, mig_of_a, 48)  # a double-bit ECC error NVML names the MIG device of
    assert {a: bad, b: ok, c: ok} == await node.health({a: bad, b: ok, c: ok})

    simstate.inject_xid(node.state, node.gpus()[1]["uuid"], 79)  # GPU 1 has fallen off the bus
    assert {a: bad, b: ok, c: bad} == await node.health({a: bad, b: ok, c: bad})


def free_placements(node: Node, profile: str) -> list[tuple[int, int]]:
    """(GPU, start) where the driver would make `profile` now: a listed placement that overlaps no
    instance, within the GPU's compute slices and the profile's maximum count."""
    free = []
    for gpu in node.gpus():
        table = {p["id"]: p for p in gpu["mig"]["profiles"]}
        p = table[PROFILE_ID[profile]]
        gis = gpu["gpuInstances"]
        used = sum(table[g["profileId"]]["slices"] for g in gis)
        same = sum(g["profileId"] == p["id"] for g in gis)
        if used + p["slices"] > gpu["mig"]["computeSlices"] or same >= p["maxCount"]:
            continue
        for start in p["placements"]:
            if all(start + p["size"] <= g["start"] or g["start"] + g["size"] <= start for g in gis):
                free.append((gpu["index"], start))
    return free


SERVED = 23
"""Of the seed's 30 claims, how many fit a free placement when they came (the rest fit none)."""


async def test_thirty_random_claims_and_releases_on_two_gpus(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    seed = 19
    rng = random.Random(seed)
    await node.start()
    held: dict[str, tuple[dict[str, Any], int, int, int]] = {}  # name -> (claim, gpu, profile id, start)
    served_count = unfit = 0
    for n in range(30):
        while held and rng.random() < 0.4:  # releases
            name = rng.choice(sorted(held))
            claim = held.pop(name)[0]
            assert {uid_of(claim): ""} == await node.unprepare(claim), f"seed {seed}"
        profile = rng.choice(sorted(PROFILE_ID))
        free = free_placements(node, profile)
        if not free:
            unfit += 1
            continue
        gpu, start = rng.choice(free)  # the scheduler picks one of the devices that fit
        device = ondemand_device_name(gpu, profile, start)
        claim = allocated(control_plane, namespace, f"c{n}", node.name, device)
        assert served(node, claim, device) == await node.prepare(claim), f"seed {seed}, claim {n}: {device}"
        held[f"c{n}"] = (claim, gpu, PROFILE_ID[profile], start)
        served_count += 1
        for instances in node.instances():  # never overlapping
            ends = sorted((s, s + size) for _, s, size in instances)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends)), f"seed {seed}: {instances}"
        wanted = [sorted((p, s, next(x["size"] for x in node.gpus()[g]["mig"]["profiles"] if x["id"] == p))
                         for _, g2, p, s in held.values() if g2 == g) for g in (0, 1)]  # fmt: skip
        assert wanted == node.instances(), f"seed {seed}: an instance leaked or was lost"
    assert (served_count, unfit) == (SERVED, 30 - SERVED)
    assert {uid_of(c): "" for c, *_ in held.values()} == await node.unprepare(*(c for c, *_ in held.values()))
    assert [[], []] == node.instances()


# ---- MPS: a MIG device made on demand, shared by the claim's users through its own daemon --------


def mps_config(**limits: Any) -> dict[str, Any]:
    """NVIDIA's MigDeviceConfig asking for MPS (api/nvidia.com/resource/v1beta1/sharing.go)."""
    sharing = {"strategy": "MPS", **({"mpsConfig": limits} if limits else {})}
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig", "sharing": sharing}


def compute_mode(node: Node, mig: str) -> int:
    """The MIG device's compute mode as the fake driver has it (0: default, 3: exclusive-process)."""
    cis = [c for g in node.gpus() for gi in g["gpuInstances"] for c in gi["computeInstances"]]
    return int(next(c for c in cis if c["uuid"] == mig).get("computeMode", 0))


async def test_a_claim_shared_with_mps_gets_a_daemon_bound_to_its_mig_device_until_unprepare(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    device = ondemand_device_name(0, "3g.20gb", 4)
    limits = {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "4Gi"}
    claim = allocated(control_plane, namespace, "a", node.name, device, config=mps_config(**limits))

    assert served(node, claim, device) == await node.prepare(claim)
    [(gpu, profile, start, mig)] = owned(node, claim)
    assert (0, 9, 4) == (gpu, profile, start)
    daemon = record_of(node.state, mig)  # bound to the MIG device: CUDA_VISIBLE_DEVICES=<its UUID>
    assert daemon is not None
    enforced = (daemon["activeThreadPercentage"], daemon["pinnedMemLimitMiB"], compute_mode(node, mig))
    assert (50, [4096], 3) == enforced
    kept = node.checkpoint()[uid_of(claim)]["devices"][0]["mps"]
    assert {"activeThreadPercentage": 50, "pinnedMemoryMiB": 4096} == kept
    spec = json.loads((node.cdi / f"k8s.gpu.nvidia.com-claim_{uid_of(claim)}.json").read_text())
    edits = spec["devices"][0]["containerEdits"]
    pipe = f"/mps/{mig}/pipe"
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in edits["env"]
    assert [(pipe, f"{node.mps_root}/{mig}/pipe"), ("/dev/shm", f"{node.mps_root}/shm")] == [
        (m["containerPath"], m["hostPath"]) for m in edits["mounts"]
    ]

    # A client of the daemon (a container of one of the claim's pods) runs an MPS server on the MIG
    # device: nothing is stopped or destroyed while it does, and the kubelet retries.
    client = socket.socket(socket.AF_UNIX)
    client.connect(str(node.mps_root / mig / "pipe/control"))
    client.sendall(b"fake_attach")
    assert b"attached\n" == client.recv(64)
    refused = (await node.unprepare(claim))[uid_of(claim)]
    assert "still has processes running on it" in refused
    still = record_of(node.state, mig) or {}
    assert ([[(9, 4, 4)], []], daemon["pid"]) == (node.instances(), still.get("pid"))
    client.close()
    idle = poll(
        "the client gone", lambda: record_of(node.state, mig), lambda r: r is not None and not r["clients"]
    )
    assert still["serverPid"] == idle["serverPid"]  # the server stays without clients, until `quit`

    assert {uid_of(claim): ""} == await node.unprepare(claim)
    assert ([[], []], {}, None) == (node.instances(), node.checkpoint(), record_of(node.state, mig))
    assert not (node.mps_root / mig).exists()


async def test_an_agent_restart_keeps_an_mps_claims_daemon_and_starts_one_that_died(
    control_plane: lab.ControlPlane, namespace: str, node: Node
) -> None:
    await node.start()
    device = ondemand_device_name(1, "2g.10gb", 0)
    claim = allocated(control_plane, namespace, "b", node.name, device, config=mps_config())
    assert served(node, claim, device) == await node.prepare(claim)
    [(_, _, _, mig)] = owned(node, claim)
    a100 = next(p for p in default_catalog().products if p.name == "A100-SXM4-40GB")
    memory = a100.require_profile("2g.10gb").memory_mib
    daemon = record_of(node.state, mig)
    assert daemon is not None
    assert (100, [memory]) == (daemon["activeThreadPercentage"], daemon["pinnedMemLimitMiB"])  # no limits

    assert 0 == await node.stop()
    await node.start()  # adopts the daemon it finds answering with the claim's limits
    before = node.mutations()
    assert served(node, claim, device) == await node.prepare(claim)  # the kubelet's retry after it
    assert (before, daemon["pid"]) == (node.mutations(), (record_of(node.state, mig) or {}).get("pid"))

    assert 0 == await node.stop()
    os.kill(daemon["pid"], signal.SIGKILL)  # the daemon this test's node started dies while no agent runs
    poll("the daemon gone", lambda: record_of(node.state, mig), lambda r: r is None)
    await node.start()
    again = poll("a daemon started again", lambda: record_of(node.state, mig), lambda r: r is not None)
    assert (100, [memory]) == (again["activeThreadPercentage"], again["pinnedMemLimitMiB"])
    assert daemon["pid"] != again["pid"]

    assert {uid_of(claim): ""} == await node.unprepare(claim)
    assert ([[], []], None) == (node.instances(), record_of(node.state, mig))
