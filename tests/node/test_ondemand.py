"""On-demand MIG on the real node: the A100s of the session node under `mig: dynamic`, served through DRA.

The module adds two configs to the user's ConfigMap and takes the node's A100s to MIG on with no
instances (`mig: enabled`), then, with the node on the DRA front-end (the chart's DRA on, the node's
label), to `mig: dynamic`; it puts the session's config, chart values and front-end back at its end, so
every other module finds the node as the session made it. Each test deletes its claims and pods and
waits until no instance is left on the A100s (unprepare destroys them), so each starts from two empty
dynamic GPUs. What exists on the GPUs is read with `sharing export` in the agent's pod (the fake
driver's state through the real pynvml); what an MPS control daemon enforces, from its record under
the node's driver root (tests/node/test_mps.py); what the agent says of the claims' instances, with
`sharing status --json` and /metrics in its pod.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from lab.helm import NAMESPACE, lab_values
from lab.images import agent_image

from sharing.dra.names import parse_ondemand_name
from sharing.mig import Placement, default_catalog
from sharing.mig.policy import plain
from tests.apiserver import offers_whole
from tests.hardware import mig_devices
from tests.node.conftest import ALL_KINDS, CONFIG, CONFIG_LABEL, EXPECTED, NODE, NodeUnderTest
from tests.node.test_dra import DRIVER, FRONTEND, DraNode, _published
from tests.node.test_mps import daemon, keeper
from tests.polling import poll

pytestmark = pytest.mark.node

A100 = "NVIDIA A100-SXM4-40GB"
H100S = """  - devices: [2]
    mig: disabled
  - devices: [3]
    mig: disabled
"""
A100S = "  - devices: {product: A100-SXM4-40GB}\n    mig: "
EMPTY = f"version: v1\nmigStrategy: mixed\ngpus:\n{H100S}{A100S}enabled\n"
DYNAMIC = f"version: v1\nmigStrategy: mixed\ngpus:\n{H100S}{A100S}dynamic\n"
STATIC_3G = f"version: v1\nmigStrategy: mixed\ngpus:\n{H100S}  - devices: [0]\n    mig: {{3g.20gb: 1}}\n"
STATIC_3G += f"{A100S}enabled\n"
RECLAIM = f"{DYNAMIC}    reclaimForeign: idle\n"
PRODUCT = next(p for p in default_catalog().products if p.name == "A100-SXM4-40GB")


def _a100s(node: NodeUnderTest) -> dict[int, list[dict[str, Any]]]:
    """{GPU index: its MIG devices} of the A100s with MIG on, as the hardware has them."""
    return mig_devices(node.node.gpus_state, A100)


def _empty(a100s: dict[int, list[dict[str, Any]]]) -> bool:
    return len(a100s) == 2 and not any(a100s.values())


def _ondemand(node: NodeUnderTest) -> set[int]:
    """The GPU indexes with on-demand devices in the pool."""
    return {p[0] for name in _published(node) if (p := parse_ondemand_name(name)) is not None}


def _until(
    node: NodeUnderTest, what: str, read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float
) -> Any:
    """`poll`, with the agent's last log lines and the node's state label when it is not reached."""
    try:
        return poll(what, read, ok, timeout)
    except TimeoutError as err:
        labels = node.get("node", NODE)["metadata"].get("labels", {})
        state = {k: v for k, v in labels.items() if "gpu-sharing" in k or "mig.config" in k}
        slices = [
            (x["spec"]["pool"]["generation"], [d["name"] for d in x["spec"].get("devices", [])][:8])
            for x in node.get("resourceslices")["items"]
        ]
        raise AssertionError(
            f"{err}\nlabels: {state}\nslices (generation, first devices): {slices}\n"
            f"agent log:\n{node.agent_log()[-8000:]}"
        ) from None


def _run(dra: DraNode, pod: str) -> None:
    """The pod Running and ready (with the agent's log and the slices when it is not)."""
    _until(dra.node, f"pod {pod} Running", lambda: dra.node.pod(pod), _ready, 90)


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    ready = all(c.get("ready") for c in status.get("containerStatuses", [{}]))
    return status.get("phase") == "Running" and ready


@pytest.fixture(scope="module")
def ondemand_session(real_node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    node = real_node
    node.delete_pods()
    (old,) = node.agent_pods()
    node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}, dra={"enabled": True}))
    try:
        node.running_agent(not_uid=old["metadata"]["uid"])
        node.patch_configs({"ondemand-empty": EMPTY, "ondemand-dynamic": DYNAMIC})
        # MIG on and nothing made first: a dynamic GPU keeps whatever instances it has (the claims').
        node.label(CONFIG_LABEL, "ondemand-empty")
        _until(node, "the A100s in MIG mode, empty", lambda: _a100s(node), _empty, 180)
        node.label(FRONTEND, "dra")
        node.label(CONFIG_LABEL, "ondemand-dynamic")
        _until(node, "on-demand devices of both A100s", lambda: _ondemand(node), lambda g: g == {0, 1}, 180)
        yield node
    finally:
        node.label(FRONTEND, None)
        node.label(CONFIG_LABEL, CONFIG)
        _until(node, "device-plugin resources", node.offered, lambda a: a == EXPECTED, 180)
        node.patch_configs({"ondemand-empty": None, "ondemand-dynamic": None})
        (old,) = node.agent_pods()
        node.helm.upgrade_install(lab_values({CONFIG: ALL_KINDS}))
        node.running_agent(not_uid=old["metadata"]["uid"])
        node.wait_allocatable()


@pytest.fixture
def dra(ondemand_session: NodeUnderTest) -> Iterator[DraNode]:
    node = ondemand_session
    under = DraNode(node)
    # The hardware empty, and the pool published again without the last test's instances (a test
    # claims from the pool, which the agent republishes after the hardware has changed).
    _until(
        node,
        "no instance on the A100s, their whole room offered",
        lambda: (_a100s(node), offers_whole(_published(node), (0, 1))),
        lambda seen: _empty(seen[0]) and seen[1],
        120,
    )
    try:
        yield under
    finally:
        under.cleanup()
        _until(ondemand_session, "every instance destroyed", lambda: _a100s(ondemand_session), _empty, 120)


def _profile_claim(dra: DraNode, profile: str) -> str:
    return dra.claim([{"name": "mig", "exactly": {"deviceClassName": f"mig-{profile}.nvidia.com"}}])


def _placements(instances: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return sorted((i["profile"], i["start"]) for i in instances)


def test_small_slices_pack_onto_one_gpu_the_other_stays_whole_and_freed_room_fits_a_larger_one(
    dra: DraNode,
) -> None:
    claims, pods = [], []
    for _ in range(7):  # one after the other, as pods arrive
        claims.append(_profile_claim(dra, "1g.5gb"))
        pods.append(dra.pod(claims[-1]))
        _run(dra, pods[-1])
    a100s = _a100s(dra.node)
    counts = {i: Counter(x["profile"] for x in instances) for i, instances in a100s.items()}
    (packed,) = [i for i, c in counts.items() if c]
    (other,) = [i for i in a100s if i != packed]
    assert {packed: Counter({"1g.5gb": 7}), other: Counter()} == counts
    for pod in pods:  # each container sees exactly one of them
        (seen,) = dra.seen(pod)
        assert seen in {x["uuid"] for x in a100s[packed]}

    whole = dra.pod(_profile_claim(dra, "7g.40gb"))
    _run(dra, whole)
    assert [("7g.40gb", 0)] == _placements(_a100s(dra.node)[other])

    # Four leave: those on memory slices 0-3, so that a 3g.20gb (4 slices) has room on the packed GPU.
    starts = {c: parse_ondemand_name(dev) for c in claims for dev in dra.allocated(c)}
    leaving = [i for i, c in enumerate(claims) if (p := starts[c]) is not None and p[2] < 4]
    assert 4 == len(leaving)
    dra.node.delete("pod", *(pods[i] for i in leaving))
    dra.node.delete("resourceclaim", *(claims[i] for i in leaving))
    # Their instances destroyed, and the pool published again with the room they freed (what the
    # scheduler allocates the next claim from).
    freed = f"gpu-{packed}-mig-3g-20gb-at-0"
    poll(
        "three 1g.5gb left, a 3g.20gb offered at 0",
        lambda: (_placements(_a100s(dra.node)[packed]), freed in _published(dra.node)),
        lambda seen: seen == ([("1g.5gb", 4), ("1g.5gb", 5), ("1g.5gb", 6)], True),
        120,
    )

    larger = _profile_claim(dra, "3g.20gb")
    pod = dra.pod(larger)
    _run(dra, pod)
    (device,) = dra.allocated(larger)
    parsed = parse_ondemand_name(device)
    assert parsed is not None
    assert packed == parsed[0]
    made = _placements(_a100s(dra.node)[packed])
    assert [("1g.5gb", 4), ("1g.5gb", 5), ("1g.5gb", 6), ("3g.20gb", 0)] == made
    assert parsed[2] in PRODUCT.require_profile("3g.20gb").placements
    (seen,) = dra.seen(pod)
    assert "3g.20gb" == next(x["profile"] for x in _a100s(dra.node)[packed] if x["uuid"] == seen)
    occupied = [Placement("1g.5gb", s, 1) for s in (4, 5, 6)]
    first_plain = next(
        r.placement for r in plain(PRODUCT, occupied) if r.placement.profile == "3g.20gb" and r.free
    )
    print(f"3g.20gb made at {parsed[2]}; plain placement order's first free one: {first_plain.start}")


def test_a_pod_with_profile_limits_and_no_claim_gets_a_new_instance_made_for_it(dra: DraNode) -> None:
    pod = dra.pod(limits={"nvidia.com/mig-3g.20gb": "1"})
    _run(dra, pod)
    got = dra.node.pod(pod)
    claim = got["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    (device,) = dra.allocated(claim)
    parsed = parse_ondemand_name(device)
    assert parsed is not None
    made = _a100s(dra.node)
    assert [("3g.20gb", parsed[2])] == _placements(made[parsed[0]])
    (seen,) = dra.seen(pod)
    assert [seen] == [x["uuid"] for x in made[parsed[0]]]


def _made(node: NodeUnderTest) -> list[tuple[int, str, int, str]]:
    """(GPU, profile, start, MIG UUID) of every instance on the A100s."""
    return sorted(
        (g, i["profile"], i["start"], i["uuid"]) for g, instances in _a100s(node).items() for i in instances
    )


def test_a_killed_agent_keeps_the_instances_its_claims_own_and_destroys_them_at_unprepare(
    dra: DraNode,
) -> None:
    pods = [dra.pod(_profile_claim(dra, profile)) for profile in ("1g.5gb", "3g.20gb")]
    for pod in pods:
        _run(dra, pod)
    before = _made(dra.node)
    seen = [dra.seen(pod) for pod in pods]
    (old,) = dra.node.agent_pods()
    # The agent's container is killed (its pod deleted at once): a new one starts on the same checkpoint.
    dra.node.delete("pod", old["metadata"]["name"], namespace=NAMESPACE, force=True)
    dra.node.running_agent(not_uid=old["metadata"]["uid"])
    _until(dra.node, "the pool published again", lambda: _ondemand(dra.node), lambda g: g == {0, 1}, 120)
    assert before == _made(dra.node)  # none lost, none made again
    assert seen == [dra.seen(pod) for pod in pods]
    dra.node.delete("pod", *pods)  # returns once unprepared
    # unprepare destroyed them (none leaked): the fixture waits for the A100s to be empty


def test_a_kubelet_restarted_with_claims_prepared_loses_and_leaks_no_instance(dra: DraNode) -> None:
    pod = dra.pod(_profile_claim(dra, "2g.10gb"))
    _run(dra, pod)
    container = dra.node.pod(pod)["status"]["containerStatuses"][0]["containerID"]
    before, seen = _made(dra.node), dra.seen(pod)
    dra.node.node.restart_kubelet()

    def exec_env() -> tuple[int, str]:  # the restarted kubelet serves exec once it runs the pod again
        done = dra.node.node.kubectl("exec", pod, "--", "env")
        return done.returncode, done.stderr

    _until(dra.node, "exec into the pod", exec_env, lambda d: d[0] == 0, 120)
    after = dra.node.pod(pod)["status"]["containerStatuses"][0]
    assert (container, 0) == (after["containerID"], after["restartCount"])
    assert before == _made(dra.node)
    assert seen == dra.seen(pod)


def test_a_claim_only_fragmented_room_would_hold_waits_with_the_schedulers_reason_and_the_room_is_shown(
    dra: DraNode,
) -> None:
    """The agent reads no pending claim (that would be every claim of the cluster, for every node): the
    scheduler says why one waits, and the agent says per GPU what it can still take."""
    # GPU 0: 1g.5gb on memory slices 0, 2, 4, 6 (placed by CEL), so four slices and three compute
    # slices are free but no four contiguous ones; GPU 1: taken whole.
    for start in (0, 2, 4, 6):
        cel = (
            f"device.attributes['{DRIVER}'].parentIndex == 0 && "
            f"device.attributes['{DRIVER}'].placementStart == {start}"
        )
        exactly = {"deviceClassName": "mig-1g.5gb.nvidia.com", "selectors": [{"cel": {"expression": cel}}]}
        _run(dra, dra.pod(dra.claim([{"name": "mig", "exactly": exactly}])))
    _run(dra, dra.pod(_profile_claim(dra, "7g.40gb")))
    assert [("1g.5gb", s) for s in (0, 2, 4, 6)] == _placements(_a100s(dra.node)[0])

    big = dra.pod(_profile_claim(dra, "3g.20gb"))

    def unschedulable(p: dict[str, Any]) -> bool:
        conditions = p.get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    got = _until(dra.node, "the pod unschedulable", lambda: dra.node.pod(big), unschedulable, 60)
    (scheduled,) = [c for c in got["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "cannot allocate all claims" in scheduled["message"]
    status = dra.node.status()
    rooms = {g["index"]: g["room"] for g in status["gpus"] if g.get("room")}
    assert {
        0: {
            "largestProfile": "1g.5gb",
            "largestComputeSlices": 1,
            "freeComputeSlices": 3,
            "strandedComputeSlices": 0,
        },
        1: {
            "largestProfile": None,
            "largestComputeSlices": 0,
            "freeComputeSlices": 0,
            "strandedComputeSlices": 0,
        },
    } == {i: rooms[i] for i in (0, 1)}
    uuid0 = _a100s_uuids(status)[0]
    line = f'gpu_sharing_dynamic_gpu_largest_placeable_compute_slices{{gpu="0",uuid="{uuid0}"}} 1.0'
    _until(dra.node, "the gauge in /metrics", dra.node.metrics, lambda m: line in m, 30)


def _a100s_uuids(status: dict[str, Any]) -> list[str]:
    return [g["uuid"] for g in status["gpus"] if "A100" in g["product"]]


def test_seven_pods_arriving_at_once_pack_onto_one_gpu(dra: DraNode) -> None:
    claims = [_profile_claim(dra, "1g.5gb") for _ in range(7)]
    pods = [dra.pod(c) for c in claims]
    for pod in pods:
        _run(dra, pod)
    counts = {i: Counter(x["profile"] for x in instances) for i, instances in _a100s(dra.node).items()}
    assert sorted([Counter({"1g.5gb": 7}), Counter()], key=len) == sorted(counts.values(), key=len)


# ---- one on-demand instance shared by two pods through MPS ----------------------------------

ASK = (  # what a client asks its daemon over the pipe the claim's CDI spec gave it
    "import os, socket\n"
    "for command in ('get_default_active_thread_percentage', 'get_default_device_pinned_mem_limit 0'):\n"
    "    s = socket.socket(socket.AF_UNIX)\n"
    "    s.connect(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '/control')\n"
    "    s.sendall(command.encode() + b'\\n')\n"
    "    s.shutdown(socket.SHUT_WR)\n"
    "    print(s.recv(64).decode().strip())\n"
)
MPS_CONFIG = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "MigDeviceConfig",
    "sharing": {
        "strategy": "MPS",
        "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "4Gi"},
    },
}


def _client_pod(dra: DraNode, claim: str) -> str:
    """A pod of the claim that can speak to the MPS pipe (the agent's image has Python)."""
    name = f"p-{uuid.uuid4().hex[:6]}"
    return dra.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                "containers": [
                    {
                        "name": "main",
                        "image": agent_image(),
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sleep", "1000000"],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        }
    )


def test_two_pods_share_an_on_demand_3g_20gb_through_mps_until_the_second_goes(dra: DraNode) -> None:
    config = [{"requests": ["mig"], "opaque": {"driver": DRIVER, "parameters": MPS_CONFIG}}]
    claim = dra.claim(
        [{"name": "mig", "exactly": {"deviceClassName": "mig-3g.20gb.nvidia.com"}}], config=config
    )
    pods = [_client_pod(dra, claim) for _ in range(2)]
    for pod in pods:
        _run(dra, pod)
    ((gpu, instances),) = [(g, x) for g, x in _a100s(dra.node).items() if x]
    (made,) = instances
    mig = made["uuid"]
    assert "3g.20gb" == made["profile"]
    for pod in pods:  # both see the one device, its daemon's pipe, and the claim's limits through it
        assert {mig} == dra.seen(pod)
        pipe = dra.node.env(pod)["CUDA_MPS_PIPE_DIRECTORY"]
        assert f"/mps/{mig}/pipe" == pipe
        assert "control" in dra.node.kubectl("exec", pod, "--", "ls", pipe).split()
        assert ["50.0", "4G"] == dra.node.kubectl("exec", pod, "--", "python3", "-c", ASK).split()
    served = daemon(dra.node, mig)  # the daemon bound to the MIG device (CUDA_VISIBLE_DEVICES), keeper-run
    assert served is not None
    assert (50, [4096]) == (served["activeThreadPercentage"], served["pinnedMemLimitMiB"])

    dra.node.delete("pod", pods[0])
    assert [(made["profile"], made["start"], mig)] == [
        (x["profile"], x["start"], x["uuid"]) for x in _a100s(dra.node)[gpu]
    ]  # the claim still has a user: prepared, its instance and daemon kept
    assert served["pid"] == (daemon(dra.node, mig) or {}).get("pid")
    assert ["50.0", "4G"] == dra.node.kubectl("exec", pods[1], "--", "python3", "-c", ASK).split()

    dra.node.delete("pod", pods[1])  # returns once unprepared
    _until(dra.node, "the instance destroyed", lambda: _a100s(dra.node), _empty, 60)
    assert None is daemon(dra.node, mig)


def _mine(instances: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    return sorted((i["profile"], i["start"], i["uuid"]) for i in instances)


def test_an_instance_made_before_is_offered_as_it_is_given_to_a_claim_kept_and_reclaimed_when_asked(
    dra: DraNode,
) -> None:
    node = dra.node
    node.patch_configs({"ondemand-static-3g": STATIC_3G, "ondemand-reclaim": RECLAIM})
    try:
        # A static config makes a 3g.20gb on GPU 0 (the agent says it is applied, and the instance
        # has its compute instance); then the GPUs turn dynamic: no claim made it.
        node.label(CONFIG_LABEL, "ondemand-static-3g")

        def applied() -> tuple[tuple[str, str], dict[int, list[dict[str, Any]]]]:
            config = node.status()["config"]
            return (config["selected"], config["state"]), _a100s(node)

        _, made = _until(
            node, "the static config applied", applied,
            lambda seen: seen[0] == ("ondemand-static-3g", "success") and not seen[1].get(1)
            and [(x["profile"], bool(x["uuid"])) for x in seen[1].get(0, [])] == [("3g.20gb", True)], 180,
        )  # fmt: skip
        before = _mine(made[0])
        ((_, start, mig),) = before
        device = f"gpu-0-mig-3g-20gb-at-{start}"
        node.label(CONFIG_LABEL, "ondemand-dynamic")

        def foreign() -> list[tuple[Any, ...]]:
            return [
                (f["profile"], f["start"], f["uuids"], f["device"], f["claim"], f["reclaimedWhenIdle"])
                for g in node.status()["gpus"] if g["index"] == 0 for f in g["foreign"]
            ]  # fmt: skip

        seen = _until(node, "the instance seen as foreign", foreign, bool, 180)
        assert [("3g.20gb", start, [mig], device, None, False)] == seen
        # Offered as itself, and what overlaps it withdrawn (the pool of the empty GPU before had the
        # same device names: the withdrawal is what tells the new pool from it).
        _until(
            node, "the foreign instance offered as itself, the 7g.40gb over it withdrawn",
            lambda: _published(node),
            lambda names: device in names and "gpu-0-mig-7g-40gb-at-0" not in names
            and "gpu-1-mig-7g-40gb-at-0" in names, 180,
        )  # fmt: skip

        cel = f"device.attributes['{DRIVER}'].parentIndex == 0"
        exactly = {"deviceClassName": "mig-3g.20gb.nvidia.com", "selectors": [{"cel": {"expression": cel}}]}
        claim = dra.claim([{"name": "mig", "exactly": exactly}])
        pod = dra.pod(claim)
        _run(dra, pod)
        assert ([device], {mig}, before) == (dra.allocated(claim), dra.seen(pod), _mine(_a100s(node)[0]))
        node.delete("pod", pod)  # returns once unprepared
        node.delete("resourceclaim", claim)
        assert before == _mine(_a100s(node)[0])  # left as it was

        node.label(CONFIG_LABEL, "ondemand-reclaim")
        _until(
            node, "the idle foreign instance reclaimed and its room offered",
            lambda: (_a100s(node).get(0), "gpu-0-mig-7g-40gb-at-0" in _published(node)),
            lambda found: found == ([], True), 180,
        )  # fmt: skip
    finally:
        node.label(CONFIG_LABEL, "ondemand-reclaim")  # whatever failed, the next test finds the A100s empty
        _until(node, "no instance on the A100s", lambda: _a100s(node), _empty, 180)
        node.label(CONFIG_LABEL, "ondemand-dynamic")
        node.patch_configs({"ondemand-static-3g": None, "ondemand-reclaim": None})


# ---- what `sharing status` says of the claims' instances; a claim's MPS daemon killed ------------


def test_sharing_status_lists_a_claims_instance_with_its_pod_and_its_killed_mps_daemon_comes_back(
    dra: DraNode,
) -> None:
    config = [{"requests": ["mig"], "opaque": {"driver": DRIVER, "parameters": MPS_CONFIG}}]
    claim = dra.claim(
        [{"name": "mig", "exactly": {"deviceClassName": "mig-3g.20gb.nvidia.com"}}], config=config
    )
    pod = _client_pod(dra, claim)
    _run(dra, pod)
    ((gpu, (made,)),) = [(g, x) for g, x in _a100s(dra.node).items() if x]
    mig = made["uuid"]
    (device,) = dra.allocated(claim)

    def mine(status: dict[str, Any]) -> dict[str, Any]:
        (found,) = [s for g in status["gpus"] if g["index"] == gpu for s in g["slices"]]
        return dict(found)

    shown = mine(dra.node.status())
    claims = [{"namespace": "default", "name": claim, "pods": [f"default/{pod}"]}]
    assert (
        "nvidia.com/mig-3g.20gb", mig, "3g.20gb", claims,
        {"device": device, "start": made["start"], "made": True}, (True, 0, 50, 4096),
    ) == (
        shown["resource"], shown["id"], shown["profile"], shown["claims"], shown["onDemand"],
        (shown["mps"]["healthy"], shown["mps"]["restarts"], shown["mps"]["activeThreadPercentage"],
         shown["mps"]["pinnedMemoryMiB"]),
    )  # fmt: skip

    before = daemon(dra.node, mig)
    assert before is not None
    keeper(dra.node, "python3", "-c", f"import os, signal; os.kill({before['pid']}, signal.SIGKILL)")
    down = f"the MPS control daemon of MIG device {mig} (claim default/{claim}) does not answer"
    _until(
        dra.node,
        "MpsDaemonDown",
        lambda: dra.node.events("MpsDaemonDown"),
        lambda m: any(down in x for x in m),
        60,
    )
    back = f"the MPS control daemon of MIG device {mig} (claim default/{claim}) answers again"
    _until(dra.node, "MpsDaemonHealthy", lambda: dra.node.events("MpsDaemonHealthy"), lambda m: back in m, 60)
    after = daemon(dra.node, mig)
    assert after is not None
    assert (after["pid"] != before["pid"], 50, [4096]) == (
        True,
        after["activeThreadPercentage"],
        after["pinnedMemLimitMiB"],
    )
    assert ["50.0", "4G"] == dra.node.kubectl("exec", pod, "--", "python3", "-c", ASK).split()
    again = mine(dra.node.status())["mps"]
    assert (True, 1) == (again["healthy"], again["restarts"])
    line = f'gpu_sharing_mps_daemon_restarts_total{{gpu="{gpu}",uuid="{mig}"}} 1.0'
    _until(dra.node, "the restart in /metrics", dra.node.metrics, lambda m: line in m, 30)


SPLIT = (  # three 1-slice compute instances in a 3g.20gb GPU instance at slot 4 of GPU 0, as
    # `nvidia-smi mig -cgi 9:4 && nvidia-smi mig -cci 0,0,0 -gi <id>` makes them (NVML in the agent's pod)
    "import ctypes, os, pathlib\n"
    "from sharing.gpu.nvml import load_pynvml\n"
    "n = load_pynvml(pathlib.Path(os.environ['SHARING_DRIVER_ROOT']))\n"
    "n.nvmlInit()\n"
    "gpu = n.nvmlDeviceGetHandleByIndex(0)\n"
    "profile = n.nvmlDeviceGetGpuInstanceProfileInfo(gpu, n.NVML_GPU_INSTANCE_PROFILE_3_SLICE)\n"
    "place = n.c_nvmlGpuInstancePlacement_t()\n"
    "place.start, place.size = 4, 4\n"
    "gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, profile.id, ctypes.byref(place))\n"
    "one = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(\n"
    "    gi, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)\n"
    "for _ in range(3):\n"
    "    n.nvmlGpuInstanceCreateComputeInstance(gi, one.id)\n"
    "n.nvmlShutdown()\n"
)


def test_a_split_gpu_instance_is_no_3g_20gb_device_and_a_claim_for_one_gets_three_compute_slices(
    dra: DraNode,
) -> None:
    node = dra.node
    node.patch_configs({"ondemand-reclaim": RECLAIM})
    try:
        node.kubectl("-n", NAMESPACE, "exec", "ds/gpu-sharing", "--", "python3", "-c", SPLIT)
        split = [(i["profile"], i["start"]) for i in _a100s(node)[0]]
        assert [("1c.3g.20gb", 4)] * 3 == split  # `sharing export`: each under its own profile

        def foreign(status: dict[str, Any]) -> list[tuple[str, int, int, Any]]:
            return [(f["profile"], f["start"], len(f["uuids"]), f["device"])
                    for g in status["gpus"] if g["index"] == 0 for f in g["foreign"]]  # fmt: skip

        # Not one whole MIG device: not offered (no gpu-0-mig-3g-20gb-at-4), it only blocks its slots.
        _until(
            node,
            "the split instance seen",
            lambda: foreign(node.status()),
            lambda f: f == [("3g.20gb", 4, 3, None)],
            60,
        )
        _until(
            node, "its slots withdrawn from the pool", lambda: _published(node),
            lambda names: "gpu-0-mig-3g-20gb-at-4" not in names and "gpu-0-mig-3g-20gb-at-0" in names, 60,
        )  # fmt: skip
        cel = f"device.attributes['{DRIVER}'].parentIndex == 0"
        exactly = {"deviceClassName": "mig-3g.20gb.nvidia.com", "selectors": [{"cel": {"expression": cel}}]}
        claim = dra.claim([{"name": "mig", "exactly": exactly}])
        pod = dra.pod(claim)
        _run(dra, pod)
        assert ["gpu-0-mig-3g-20gb-at-0"] == dra.allocated(claim)  # made beside it, never the split one
        (seen,) = dra.seen(pod)
        profiles = {i["uuid"]: (i["profile"], i["start"]) for i in _a100s(node)[0]}
        assert ("3g.20gb", 0) == profiles[seen]  # a whole 3g.20gb: all three compute slices
        node.delete("pod", pod)  # returns once unprepared
        node.delete("resourceclaim", claim)
    finally:
        # the idle split instance is destroyed: the A100s empty again
        node.label(CONFIG_LABEL, "ondemand-reclaim")
        _until(node, "no instance on the A100s", lambda: _a100s(node), _empty, 180)
        node.label(CONFIG_LABEL, "ondemand-dynamic")
        node.patch_configs({"ondemand-reclaim": None})
