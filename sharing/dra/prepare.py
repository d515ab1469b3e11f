"""Prepare and unprepare claims: read the claim, map its devices to ours, write its CDI spec, checkpoint.

Both are idempotent (the kubelet retries them, after its restarts too) and work from the checkpoint
(`sharing.store.claims`) across agent restarts: a claim prepared before is answered from it, and
unprepare never needs the API server, so it works after the claim and its pod are gone. Each claim
succeeds or fails alone: a failure is that claim's `error`, which the kubelet reports on the pod
(dra/v1 api.proto: "Failures for individual claims can be reported inside
NodePrepareResourcesResponse").

Order keeps a crash harmless: prepare writes the CDI spec, then the checkpoint, and only then answers;
unprepare removes the spec, then the checkpoint entry. A claim in the checkpoint holds its devices
(the rollout never destroys them) until its unprepare finished.

An on-demand MIG device (`sharing.dra.ondemand`) is made at prepare: the claim goes into the
checkpoint as pending first, then the instance is made, then the spec and the finished checkpoint
entry are written. Unprepare destroys it first (refused while it has processes: the claim's error,
and the kubelet retries), then removes the spec and the entry. At start, the instances the
checkpoint owns are adopted and a pending prepare is rolled forward or back; nothing else is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import structlog

from sharing.devices import Device, Inventory
from sharing.dra.claims import Chosen, ClaimError, check_config, ondemand_results, select
from sharing.dra.instances import Made, destroy_owned, made_device, mig_device, recover, undo
from sharing.dra.names import CDI_KIND, claim_cdi_file, claim_cdi_name, pool_device_name
from sharing.dra.ondemand import OnDemand, SlotHandover, occupant, placement_of
from sharing.errors import KubeError
from sharing.gpu import build_named_spec, write_spec
from sharing.gpu.devfiles import DeviceFiles
from sharing.kube.api import AllocatedDevice, NotFoundError, ResourceClaimObject
from sharing.model import MigUuid, NodeState
from sharing.store import (
    CheckpointError,
    ClaimCheckpoint,
    PreparedClaim,
    PreparedDevice,
    PreparedPod,
)
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

    def prepare_seconds(self, seconds: float) -> None:
        """The time one claim's prepare took, failed or not."""


@dataclass(frozen=True, slots=True)
class ClaimKey:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claim's answer: its devices, or why it failed (then `error` is set and devices is empty)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class PreparedClaims:
    """The claims prepared on this node; `unknown` says why that cannot be known (the checkpoint is
    unreadable), and then every device counts as held."""

    claims: tuple[PreparedClaim, ...] = ()
    unknown: str = ""

    def held(self) -> frozenset[str]:
        """The container UUIDs (GPU or MIG) the prepared claims hold; meaningless while `unknown`."""
        return frozenset(d.uuid for c in self.claims for d in c.devices if d.uuid)

    def ondemand(self) -> tuple[PreparedDevice, ...]:
        """The on-demand devices the prepared claims hold (their instances made for them)."""
        return tuple(d for c in self.claims for d in c.devices if d.instance is not None and d.uuid)


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
        self._node = node
        self._files = files
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self._recorder = recorder
        self._claims: dict[str, PreparedClaim] = {}
        self._unknown = ""
        self._unrecovered = ""
        """Why the on-demand instances the checkpoint owns could not be checked at start ("": they
        were); retried before each call, and until then nothing is prepared or unprepared."""
        self._lock = asyncio.Lock()
        self._released = asyncio.Event()
        """Set when an unprepare has run: a prepare waiting for a handover looks again."""

    async def load(self) -> None:
        """Read the checkpoint (at start); a bad one is logged and fails closed until it is fixed."""
        async with self._lock:
            try:
                self._claims = await asyncio.to_thread(self.checkpoint.load)
                self._unknown = ""
            except CheckpointError as err:
                self._claims, self._unknown = {}, str(err)
                log.error("dra_checkpoint_unreadable", path=str(self.checkpoint.path), error=str(err))
            else:
                if self.ondemand is not None:
                    self._unrecovered = await self._recover(self.ondemand)
                if not self._unrecovered:
                    await asyncio.to_thread(self._remove_stale_specs)
            self._count()
        log.info("dra_checkpoint_loaded", claims=len(self._claims))

    async def _recover(self, ondemand: OnDemand) -> str:
        """Settle the on-demand instances the checkpoint owns (`instances.recover`); why it could not
        be done, or ""."""
        if any(d.instance is not None for c in self._claims.values() for d in c.devices):
            try:
                claims, settled = await recover(ondemand, self._claims)
            except ClaimError as err:
                log.error("ondemand_recovery_failed", error=str(err))
                return f"the on-demand MIG instances of the checkpoint cannot be checked: {err}"
            for uid in settled:  # a spec written before the kill may lack devices: the retry writes it
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(write_spec, self.cdi_dir, None, claim_cdi_file(uid))
            if claims != self._claims:
                try:
                    await asyncio.to_thread(self.checkpoint.save, claims)
                except CheckpointError as err:
                    log.error("dra_checkpoint_unwritable", error=str(err))
                    return str(err)
                self._claims = claims
        try:
            await ondemand.forget_crashed_step()
        except ClaimError as err:  # harmless: the next step's journal replaces it
            log.warning("ondemand_journal_not_recovered", error=str(err))
        return ""

    async def _recovered(self) -> str:
        """ "" once the instances the checkpoint owns were checked (tried again now if they were not)."""
        if self._unrecovered and self.ondemand is not None:
            self._unrecovered = await self._recover(self.ondemand)
            if not self._unrecovered:
                await asyncio.to_thread(self._remove_stale_specs)
        return self._unrecovered

    def _remove_stale_specs(self) -> None:
        """Remove the CDI specs of claims the checkpoint does not hold: a crash between writing a
        spec and the checkpoint leaves one, for a prepare the kubelet never saw succeed."""
        prefix, suffix = claim_cdi_file("*").split("*")
        try:
            names = [n for n in os.listdir(self.cdi_dir) if n.startswith(prefix) and n.endswith(suffix)]
        except OSError:
            return  # no directory yet: nothing to remove
        for name in names:
            if name[len(prefix) : -len(suffix)] not in self._claims:
                with contextlib.suppress(OSError):
                    os.unlink(self.cdi_dir / name)
                    log.info("stale_cdi_spec_removed", path=str(self.cdi_dir / name))

    def prepared(self) -> PreparedClaims:
        """The claims prepared now (for the rollout's holders and for `sharing status`)."""
        making = next((c for c in self._claims.values() if c.pending), None)
        unknown = self._unknown or self._unrecovered
        if not unknown and making is not None:
            # Its instance may exist before its MIG UUID is recorded: hold everything meanwhile.
            unknown = f"claim {making.namespace}/{making.name} is being prepared (MIG instances being made)"
        return PreparedClaims(tuple(self._claims[u] for u in sorted(self._claims)), unknown)

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
                    self._recorder.prepare_seconds(loop.time() - started)
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

    async def _prepare(self, key: ClaimKey) -> tuple[PreparedDevice, ...]:
        ref = f"{key.namespace}/{key.name}"
        _check_uid(key)
        if self._unknown:
            raise ClaimError(f"claim {ref} is not prepared: {self._unknown}")
        known = self._claims.get(key.uid)
        if known is not None and (known.namespace, known.name) != (key.namespace, key.name):
            raise ClaimError(
                f"claim {ref}: UID {key.uid} was prepared as claim {known.namespace}/{known.name}"
            )
        spec_path = self.cdi_dir / claim_cdi_file(key.uid)
        if known is not None and (spec_path.exists() or not known.devices):
            return known.devices  # prepared before (a kubelet retry, or after a restart)
        claim = await self._read(key)
        chosen = select(claim, self.pool, devices_by_name(self._inventory()))
        wanted = ondemand_results(claim)
        if wanted:
            return await self._prepare_ondemand(key, claim, chosen, wanted)
        check_config(claim, chosen)
        prepared = tuple(self._device(key.uid, c) for c in chosen)
        entries = [(claim_cdi_name(key.uid, c.result.device), c.device) for c in chosen]
        await self._write_spec(ref, key.uid, entries)
        record = PreparedClaim(
            key.namespace,
            key.name,
            key.uid,
            prepared,
            tuple(PreparedPod(p.name, p.uid) for p in claim.reserved_for),
        )
        try:
            await asyncio.to_thread(self.checkpoint.save, {**self._claims, key.uid: record})
        except CheckpointError as err:
            # Unrecorded, the devices would count as free: hand nothing out.
            with contextlib.suppress(OSError):
                await asyncio.to_thread(write_spec, self.cdi_dir, None, claim_cdi_file(key.uid))
            raise ClaimError(f"claim {ref} is not prepared: {err}") from err
        self._claims[key.uid] = record
        log.info(
            "claim_prepared", claim=ref, uid=key.uid, devices=[d.device for d in prepared],
            pods=[p.name for p in record.pods],
        )  # fmt: skip
        return prepared

    async def _prepare_ondemand(
        self,
        key: ClaimKey,
        claim: ResourceClaimObject,
        chosen: Sequence[Chosen],
        wanted: Sequence[AllocatedDevice],
    ) -> tuple[PreparedDevice, ...]:
        """Make the claim's on-demand MIG devices (or find those made for it before), then its spec."""
        ref = f"{key.namespace}/{key.name}"
        od = self.ondemand
        if od is None:
            raise ClaimError(
                f"claim {ref}: device {bounded(wanted[0].device, 80)} is an on-demand MIG device, and "
                "this node makes none (no rule with `mig: dynamic`); delete the claim so that it is "
                "allocated again"
            )
        state = await od.observe()
        places = []
        for result in wanted:
            try:
                places.append((result, placement_of(state, result.device)))
            except ClaimError as err:
                raise ClaimError(f"claim {ref}: {err}") from None
        mine = {r.device: occupant(p, self._claims, key.uid, ref) for r, p in places}
        check_config(
            claim, (*chosen, *(Chosen(r, mig_device(p, MigUuid("(made at prepare)"))) for r, p in places))
        )
        static = tuple(self._device(key.uid, c) for c in chosen)
        pods = tuple(PreparedPod(p.name, p.uid) for p in claim.reserved_for)
        before = self._claims.get(key.uid)
        intent = PreparedClaim(
            key.namespace, key.name, key.uid,
            static + tuple(made_device(key.uid, r, p, mine[r.device]) for r, p in places),
            pods, pending=True,
        )  # fmt: skip
        await self._save({**self._claims, key.uid: intent}, ref)
        made: list[Made] = []
        try:
            for result, place in places:
                gi = mine[result.device]
                if gi is None or not gi.compute_instances:
                    made.append((result, place, await od.create(ref, place), gi is None))
                else:
                    made.append((result, place, gi, False))
            after = await od.observe()
            devices = static + tuple(made_device(key.uid, r, p, gi) for r, p, gi, _ in made)
            entries = [(claim_cdi_name(key.uid, c.result.device), c.device) for c in chosen] + [
                (claim_cdi_name(key.uid, r.device), mig_device(p, gi.compute_instances[0].uuid, gi))
                for r, p, gi, _ in made
            ]
            await self._write_spec(ref, key.uid, entries, after)
            record = PreparedClaim(key.namespace, key.name, key.uid, devices, pods)
            await self._save({**self._claims, key.uid: record}, ref)
        except ClaimError:
            left = await undo(od, ref, key.uid, made)
            await self._forget(
                ref, key.uid, before if not left else replace(intent, devices=left, pending=False)
            )
            raise
        log.info(
            "claim_prepared", claim=ref, uid=key.uid, devices=[d.device for d in devices],
            made=[p.where for _, p, _, new in made if new], pods=[p.name for p in pods],
        )  # fmt: skip
        return devices

    def _device(self, uid: str, c: Chosen) -> PreparedDevice:
        return PreparedDevice(
            # The kubelet matches a container's `resources.claims[].request` against these, so a
            # prioritized list's `<request>/<subrequest>` is named by its request, as the Go helper
            # names it (kubeletplugin/draplugin.go, stripSubrequestNames).
            requests=(c.result.request.partition("/")[0],),
            pool=c.result.pool,
            device=c.result.device,
            uuid=c.device.uuid,
            gpu_uuid=c.device.gpu_uuid,
            cdi_ids=(f"{CDI_KIND}={claim_cdi_name(uid, c.result.device)}",),
            share_id=c.result.share_id,
            admin_access=c.result.admin_access,
        )

    async def _forget(self, ref: str, uid: str, record: PreparedClaim | None) -> None:
        """After a failed prepare: the claim's spec gone, its checkpoint entry back to `record`."""
        with contextlib.suppress(OSError):
            await asyncio.to_thread(write_spec, self.cdi_dir, None, claim_cdi_file(uid))
        claims = {u: c for u, c in self._claims.items() if u != uid}
        if record is not None:
            claims[uid] = record
        try:
            await asyncio.to_thread(self.checkpoint.save, claims)
            self._claims = claims
        except CheckpointError as err:  # the intent stays: the next start settles it from the GPUs
            log.error("dra_checkpoint_unwritable", claim=ref, error=str(err))

    async def _save(self, claims: dict[str, PreparedClaim], ref: str) -> None:
        try:
            await asyncio.to_thread(self.checkpoint.save, claims)
        except CheckpointError as err:
            raise ClaimError(f"claim {ref} is not prepared: {err}") from err
        self._claims = claims

    async def _unprepare(self, key: ClaimKey) -> None:
        ref = f"{key.namespace}/{key.name}"
        _check_uid(key)
        known = self._claims.get(key.uid)
        if known is not None:
            await destroy_owned(self.ondemand, ref, known)
        try:
            await asyncio.to_thread(write_spec, self.cdi_dir, None, claim_cdi_file(key.uid))
        except OSError as err:
            raise ClaimError(
                f"claim {ref}: cannot remove its CDI spec {self.cdi_dir / claim_cdi_file(key.uid)}: "
                f"{err.strerror}"
            ) from err
        if key.uid not in self._claims:
            return  # never prepared here, or unprepared before (a retry)
        rest = {uid: c for uid, c in self._claims.items() if uid != key.uid}
        try:
            await asyncio.to_thread(self.checkpoint.save, rest)
        except CheckpointError as err:
            raise ClaimError(f"claim {ref} is not unprepared: {err}") from err
        self._claims = rest
        log.info("claim_unprepared", claim=ref, uid=key.uid)

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

    async def _write_spec(
        self, ref: str, uid: str, entries: Sequence[tuple[str, Device]], node: NodeState | None = None
    ) -> None:
        node = node if node is not None else self._node()
        spec = build_named_spec(CDI_KIND, entries, node, self._files)
        try:
            await asyncio.to_thread(write_spec, self.cdi_dir, spec, claim_cdi_file(uid))
        except OSError as err:
            raise ClaimError(
                f"claim {ref}: cannot write its CDI spec in {self.cdi_dir}: {err.strerror}"
            ) from err

    def _count(self) -> None:
        if self._recorder is not None:
            self._recorder.prepared_claims(len(self._claims))


def _check_uid(key: ClaimKey) -> None:
    if not _UID.match(key.uid):
        raise ClaimError(f"claim {key.namespace}/{key.name}: {bounded(key.uid, 80)!r} is not a claim UID")


def devices_by_name(inventory: Inventory) -> Mapping[str, Device]:
    """{pool device name: device} of everything the node offers (a replicated device once: its
    replicas are shares of it)."""
    found: dict[str, Device] = {}
    for _, devices in inventory.resources:
        for d in devices:
            found.setdefault(pool_device_name(d), d)
    return found
