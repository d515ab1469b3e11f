"""A node with MIG GPUs and a GPU without MIG under one `devices: all, mig: dynamic` rule, through DRA.

The session node's GPUs (2x A100, 2x H100) are what every module expects, so this module adds an L4
to them for its own time: it writes the L4 into the fake driver's state (the file the library reads
on every change; the way `sharing sim` changes the GPUs) and restarts the agent with the chart's DRA
on, as a driver reload after fitting a card would; at its end it puts the session's config, front-end
and chart values back, removes the L4 and restarts the agent, so every other module finds the node
as the session made it. The A100s and H100s become dynamic (MIG on, instances made per claim); the L4
is published as a whole GPU beside them, and pods claiming either kind run. NVIDIA's DRA driver
publishes nothing on such a node (https://github.com/kubernetes-sigs/dra-driver-nvidia-gpu/issues/1092).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from lab.helm import NAMESPACE, lab_values

from sharing.dra.names import parse_ondemand_name
from sharing.gpu import simstate
from sharing.gpu.simspec import gpu_state
from sharing.mig import default_catalog
from tests.node.conftest import ALL_KINDS, CONFIG, CONFIG_LABEL, EXPECTED, NODE, NodeUnderTest
from tests.node.test_dra import DRIVER, FRONTEND, STATE, DraNode, _published
from tests.node.test_ondemand import _ondemand, _run, _until

pytestmark = pytest.mark.node

L4_INDEX = 4
V1 = "version: v1\nmigStrategy: mixed\ngpus:\n"
EMPTY = V1 + "  - devices: [0, 1, 2, 3]\n    mig: enabled\n"
DYNAMIC = V1 + "  - devices: all\n    mig: dynamic\n"
WITH_L4 = {**EXPECTED, "nvidia.com/gpu": "2"}
"""The session's config on the device plugins with the L4 beside: no rule matches it, so it is offered
as it is."""
POOL = ({0, 1, 2, 3}, {f"gpu-{L4_INDEX}"})
"""What the pool offers: on-demand devices of the four MIG GPUs, and the L4 as a whole GPU."""


def _exported(node: NodeUnderTest) -> dict[int, dict[str, Any]]:
    """{GPU index: the GPU per `sharing export` in the agent's pod}."""
    return {g["index"]: g for g in node.export()["gpus"]}


def _mig_on_and_empty(gpus: dict[int, dict[str, Any]]) -> bool:
    return len(gpus) == 5 and all(gpus[i]["migEnabled"] and not gpus[i]["instances"] for i in range(4))


def _without_l4(node: NodeUnderTest) -> None:
    with simstate.editing(node.node.gpus_state) as state:
        state["gpus"] = [g for g in state["gpus"] if g["index"] != L4_INDEX]


@pytest.fixture(scope="module")
def mixed_session(real_node: NodeUnderTest) -> Iterator[tuple[NodeUnderTest, str]]:
    node = real_node
    node.delete_pods()
    l4 = "GPU-" + str(uuid.uuid4())
    with simstate.editing(node.node.gpus_state) as state:
        assert [0, 1, 2, 3] == [g["index"] for g in state["gpus"]], "the session node's GPUs changed"
        state["gpus"].append(gpu_state(L4_INDEX, l4, simstate.resolve_product(default_catalog(), "L4")))
    try:
        (old,) = node.agent_pods()
        node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, dra={"enabled": True}))
        node.running_agent(not_uid=old["metadata"]["uid"])
        node.patch_configs({"mixed-empty": EMPTY, "mixed-dynamic": DYNAMIC})
        # MIG on and nothing made first: a dynamic GPU keeps whatever instances it has (the claims').
        node.label(CONFIG_LABEL, "mixed-empty")
        _until(
            node, "the A100s and H100s in MIG mode, empty", lambda: _exported(node), _mig_on_and_empty, 180
        )
        node.label(FRONTEND, "dra")
        node.label(CONFIG_LABEL, "mixed-dynamic")
        _until(node, "the pool: on demand and the L4", lambda: _pool(node), lambda p: p == POOL, 180)
        yield node, l4
    finally:
        try:
            node.label(FRONTEND, None)
            node.label(CONFIG_LABEL, CONFIG)
            _until(node, "device-plugin resources with the L4", node.offered, lambda a: a == WITH_L4, 180)
            node.patch_configs({"mixed-empty": None, "mixed-dynamic": None})
        finally:  # whatever happened above, the session's GPUs are given back
            _without_l4(node)
            (old,) = node.agent_pods()
            node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
            node.running_agent(not_uid=old["metadata"]["uid"])
            node.wait_allocatable()


def _pool(node: NodeUnderTest) -> tuple[set[int], set[str]]:
    """(GPU indexes with on-demand devices, the other devices) of the node's pool."""
    return _ondemand(node), {n for n in _published(node) if parse_ondemand_name(n) is None}


@pytest.fixture
def mixed(mixed_session: tuple[NodeUnderTest, str]) -> Iterator[tuple[DraNode, str]]:
    node, l4 = mixed_session
    under = DraNode(node)
    try:
        yield under, l4
    finally:
        under.cleanup()


def test_the_l4_is_published_whole_beside_the_on_demand_devices_and_pods_of_both_kinds_run(
    mixed: tuple[DraNode, str],
) -> None:
    dra, l4 = mixed
    node = dra.node
    assert "success" == node.get("node", NODE)["metadata"]["labels"][STATE]
    whole = _published(node)[f"gpu-{L4_INDEX}"]
    assert {
        "type": "gpu",
        "uuid": l4,
        "productName": "NVIDIA L4",
        "architecture": "Ada Lovelace",
        "cudaComputeCapability": "8.9.0",
        "index": L4_INDEX,
    }.items() <= whole.items()

    cel = f"device.attributes['{DRIVER}'].productName == 'NVIDIA L4'"
    exactly = {"deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": cel}}]}
    whole_pod = dra.pod(dra.claim([{"name": "gpu", "exactly": exactly}]))
    small = dra.claim([{"name": "mig", "exactly": {"deviceClassName": "mig-1g.5gb.nvidia.com"}}])
    small_pod = dra.pod(small)
    _run(dra, whole_pod)
    _run(dra, small_pod)
    assert {l4} == dra.seen(whole_pod)
    (device,) = dra.allocated(small)
    parsed = parse_ondemand_name(device)
    assert parsed is not None
    made = _exported(node)[parsed[0]]
    assert "NVIDIA A100-SXM4-40GB" == made["product"]
    assert [("1g.5gb", parsed[2])] == [(i["profile"], i["start"]) for i in made["instances"]]
    assert {made["instances"][0]["uuid"]} == dra.seen(small_pod)

    status = node.status()
    assert ["onDemand"] * 4 + ["whole"] == [g["dynamic"] for g in status["gpus"]]
    table = node.kubectl("-n", NAMESPACE, "exec", "ds/gpu-sharing", "--", "sharing", "status")
    assert "  mig: dynamic, but this GPU has no MIG: offered as a whole GPU" in table.splitlines()
    assert "GPU 4 (L4) has no MIG: it is offered as a whole GPU" in node.agent_log()
