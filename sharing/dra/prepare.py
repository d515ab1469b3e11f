"""Prepare and unprepare claims: read the claim, map its devices to ours (`sharing.dra.claims`), then
write its CDI spec and checkpoint it (`sharing.dra.records`, in the order that keeps a crash harmless).

Both are idempotent (the kubelet retries them, after its restarts too) and work from the checkpoint
(`sharing.store.claims`) across agent restarts: a claim prepared before is answered from it, and
unprepare never needs the API server, so it works after the claim and its pod are gone. Each claim
succeeds or fails alone: a failure is that claim's `error`, which the kubelet reports on the pod
(dra/v1 api.proto: "Failures for individual claims can be reported inside
NodePrepareResourcesResponse").

An on-demand MIG device (`sharing.dra.ondemand`) is made at prepare (`sharing.dra.instances`): the claim
goes into the checkpoint as pending first, then the instance is made, then the spec and the finished
checkpoint entry are written. Unprepare destroys it first (refused while it has processes: the claim's
error, and the kubelet retries), then removes the spec and the entry. At start, the instances the
checkpoint owns are adopted and a pending prepare is rolled forward or back; nothing else is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from sharing.devices import DEFAULT_MPS_ROOT, Inventory
from sharing.dra.claims import (
    ClaimError,
    ClaimKey,
    check_config,
    devices_by_name,
    ondemand_results,
    prepared_device,
    select,
)
from sharing.dra.instances import destroy_owned, prepare_ondemand, reclaim, settle
from sharing.dra.names import claim_cdi_name
from sharing.dra.ondemand import OnDemand, SlotHandover
from sharing.dra.records import ClaimRecords, PreparedClaims
from sharing.errors import KubeError
from sharing.gpu.devfiles import DeviceFiles
from sharing.kube.api import NotFoundError, ResourceClaimObject
from sharing.mig import Catalog, device_profile
from sharing.model import NodeState
from sharing.store import ClaimCheckpoint, PreparedClaim, PreparedDevice, PreparedPod
from sharing.text import bounded

log = structlog.get_logger(__name__)

HANDOVER_WAIT_S = 10.0
"""How long a prepare whose placement another claim of this node still holds waits for that claim's
unprepare (each unprepare wakes it) before it fails as before (the kubelet retries the prepare)."""
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


class ClaimReader(Protocol):
    """How the plugin reads claims (`sharing.kube.KubeClient` is one; the call blocks)."""

    def get_resource_claim(self, namespace: str, name: str) -> ResourceClaimObject: ...


class Recorder(Protocol):
    """Where prepare's figures go (the agent's metrics)."""

    def prepared_claims(self, count: int) -> None:
        """The number of claims prepared on the node now."""

    def prepare_seconds(self, seconds: float, profile: str, ondemand: bool) -> None:
        """The time one claim's prepare took, failed or not, by `prepare_labels`."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claim's answer: its devices, or why it failed (then `error` is set and devices is empty)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class Preparer:
    """Prepares claims for the pool `pool` (this node's name) from what the node offers now."""

    def __init__(
        self,
        *,
        pool: str,
        claims: ClaimReader,
        inventory: Callable[[], Inventory],
        node: Callable[[], NodeState],
        files: DeviceFiles,
        cdi_dir: Path,
        checkpoint: ClaimCheckpoint,
        recorder: Recorder | None = None,
        ondemand: OnDemand | None = None,
        changed: Callable[[], object] | None = None,
    ) -> None:
        self.pool = pool
        self.ondemand = ondemand
        """Makes on-demand MIG devices; None: this node makes none (such a claim fails)."""
        self._changed = changed
        self._reader = claims
        self._inventory = inventory
        mps_root = DEFAULT_MPS_ROOT if ondemand is None or ondemand.mps is None else str(ondemand.mps.root)
        self.records = ClaimRecords(
            cdi_dir=cdi_dir, checkpoint=checkpoint, files=files, node=node, mps_root=mps_root
        )
        """The CDI specs and checkpoint entries of the claims prepared here."""
        self._node = node
        self._recorder = recorder
        self._unrecovered = ""
        """Why the on-demand instances the checkpoint owns could not be checked at start ("": they
        were); retried before each call, and until then nothing is prepared or unprepared."""
        self._lock = asyncio.Lock()
        self._released = asyncio.Event()
        """Set when an unprepare has run: a prepare waiting for a handover looks again."""

    async def load(self) -> None:
        """Read the checkpoint (at start); a bad one is logged and fails closed until it is fixed."""
        async with self._lock:
            if await self.records.load():
                if self.ondemand is not None:
                    self._unrecovered = await settle(self.ondemand, self.records)
                if not self._unrecovered:
                    await asyncio.to_thread(self.records.remove_stale_specs)
            self._count()
        log.info("dra_checkpoint_loaded", claims=len(self.records.claims))

    async def _recovered(self) -> str:
        """ "" once the instances the checkpoint owns were checked (tried again now if they were not)."""
        if self._unrecovered and self.ondemand is not None:
            self._unrecovered = await settle(self.ondemand, self.records)
            if not self._unrecovered:
                await asyncio.to_thread(self.records.remove_stale_specs)
        return self._unrecovered

    def prepared(self) -> PreparedClaims:
        """The claims prepared now (for the rollout's holders and for `sharing status`)."""
        claims = self.records.claims
        making = next((c for c in claims.values() if c.pending), None)
        unknown = self.records.unknown or self._unrecovered
        if not unknown and making is not None:
            # Its instance may exist before its MIG UUID is recorded: hold everything meanwhile.
            unknown = f"claim {making.namespace}/{making.name} is being prepared (MIG instances being made)"
        return PreparedClaims(tuple(claims[u] for u in sorted(claims)), unknown)

    async def prepare(self, keys: Sequence[ClaimKey]) -> dict[str, Prepared]:
        """{claim UID: its devices or its error} for every claim asked for.

        A claim whose on-demand placement another claim of this node still holds (`SlotHandover`)
        is tried again after each unprepare, for up to HANDOVER_WAIT_S, outside the lock so that
        the unprepare can run."""
        answers: dict[str, Prepared] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANDOVER_WAIT_S
        todo = list(keys)
        while True:
            self._released.clear()
            waiting = await self._prepare_all(todo, answers, loop)
            if not waiting or loop.time() >= deadline:
                break
            todo = waiting
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), deadline - loop.time())
        for key in todo if waiting else ():
            log.warning(
                "claim_not_prepared", claim=f"{key.namespace}/{key.name}", error=answers[key.uid].error
            )
        if self._changed is not None:
            self._changed()
        return answers

    async def _prepare_all(
        self, keys: Sequence[ClaimKey], answers: dict[str, Prepared], loop: asyncio.AbstractEventLoop
    ) -> list[ClaimKey]:
        """Prepare each claim into `answers`; the claims that wait for a handover."""
        waiting = []
        async with self._lock:
            unrecovered = await self._recovered()
            for key in keys:
                started = loop.time()
                try:
                    if unrecovered:
                        raise ClaimError(f"claim {key.namespace}/{key.name} is not prepared: {unrecovered}")
                    answers[key.uid] = Prepared(await self._prepare(key))
                except SlotHandover as err:
                    waiting.append(key)
                    answers[key.uid] = Prepared(error=bounded(str(err), 1000))
                except ClaimError as err:
                    log.warning("claim_not_prepared", claim=f"{key.namespace}/{key.name}", error=str(err))
                    answers[key.uid] = Prepared(error=bounded(str(err), 1000))
                if self._recorder is not None:
                    labels = prepare_labels(answers[key.uid].devices, self._node())
                    self._recorder.prepare_seconds(loop.time() - started, *labels)
            self._count()
        return waiting

    async def unprepare(self, keys: Sequence[ClaimKey]) -> dict[str, str]:
        """{claim UID: "" or why it failed} for every claim asked for."""
        answers = {}
        async with self._lock:
            unrecovered = await self._recovered()
            for key in keys:
                try:
                    if unrecovered:
                        raise ClaimError(f"claim {key.namespace}/{key.name} is not unprepared: {unrecovered}")
                    await self._unprepare(key)
                    answers[key.uid] = ""
                except ClaimError as err:
                    log.warning("claim_not_unprepared", claim=f"{key.namespace}/{key.name}", error=str(err))
                    answers[key.uid] = bounded(str(err), 1000)
            self._count()
        self._released.set()
        if self._changed is not None:
            self._changed()
        return answers

    async def reclaim_foreign(self, gpus: Collection[str], allocated: Sequence[str], catalog: Catalog) -> int:
        """Destroy the idle foreign instances of `gpus` no claim holds or is allocated (`reclaimForeign:
        idle`; `allocated`: the device names the claims of the node's pods are allocated, read after
        their devices were withdrawn), between prepares; how many. Nothing while the checkpoint cannot
        tell which are foreign."""
        async with self._lock:
            if self.ondemand is None or self.records.unknown or await self._recovered():
                return 0
            try:
                return await reclaim(self.ondemand, self.records, gpus, allocated, catalog)
            except ClaimError as err:  # the GPUs cannot be read: tried again next time
                log.warning("foreign_instances_not_reclaimed", error=str(err))
                return 0

    async def _prepare(self, key: ClaimKey) -> tuple[PreparedDevice, ...]:
        ref = f"{key.namespace}/{key.name}"
        _check_uid(key)
        if self.records.unknown:
            raise ClaimError(f"claim {ref} is not prepared: {self.records.unknown}")
        known = self.records.claims.get(key.uid)
        if known is not None and (known.namespace, known.name) != (key.namespace, key.name):
            raise ClaimError(
                f"claim {ref}: UID {key.uid} was prepared as claim {known.namespace}/{known.name}"
            )
        if known is not None and (self.records.has_spec(key.uid) or not known.devices):
            return known.devices  # prepared before (a kubelet retry, or after a restart)
        claim = await self._read(key)
        chosen = select(claim, self.pool, devices_by_name(self._inventory()))
        wanted = ondemand_results(claim)
        if wanted:
            return await prepare_ondemand(
                key, claim, chosen, wanted, ondemand=self.ondemand, records=self.records
            )
        check_config(claim, chosen)
        prepared = tuple(prepared_device(key.uid, c) for c in chosen)
        entries = [(claim_cdi_name(key.uid, c.result.device), c.device) for c in chosen]
        await self.records.write_spec(ref, key.uid, entries)
        record = PreparedClaim(
            key.namespace,
            key.name,
            key.uid,
            prepared,
            tuple(PreparedPod(p.name, p.uid) for p in claim.reserved_for),
        )
        await self.records.add(ref, record)
        log.info(
            "claim_prepared", claim=ref, uid=key.uid, devices=[d.device for d in prepared],
            pods=[p.name for p in record.pods],
        )  # fmt: skip
        return prepared

    async def _unprepare(self, key: ClaimKey) -> None:
        ref = f"{key.namespace}/{key.name}"
        _check_uid(key)
        known = self.records.claims.get(key.uid)
        if known is not None:
            await destroy_owned(self.ondemand, ref, known)
        await self.records.remove(ref, key.uid)

    async def _read(self, key: ClaimKey) -> ResourceClaimObject:
        ref = f"{key.namespace}/{key.name}"
        try:
            claim = await asyncio.to_thread(self._reader.get_resource_claim, key.namespace, key.name)
        except NotFoundError:
            raise ClaimError(f"claim {ref} does not exist in the API server") from None
        except KubeError as err:
            raise ClaimError(f"claim {ref}: cannot read it: {err}") from err
        if claim.uid != key.uid:
            raise ClaimError(
                f"claim {ref}: the kubelet asks for UID {key.uid}, the API server has UID {claim.uid} "
                "(the claim was deleted and made again)"
            )
        return claim

    def _count(self) -> None:
        if self._recorder is not None:
            self._recorder.prepared_claims(len(self.records.claims))


def prepare_labels(devices: Sequence[PreparedDevice], node: NodeState) -> tuple[str, bool]:
    """(profile, made on demand) of a prepared claim, what its prepare time is recorded by: the MIG
    profile of its devices (`gpu` for a whole GPU or a share of one, `several` when they differ,
    `unknown` for a MIG device the node no longer shows, `none` when the prepare failed), and whether
    any was made at prepare."""
    profiles = {_profile(d, node) for d in devices}
    profile = "none" if not profiles else profiles.pop() if len(profiles) == 1 else "several"
    return profile, any(d.instance is not None for d in devices)


def _profile(device: PreparedDevice, node: NodeState) -> str:
    if device.instance is not None:
        return device.instance.profile
    if device.uuid == device.gpu_uuid:
        return "gpu"
    gpu = node.gpu(device.gpu_uuid)
    mine = gpu.mig_devices if gpu is not None else ()
    return next((device_profile(gi, ci) for gi, ci in mine if ci.uuid == device.uuid), "unknown")


def _check_uid(key: ClaimKey) -> None:
    if not _UID.match(key.uid):
        raise ClaimError(f"claim {key.namespace}/{key.name}: {bounded(key.uid, 80)!r} is not a claim UID")
