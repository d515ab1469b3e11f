"""`sharing recommend`: held MIG devices at their right size, the free room filled with the largest
profiles that fit, every other GPU kept as it is, and the config checked as a ConfigMap's is."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import yaml

from sharing.config import parse_configmap
from sharing.mig import default_catalog, plan_gpu
from sharing.mig.plan import Existing, Plan
from sharing.model import ComputeInstance, Gpu, GpuInstance, GpuUuid, MigUuid, NodeState
from sharing.usage.recommend import RecommendError, recommend
from sharing.usage.resize import Change

CATALOG = default_catalog()
A100 = CATALOG.product("A100-SXM4-40GB")
SIZES = {p.name: p.size for p in A100.profiles}


def a100(index: int, layout: list[tuple[str, int]]) -> Gpu:
    """An A100-SXM4-40GB in MIG mode with these instances (profile, start); MIG-<index>-<start> each."""
    instances = tuple(
        GpuInstance(n, profile, start, SIZES[profile], (ComputeInstance(0, MigUuid(f"MIG-{index}-{start}")),))
        for n, (profile, start) in enumerate(layout)
    )
    return Gpu(index, GpuUuid(f"GPU-{index}"), "NVIDIA A100-SXM4-40GB", 40960, True, True, True, instances)


def h100(index: int) -> Gpu:
    return Gpu(index, GpuUuid(f"GPU-{index}"), "NVIDIA H100 80GB HBM3", 81559, True, False, False)


def mig_slice(
    gpu: Gpu, start: int, pod: str | None = None, right: str | None = None, replica: int | None = None
) -> dict[str, Any]:
    gi = next(g for g in gpu.instances if g.start == start)
    uuid = gi.compute_instances[0].uuid
    return {
        "resource": f"nvidia.com/mig-{gi.profile}" + (".shared" if replica is not None else ""),
        "id": uuid if replica is None else f"{uuid}::{replica}",
        "device": uuid,
        "replica": replica,
        "profile": gi.profile,
        "pod": {"namespace": "ml", "pod": pod, "container": "main"} if pod else None,
        "claims": [],
        "usage": {"rightSize": {"profile": right, "why": None}} if pod else None,
    }


def whole_slices(gpu: Gpu, replicas: int, pods: dict[int, str | None]) -> list[dict[str, Any]]:
    """The time-sliced replicas of a whole GPU, those in `pods` held (each right-sized to a 1g.10gb)."""
    slices = []
    for i in range(replicas):
        pod = pods.get(i)
        slices.append(
            {
                "resource": "nvidia.com/gpu.shared", "id": f"{gpu.uuid}::{i}", "device": gpu.uuid,
                "replica": i, "profile": None,
                "pod": {"namespace": "ml", "pod": pod, "container": "main"} if pod else None,
                "claims": [], "usage": {"rightSize": {"profile": "1g.10gb", "why": None}} if pod else None,
            }
        )  # fmt: skip
    return slices


def status(gpus: list[tuple[Gpu, list[dict[str, Any]]]], **extra: Any) -> dict[str, Any]:
    return {
        "node": "n1",
        "config": {"state": "success"},
        "holders": {"known": True},
        "usage": {
            "enabled": True, "sampledAt": "2026-01-01T00:00:00Z", "windowSeconds": 86400,
            "holdersKnown": True,
        },
        "gpus": [{"uuid": g.uuid, "slices": s, "mps": None, "dynamic": None, **extra} for g, s in gpus],
    }  # fmt: skip


def checked(config: dict[str, Any], node: NodeState) -> None:
    result = parse_configmap({"recommended": yaml.safe_dump(config)}, gpus=node.gpus, catalog=CATALOG)
    assert () == result.errors


ALL_1G = [("1g.5gb", s) for s in range(7)]


def test_a_gpu_whose_held_slices_are_at_their_right_size_stays_as_it_is() -> None:
    gpu = a100(0, ALL_1G)
    slices = [mig_slice(gpu, s, "a" if s == 3 else None, "1g.5gb" if s == 3 else None) for s in range(7)]
    (advice,) = recommend(NodeState((gpu,)), status([(gpu, slices)]), CATALOG).gpus
    assert (("1g.5gb",), ("1g.5gb",), ("1g.5gb",) * 6, (), (0, 0), (6, 7), ()) == (
        advice.held, advice.right_sized, advice.free_room, advice.made, advice.frees, advice.room,
        advice.changes,
    )  # fmt: skip
    assert {"devices": [0], "mig": {"1g.5gb": 7}} == advice.rule


def test_slices_no_device_uses_become_the_largest_profiles_that_fit() -> None:
    """MIG on with one 1g.5gb, held at slot 0: the other slices are offered as 3g.20gb, 2g.10gb and
    1g.5gb (a 4g.20gb would need slot 0), planned around the held one."""
    gpu = a100(0, [("1g.5gb", 0)])
    (advice,) = recommend(
        NodeState((gpu,)), status([(gpu, [mig_slice(gpu, 0, "a", "1g.5gb")])]), CATALOG
    ).gpus
    assert ("3g.20gb", "2g.10gb", "1g.5gb") == advice.made == advice.free_room
    want = Counter({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})
    assert dict(sorted(want.items())) == advice.rule["mig"]
    planned = plan_gpu(A100, [Existing("1g.5gb", 0, busy=True)], want)
    assert isinstance(planned, Plan)


def test_an_oversized_slice_is_given_back_as_the_largest_profiles_that_fit_and_its_pod_waited_for() -> None:
    """A pod on a 3g.20gb that used 2 GiB: its right size 1g.5gb frees 2 compute and 3 memory slices,
    which become a 2g.10gb and a 1g.5gb beside the free 3g.20gb; the agent could not place them with
    the pod's 3g.20gb still there, so the rollout waits for it (or drain mode evicts it)."""
    gpu = a100(1, [("3g.20gb", 0), ("3g.20gb", 4)])
    node = NodeState((gpu,))
    slices = [mig_slice(gpu, 0, "b", "1g.5gb"), mig_slice(gpu, 4)]
    recommendation = recommend(node, status([(gpu, slices)]), CATALOG)
    (advice,) = recommendation.gpus
    assert (("3g.20gb",), ("1g.5gb",), (2, 3), (6, 7)) == (
        advice.held, advice.right_sized, advice.frees, advice.room
    )  # fmt: skip
    assert (("3g.20gb", "2g.10gb", "1g.5gb"), ("2g.10gb", "1g.5gb")) == (advice.free_room, advice.made)
    assert (Change("ml/b/main", "MIG-1-0", "3g.20gb", "1g.5gb", waits=True),) == advice.changes
    assert advice.waits
    assert {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1} == advice.rule["mig"]
    checked(recommendation.config, node)


def test_a_pod_whose_profile_the_new_layout_still_has_keeps_its_slice_while_it_runs() -> None:
    """`x` used 1 GiB of its 2g.10gb: the new layout gives it a 1g.5gb, but still has two 2g.10gb, so
    the agent keeps the one `x` runs on and makes the rest around it: nothing waits."""
    gpu = a100(0, [("2g.10gb", 0), ("2g.10gb", 2), ("2g.10gb", 4), ("1g.5gb", 6)])
    slices = [mig_slice(gpu, 0, "x", "1g.5gb"), *(mig_slice(gpu, s) for s in (2, 4, 6))]
    (advice,) = recommend(NodeState((gpu,)), status([(gpu, slices)]), CATALOG).gpus
    assert (("1g.5gb",), (1, 1), ("1g.5gb",)) == (advice.right_sized, advice.frees, advice.made)
    assert {"1g.5gb": 3, "2g.10gb": 2} == advice.rule["mig"]
    assert (Change("ml/x/main", "MIG-0-0", "2g.10gb", "1g.5gb"),) == advice.changes
    assert not advice.waits


def test_only_the_pods_whose_instance_stands_in_the_way_are_waited_for() -> None:
    """The demo's A100: a pod idle on its 2g.10gb and one using 2 GiB of its 3g.20gb, both sized to a
    1g.5gb. What they give back is a 3g.20gb, where the second one runs: it keeps its slice while it
    runs; the rollout waits for the first (no 2g.10gb in the new layout)."""
    gpu = a100(0, [("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4)])
    slices = [
        mig_slice(gpu, 0, "sleeper", "1g.5gb"), mig_slice(gpu, 2, "demo", "1g.5gb"), mig_slice(gpu, 3),
        mig_slice(gpu, 4, "training", "1g.5gb"),
    ]  # fmt: skip
    (advice,) = recommend(NodeState((gpu,)), status([(gpu, slices)]), CATALOG).gpus
    assert {"1g.5gb": 4, "3g.20gb": 1} == advice.rule["mig"]
    assert ((3, 4), ("3g.20gb",)) == (advice.frees, advice.made)
    assert [("ml/sleeper/main", True), ("ml/training/main", False)] == [
        (c.holder, c.waits) for c in advice.changes
    ]


def test_free_devices_move_when_the_right_sizes_do_not_fit_around_them() -> None:
    """A pod near the top of its 1g.5gb needs a 1g.10gb (two memory slices): the free 1g.5gb beside
    it make room."""
    gpu = a100(0, ALL_1G)
    slices = [mig_slice(gpu, s, "a" if s == 0 else None, "1g.10gb" if s == 0 else None) for s in range(7)]
    (advice,) = recommend(NodeState((gpu,)), status([(gpu, slices)]), CATALOG).gpus
    assert ("1g.10gb",) == advice.right_sized
    assert "its free devices move" in advice.note
    assert 7 == sum(A100.require_profile(p).compute_slices for p in (*advice.right_sized, *advice.free_room))


def test_replicas_of_a_mig_device_keep_it_and_their_count() -> None:
    gpu = a100(0, [("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4)])
    slices = [mig_slice(gpu, 0, "x", "1g.5gb", replica=0), mig_slice(gpu, 0, None, None, replica=1)]
    slices += [mig_slice(gpu, s) for s in (2, 3, 4)]
    recommendation = recommend(NodeState((gpu,)), status([(gpu, slices)]), CATALOG)
    (advice,) = recommendation.gpus
    assert (("2g.10gb",), ("2g.10gb",), ()) == (advice.held, advice.right_sized, advice.changes)
    assert {"2g.10gb": 2} == advice.rule["replicas"]
    assert recommendation.config["sharing"] == {"renameByDefault": True}
    checked(recommendation.config, NodeState((gpu,)))


def test_right_sizes_that_cannot_be_placed_around_the_held_ones_leave_them_as_they_are() -> None:
    """Two 1g.5gb held at slots 0 and 4, and a 2g.10gb at 2 whose pod filled it: its right size
    3g.20gb (placements 0 and 4) has no room around the others: nothing held changes."""
    gpu = a100(0, [("1g.5gb", 0), ("2g.10gb", 2), ("1g.5gb", 4)])
    slices = [
        mig_slice(gpu, 0, "a", "1g.5gb"),
        mig_slice(gpu, 2, "b", "3g.20gb"),
        mig_slice(gpu, 4, "c", "1g.5gb"),
    ]
    (advice,) = recommend(NodeState((gpu,)), status([(gpu, slices)]), CATALOG).gpus
    assert ((), ("1g.5gb", "1g.5gb", "2g.10gb")) == (advice.changes, advice.right_sized)
    assert "cannot be placed" in advice.note


def test_gpus_without_mig_mode_are_kept_as_they_are_and_their_pods_told_what_would_hold_them() -> None:
    shared, whole = h100(3), h100(2)
    node = NodeState((whole, shared))
    doc = status([(whole, []), (shared, whole_slices(shared, 4, {0: "notebook"}))])
    recommendation = recommend(node, doc, CATALOG)
    plain, sliced = recommendation.gpus
    assert ({"devices": [2], "mig": "disabled"}, False) == (plain.rule, plain.resized)
    assert {"devices": [3], "mig": "disabled", "replicas": 4} == sliced.rule
    assert [("ml/notebook/main", "1g.10gb")] == [(h.holder, h.right) for h in sliced.fits]
    assert "none" == recommendation.config["migStrategy"]
    checked(recommendation.config, node)


def test_a_gpu_shared_with_mps_keeps_its_clients_and_limits() -> None:
    gpu = h100(0)
    doc = status([(gpu, whole_slices(gpu, 2, {}))])
    doc["gpus"][0]["mps"] = {"activeThreadPercentage": 50, "pinnedMemoryMiB": 4096}
    (advice,) = recommend(NodeState((gpu,)), doc, CATALOG).gpus
    assert {"replicas": 2, "activeThreadPercentage": 50, "pinnedMemoryLimit": "4096Mi"} == advice.rule["mps"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"usage": {"enabled": False}}, "samples no usage"),
        ({"usage": {"enabled": True, "sampledAt": None}}, "no usage sample yet"),
        ({"holders": {"known": False}}, "who holds which slice is unknown"),
    ],
    ids=["usage-off", "no-sample", "holders-unknown"],
)
def test_what_cannot_be_sized_is_said(change: dict[str, Any], message: str) -> None:
    gpu = a100(0, ALL_1G)
    doc = {**status([(gpu, [mig_slice(gpu, s) for s in range(7)])]), **change}
    with pytest.raises(RecommendError, match=message):
        recommend(NodeState((gpu,)), doc, CATALOG)


def test_mig_devices_advertised_as_nvidia_com_gpu_are_not_renamed_behind_a_users_back() -> None:
    gpu = a100(0, ALL_1G)
    slices = [{**mig_slice(gpu, s), "resource": "nvidia.com/gpu"} for s in range(7)]
    with pytest.raises(RecommendError, match="migStrategy single"):
        recommend(NodeState((gpu,)), status([(gpu, slices)]), CATALOG)
