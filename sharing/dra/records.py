"""What a prepared claim leaves on the node: its CDI spec and its entry in the checkpoint, written in the
order that keeps a crash harmless.

Prepare writes the claim's CDI spec, then the checkpoint, and only then answers; unprepare removes the
spec, then the checkpoint entry. A claim in the checkpoint holds its devices (the rollout never
destroys them) until its unprepare finished, and a spec without a checkpoint entry belongs to a
prepare the kubelet never saw succeed: it is removed at start. The checkpoint (`sharing.store.claims`)
is written atomically; one that is not what the agent writes fails closed (no claim is prepared, every
device counts as held) until a person moves it away.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from sharing.devices import DEFAULT_MPS_ROOT, Device
from sharing.dra.claims import ClaimError
from sharing.dra.names import CDI_KIND, claim_cdi_file
from sharing.gpu import build_named_spec, write_spec
from sharing.gpu.devfiles import DeviceFiles
from sharing.model import NodeState
from sharing.store import CheckpointError, ClaimCheckpoint, PreparedClaim, PreparedDevice

log = structlog.get_logger(__name__)


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


class ClaimRecords:
    """The CDI specs and the checkpoint of the claims prepared on this node, and the claims as recorded."""

    def __init__(
        self,
        *,
        cdi_dir: Path,
        checkpoint: ClaimCheckpoint,
        files: DeviceFiles,
        node: Callable[[], NodeState],
        mps_root: str = DEFAULT_MPS_ROOT,
    ) -> None:
        self.cdi_dir = cdi_dir
        self.mps_root = mps_root
        """mpsRoot: where the pipe directories of the MPS daemons a spec's devices are clients of are."""
        self.checkpoint = checkpoint
        self._files = files
        self._node = node
        self.claims: dict[str, PreparedClaim] = {}
        """{claim UID: claim} as the checkpoint holds them."""
        self.unknown = ""
        """Why the checkpoint cannot be read ("": it can)."""

    async def load(self) -> bool:
        """Read the checkpoint (at start); a bad one is logged and fails closed until it is fixed."""
        try:
            self.claims = await asyncio.to_thread(self.checkpoint.load)
            self.unknown = ""
        except CheckpointError as err:
            self.claims, self.unknown = {}, str(err)
            log.error("dra_checkpoint_unreadable", path=str(self.checkpoint.path), error=str(err))
            return False
        return True

    async def save(self, claims: dict[str, PreparedClaim], ref: str) -> None:
        """Record `claims` as the prepared ones; ClaimError (claim `ref` is not prepared) when that fails."""
        try:
            await asyncio.to_thread(self.checkpoint.save, claims)
        except CheckpointError as err:
            raise ClaimError(f"claim {ref} is not prepared: {err}") from err
        self.claims = claims

    async def add(self, ref: str, record: PreparedClaim) -> None:
        """Record a prepared claim whose spec is written; unrecorded, its devices would count as free:
        its spec goes, and ClaimError says why."""
        try:
            await asyncio.to_thread(self.checkpoint.save, {**self.claims, record.uid: record})
        except CheckpointError as err:
            await self.drop_spec(record.uid)
            raise ClaimError(f"claim {ref} is not prepared: {err}") from err
        self.claims[record.uid] = record

    async def forget(self, ref: str, uid: str, record: PreparedClaim | None) -> None:
        """After a failed prepare: the claim's spec gone, its checkpoint entry back to `record`."""
        await self.drop_spec(uid)
        claims = {u: c for u, c in self.claims.items() if u != uid}
        if record is not None:
            claims[uid] = record
        try:
            await asyncio.to_thread(self.checkpoint.save, claims)
            self.claims = claims
        except CheckpointError as err:  # the intent stays: the next start settles it from the GPUs
            log.error("dra_checkpoint_unwritable", claim=ref, error=str(err))

    async def remove(self, ref: str, uid: str) -> None:
        """Unprepared: the claim's spec, then its checkpoint entry, gone; ClaimError when either is not."""
        try:
            await asyncio.to_thread(write_spec, self.cdi_dir, None, claim_cdi_file(uid))
        except OSError as err:
            raise ClaimError(
                f"claim {ref}: cannot remove its CDI spec {self.cdi_dir / claim_cdi_file(uid)}: "
                f"{err.strerror}"
            ) from err
        if uid not in self.claims:
            return  # never prepared here, or unprepared before (a retry)
        rest = {u: c for u, c in self.claims.items() if u != uid}
        try:
            await asyncio.to_thread(self.checkpoint.save, rest)
        except CheckpointError as err:
            raise ClaimError(f"claim {ref} is not unprepared: {err}") from err
        self.claims = rest
        log.info("claim_unprepared", claim=ref, uid=uid)

    def has_spec(self, uid: str) -> bool:
        """Whether the claim's CDI spec is written."""
        return (self.cdi_dir / claim_cdi_file(uid)).exists()

    async def write_spec(
        self, ref: str, uid: str, entries: Sequence[tuple[str, Device]], node: NodeState | None = None
    ) -> None:
        """The claim's CDI spec, one device per (CDI name, device); ClaimError when it cannot be written."""
        node = node if node is not None else self._node()
        spec = build_named_spec(CDI_KIND, entries, node, self._files, mps_root=self.mps_root)
        try:
            await asyncio.to_thread(write_spec, self.cdi_dir, spec, claim_cdi_file(uid))
        except OSError as err:
            raise ClaimError(
                f"claim {ref}: cannot write its CDI spec in {self.cdi_dir}: {err.strerror}"
            ) from err

    async def drop_spec(self, uid: str) -> None:
        """Remove the claim's CDI spec if it can be (what fails is left for a retry)."""
        with contextlib.suppress(OSError):
            await asyncio.to_thread(write_spec, self.cdi_dir, None, claim_cdi_file(uid))

    def remove_stale_specs(self) -> None:
        """Remove the CDI specs of claims the checkpoint does not hold: a crash between writing a
        spec and the checkpoint leaves one, for a prepare the kubelet never saw succeed."""
        prefix, suffix = claim_cdi_file("*").split("*")
        try:
            names = [n for n in os.listdir(self.cdi_dir) if n.startswith(prefix) and n.endswith(suffix)]
        except OSError:
            return  # no directory yet: nothing to remove
        for name in names:
            if name[len(prefix) : -len(suffix)] not in self.claims:
                with contextlib.suppress(OSError):
                    os.unlink(self.cdi_dir / name)
                    log.info("stale_cdi_spec_removed", path=str(self.cdi_dir / name))
