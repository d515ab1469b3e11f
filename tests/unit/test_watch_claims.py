"""The ResourceClaims watch of a DRA pool against a scripted API: listed, then followed from the list's
version, each change folded in; after a 410 listed again, so a claim deleted meanwhile goes.

An in-memory fake is fine here (unit test); tests/integration/test_claims.py runs it against a real
kube-apiserver.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from sharing.kube import GoneError, watch_pool_claims
from sharing.kube.api import PendingClaim, PoolClaim, PoolClaims, WatchEvent
from sharing.model import ClaimAllocation
from tests.unit.test_watch import ScriptedApi

DRIVER, POOL = "gpu.nvidia.com", "n1"


def pending(name: str, version: str) -> PoolClaim:
    return PoolClaim("ml", name, version, None, PendingClaim("ml", name, ("mig-1g.5gb.nvidia.com",)))


def allocated(name: str, version: str, device: str) -> PoolClaim:
    return PoolClaim("ml", name, version, ClaimAllocation("ml", name, f"uid-{name}", (device,)), None)


def listed(version: str, *claims: PoolClaim) -> PoolClaims:
    return PoolClaims({(c.namespace, c.name): c for c in claims}, version)


class ScriptedClaims(ScriptedApi):
    """test_watch's scripted API, answering as the ResourceClaims of one pool."""

    def __init__(self, lists: list[PoolClaims], watches: list[list[WatchEvent] | Exception]) -> None:
        super().__init__(gets=lists, watches=watches)  # type: ignore[arg-type]

    def list_claims_of_pool(self, driver: str, pool: str) -> PoolClaims:
        assert (driver, pool) == (DRIVER, POOL)
        return self.get()  # type: ignore[return-value]

    def watch_claims_of_pool(
        self, driver: str, pool: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        return self.watch(resource_version)


async def follow(api: ScriptedClaims) -> list[PoolClaims]:
    """Run the watch until its scripts are spent; the views it reported as changes."""
    watched = watch_pool_claims(api, DRIVER, POOL, timeout_s=60)  # type: ignore[arg-type]
    seen: list[PoolClaims] = []
    watched.start(lambda: seen.append(watched.current) if watched.current is not None else None)
    # The thread hands each change to the loop before it blocks in the last watch, so they have run
    # by the time this wait's own answer comes back through the loop.
    await asyncio.to_thread(api.done.wait, 10)
    watched.stop()
    api.release.set()
    return seen


async def test_the_claims_are_listed_then_followed_from_the_lists_version() -> None:
    api = ScriptedClaims(
        lists=[listed("10", pending("a", "9"))],
        watches=[
            [
                WatchEvent("MODIFIED", allocated("a", "11", "gpu-0-mig-1g-5gb-at-6"), "11"),
                WatchEvent("ADDED", pending("b", "12"), "12"),
                # A status write that changes neither allocation nor request is no news.
                WatchEvent("MODIFIED", pending("b", "13"), "13"),
                WatchEvent("DELETED", allocated("a", "14", "gpu-0-mig-1g-5gb-at-6"), "14"),
            ]
        ],
    )
    seen = await follow(api)
    assert ["10", "14"] == api.watch_versions  # from the list's version, never "from now"
    assert [
        ((), (PendingClaim("ml", "a", ("mig-1g.5gb.nvidia.com",)),)),
        ((ClaimAllocation("ml", "a", "uid-a", ("gpu-0-mig-1g-5gb-at-6",)),), ()),
        (
            (ClaimAllocation("ml", "a", "uid-a", ("gpu-0-mig-1g-5gb-at-6",)),),
            (PendingClaim("ml", "b", ("mig-1g.5gb.nvidia.com",)),),
        ),
        ((), (PendingClaim("ml", "b", ("mig-1g.5gb.nvidia.com",)),)),
    ] == [view.seen() for view in seen]


async def test_after_a_410_the_claims_are_listed_again_and_one_deleted_meanwhile_is_gone() -> None:
    api = ScriptedClaims(
        lists=[
            listed("10", allocated("a", "9", "gpu-0"), allocated("b", "8", "gpu-1")),
            listed("500", allocated("b", "8", "gpu-1")),  # a was deleted while the watch was away
        ],
        watches=[GoneError("too old")],
    )
    seen = await follow(api)
    assert ["10", "500"] == api.watch_versions
    assert ((ClaimAllocation("ml", "b", "uid-b", ("gpu-1",)),), ()) == seen[-1].seen()
    assert 2 == len(seen)


def elsewhere(name: str, version: str) -> PoolClaim:
    """A claim allocated devices of another node's pool: as this pool sees it, neither."""
    return PoolClaim("ml", name, version, None, None)


async def test_claims_of_other_pools_are_not_kept_and_their_changes_are_no_news() -> None:
    api = ScriptedClaims(
        lists=[listed("10", allocated("a", "9", "gpu-0"), elsewhere("x", "8"))],
        watches=[
            [
                WatchEvent("ADDED", elsewhere("y", "11"), "11"),
                WatchEvent("MODIFIED", elsewhere("y", "12"), "12"),
                WatchEvent("DELETED", elsewhere("x", "13"), "13"),
                WatchEvent("DELETED", elsewhere("y", "14"), "14"),
            ],
            # A pending claim allocated on another node's pool leaves what the pool acts on.
            [
                WatchEvent("ADDED", pending("b", "15"), "15"),
                WatchEvent("MODIFIED", elsewhere("b", "16"), "16"),
            ],
        ],
    )
    seen = await follow(api)
    assert ["10", "14", "16"] == api.watch_versions  # each watch resumes after the last event, seen or not
    held = (ClaimAllocation("ml", "a", "uid-a", ("gpu-0",)),)
    assert [
        (held, ()),
        (held, (PendingClaim("ml", "b", ("mig-1g.5gb.nvidia.com",)),)),
        (held, ()),
    ] == [view.seen() for view in seen]
    assert {("ml", "a")} == set(seen[-1].claims)
