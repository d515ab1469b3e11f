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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from sharing.devices import Device, Inventory
from sharing.dra.claims import ClaimError, check_config, select
from sharing.dra.names import CDI_KIND, claim_cdi_file, claim_cdi_name, pool_device_name
from sharing.errors import KubeError
from sharing.gpu import build_named_spec, write_spec
from sharing.gpu.devfiles import DeviceFiles
from sharing.kube.api import NotFoundError, ResourceClaimObject
from sharing.model import NodeState
from sharing.store import CheckpointError, ClaimCheckpoint, PreparedClaim, PreparedDevice, PreparedPod
from sharing.text import bounded

log = structlog.get_logger(__name__)

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
        return frozenset(d.uuid for c in self.claims for d in c.devices)


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
    ) -> None:
        self.pool = pool
        self._reader = claims
        self._inventory = inventory
        self._node = node
        self._files = files
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self._recorder = recorder
        self._claims: dict[str, PreparedClaim] = {}
        self._unknown = ""
        self._lock = asyncio.Lock()

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
                await asyncio.to_thread(self._remove_stale_specs)
            self._count()
        log.info("dra_checkpoint_loaded", claims=len(self._claims))

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
        return PreparedClaims(tuple(self._claims[u] for u in sorted(self._claims)), self._unknown)

    async def prepare(self, keys: Sequence[ClaimKey]) -> dict[str, Prepared]:
        """{claim UID: its devices or its error} for every claim asked for."""
        answers = {}
        loop = asyncio.get_running_loop()
        async with self._lock:
            for key in keys:
                started = loop.time()
                try:
                    answers[key.uid] = Prepared(await self._prepare(key))
                except ClaimError as err:
                    log.warning("claim_not_prepared", claim=f"{key.namespace}/{key.name}", error=str(err))
                    answers[key.uid] = Prepared(error=bounded(str(err), 1000))
                if self._recorder is not None:
                    self._recorder.prepare_seconds(loop.time() - started)
            self._count()
        return answers

    async def unprepare(self, keys: Sequence[ClaimKey]) -> dict[str, str]:
        """{claim UID: "" or why it failed} for every claim asked for."""
        answers = {}
        async with self._lock:
            for key in keys:
                try:
                    await self._unprepare(key)
                    answers[key.uid] = ""
                except ClaimError as err:
                    log.warning("claim_not_unprepared", claim=f"{key.namespace}/{key.name}", error=str(err))
                    answers[key.uid] = bounded(str(err), 1000)
            self._count()
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
        check_config(claim, chosen)
        prepared = tuple(
            PreparedDevice(
                # The kubelet matches a container's `resources.claims[].request` against these, so a
                # prioritized list's `<request>/<subrequest>` is named by its request, as the Go helper
                # names it (kubeletplugin/draplugin.go, stripSubrequestNames).
                requests=(c.result.request.partition("/")[0],),
                pool=c.result.pool,
                device=c.result.device,
                uuid=c.device.uuid,
                gpu_uuid=c.device.gpu_uuid,
                cdi_ids=(f"{CDI_KIND}={claim_cdi_name(key.uid, c.result.device)}",),
                share_id=c.result.share_id,
                admin_access=c.result.admin_access,
            )
            for c in chosen
        )
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

    async def _unprepare(self, key: ClaimKey) -> None:
        ref = f"{key.namespace}/{key.name}"
        _check_uid(key)
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

    async def _write_spec(self, ref: str, uid: str, entries: Sequence[tuple[str, Device]]) -> None:
        node = self._node()
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
