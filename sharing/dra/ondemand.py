"""On-demand MIG devices: the instance a claim was allocated is made at prepare and destroyed at unprepare.

An allocation result whose device name parses as an on-demand name (`sharing.dra.names`,
`gpu-<i>-mig-<profile>-at-<start>`) names a slice to create: the GPU instance at exactly that
placement (nvmlDeviceCreateGpuInstanceWithPlacement, through the backend, which checks the start
against the driver's own placements list) and one compute instance spanning it. The scheduler never
allocates two overlapping placements (the counters of the partitionable devices), but anything on
the GPU that the checkpoint does not give to this claim (an instance another claim owns, or one this
agent never made) makes the claim fail with an error that names it; it is never destroyed. The one
exception is an instance this agent did not make, at exactly the allocated placement, that is one
whole MIG device: the device was published for it (`sharing.dra.foreign`), so the claim adopts it.

Every hardware step runs under the apply journal's lock (`sharing.store.Journal`: the agent's
rollout and `sharing apply` never change the GPUs at the same time) and is journaled before it
runs. The claim checkpoint is the authority on which instance belongs to which claim: the intent is
written before the first NVML call, the GPU instance and compute instance IDs after the last, so an
agent killed in between finds at start what to roll forward (the instance is complete: adopted for
the claim, the kubelet's retried prepare finds it) or back (a GPU instance without its compute
instance: destroyed; the retry makes it again).

A claim whose `MigDeviceConfig` asks for MPS (`sharing.dra.claims`) gets an MPS control daemon bound
to its MIG device (`sharing.gpu.mps`, started by the MPS keeper as the node's MPS GPUs' are) before
its prepare answers; the daemon's defaults are the claim's limits, so every client (every container
of every pod that uses the claim) gets them, and its CDI spec gives each container the daemon's pipe
directory. The daemon ends at unprepare, when no client is attached to its servers (a server stays
after its last client, and is a process of the MIG device until `quit` ends it), then the instance
is destroyed if nothing else runs there. One claim shared by
several pods is prepared once and unprepared when its last pod has gone (the kubelet's claim cache),
so the instance and its daemon live exactly as long as the claim has users.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import structlog

from sharing.devices import MpsSettings
from sharing.dra.claims import ClaimError
from sharing.dra.foreign import whole_device
from sharing.dra.names import parse_ondemand_name, profile_slug
from sharing.errors import BackendError
from sharing.gpu import GpuBackend
from sharing.gpu.backend import GpuBusyError
from sharing.gpu.mps import MpsDaemons, Servers
from sharing.mig.catalog import Profile
from sharing.model import Gpu, GpuInstance, GpuUuid, NodeState
from sharing.store import Journal, JournalError, JournalLockedError, OwnedInstance, PreparedClaim
from sharing.text import bounded

log = structlog.get_logger(__name__)

LOCK_POLL_S = 0.05


class InstanceBusyError(ClaimError):
    """The instance has processes (NVML IN_USE): it was not destroyed."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where an on-demand device goes: the GPU, the driver's profile and the start slot."""

    gpu: Gpu
    profile: Profile
    start: int

    @property
    def where(self) -> str:
        return f"{self.profile.name} at slot {self.start} of GPU {self.gpu.index} ({self.gpu.uuid})"


def placement_of(state: NodeState, device: str) -> Placement:
    """The placement an on-demand device name asks for, checked against what the driver reports."""
    parsed = parse_ondemand_name(device)
    if parsed is None:
        raise ClaimError(f"device {bounded(device, 80)} is not an on-demand MIG device")
    index, slug, start = parsed
    gpu = next((g for g in state.gpus if g.index == index), None)
    if gpu is None:
        raise ClaimError(f"device {device}: this node has no GPU {index}")
    if not gpu.mig_enabled:
        raise ClaimError(f"device {device}: GPU {index} is not in MIG mode, so no MIG device is made on it")
    known = gpu.profiles.profiles if gpu.profiles is not None else ()
    # Two profiles can share a slug (`1g.24gb+me` and `1g.24gb-me`): the one the slices offer is the
    # first, smallest first and then by name, so a name always means the profile that was published.
    ordered = sorted(known, key=lambda p: (p.size, p.compute_slices, p.memory_mib, p.name))
    profile = next((p for p in ordered if profile_slug(p.name) == slug), None)
    if profile is None:
        names = ", ".join(p.name for p in known) or "the driver lists none"
        raise ClaimError(f"device {device}: GPU {index} has no MIG profile {slug} (it has {names})")
    if start not in profile.placements:
        raise ClaimError(
            f"device {device}: {profile.name} cannot start at slot {start} on GPU {index} "
            f"(the driver's placements: {', '.join(map(str, profile.placements))})"
        )
    return Placement(gpu, profile, start)


def owner_of(claims: Mapping[str, PreparedClaim], gpu: GpuUuid, gi: GpuInstance) -> str | None:
    """The UID of the claim the checkpoint gives this GPU instance to, or None."""
    for uid, claim in claims.items():
        for d in claim.devices:
            if d.instance is not None and _is(d.instance, gpu, gi):
                return uid
    return None


def find(state: NodeState, owned: OwnedInstance, mig_uuid: str = "") -> GpuInstance | None:
    """The GPU instance the record names, if the GPU has it: same place and profile, same IDs once
    known, and the same MIG device when one was recorded (an ID the driver gave again to an
    instance made since, with another compute instance, is another instance). One left without
    its compute instance is the record's: an unprepare killed between the two destroys."""
    gpu = state.gpu(owned.gpu_uuid)
    if gpu is None:
        return None
    for gi in gpu.instances:
        if not _is(owned, gpu.uuid, gi):
            continue
        if mig_uuid and gi.compute_instances and not any(ci.uuid == mig_uuid for ci in gi.compute_instances):
            return None
        return gi
    return None


def _is(owned: OwnedInstance, gpu: GpuUuid, gi: GpuInstance) -> bool:
    return (
        owned.gpu_uuid == gpu
        and (owned.profile, owned.start) == (gi.profile, gi.start)
        and owned.gi_id in (None, gi.id)
    )


class SlotHandover(ClaimError):
    """The placement is held by another claim of this node's that is being released: the scheduler
    gave its slots to a new claim once the old one was deallocated, and the kubelet unprepares the
    old one (destroying its instance) when its pod has gone, which can come after."""


def occupant(
    place: Placement, claims: Mapping[str, PreparedClaim], uid: str, ref: str
) -> tuple[GpuInstance, bool] | None:
    """The instance this claim gets at the placement, and whether it is foreign (made by someone else:
    adopted, never made or destroyed here): its own (a repeated prepare), or one no claim holds that
    is one whole MIG device of the profile (`sharing.dra.foreign`); None when the slots are free;
    ClaimError naming what holds any of them otherwise."""
    end = place.start + place.profile.size
    for gi in place.gpu.instances:
        if not (gi.start < end and place.start < gi.start + gi.size):
            continue
        owner = owner_of(claims, place.gpu.uuid, gi)
        exact = (gi.profile, gi.start) == (place.profile.name, place.start)
        if owner == uid and exact:
            mine = [
                d.instance for d in claims[uid].devices if d.instance and _is(d.instance, place.gpu.uuid, gi)
            ]
            return gi, any(i.foreign for i in mine)
        if owner is None and exact and whole_device(gi, place.profile):
            return gi, True
        held_by = (
            f"claim {claims[owner].namespace}/{claims[owner].name}"
            if owner is not None
            else "no claim of this agent (made by someone else; it is left alone)"
        )
        kind = SlotHandover if owner is not None else ClaimError
        raise kind(
            f"claim {ref}: {place.where} is taken: GPU instance {gi.id} ({gi.profile} at slot {gi.start}) "
            f"is there, held by {held_by}; delete the claim (or its pod) so that it is allocated again"
        )
    return None


class OnDemand:
    """Makes and destroys the node's on-demand MIG instances, each step journaled under the lock, and
    runs the MPS control daemons of those a claim shares with MPS."""

    def __init__(
        self,
        backend: GpuBackend,
        journal: Journal,
        *,
        lock_wait_s: float = 30.0,
        mps: MpsDaemons | None = None,
    ) -> None:
        self.backend = backend
        self.journal = journal
        self.lock_wait_s = lock_wait_s
        self.mps = mps
        """The daemons of on-demand MIG devices shared with MPS; None: a claim asking for MPS fails."""

    async def serve_mps(self, ref: str, mig: str, settings: MpsSettings) -> None:
        """Have the MIG device's MPS control daemon enforce the claim's limits (started if it is not)."""
        if self.mps is None:
            raise ClaimError(f"claim {ref}: it asks for MPS, and this agent runs no MPS control daemons")
        try:
            await self.mps.serve(mig, settings)
        except BackendError as err:
            raise ClaimError(f"claim {ref}: the MPS control daemon of its MIG device {mig}: {err}") from err
        log.info("ondemand_mps_served", claim=ref, mig=mig, pipe=str(self.mps.pipe_dir(mig)),
                 active_thread_percentage=settings.active_thread_percentage,
                 pinned_memory_mib=settings.pinned_memory_mib)  # fmt: skip

    async def mps_servers(self, ref: str, mig: str) -> Servers:
        """The MPS servers of the MIG device's daemon and their clients (none without a daemon). A
        server without clients is no user: it stays after its last client (`sharing.model.beyond`)
        and ends with its daemon."""
        if self.mps is None:
            return Servers()
        try:
            return await self.mps.servers(mig)
        except BackendError as err:
            raise ClaimError(
                f"claim {ref}: cannot ask the MPS control daemon of {mig} for its clients: {err}"
            ) from err

    async def end_mps(self, ref: str, mig: str, *, restore_mode: bool = False) -> None:
        """Stop the MIG device's MPS control daemon (before its instance is destroyed; `restore_mode`:
        the instance stays, and its compute mode goes back to DEFAULT)."""
        if self.mps is None:
            raise ClaimError(
                f"claim {ref}: its MIG device {mig} has an MPS control daemon, and this agent runs none to "
                "stop it; its instance is kept until an agent that does unprepares the claim"
            )
        try:
            await self.mps.end(mig, restore_mode=restore_mode)
        except BackendError as err:
            raise ClaimError(f"claim {ref}: cannot stop the MPS control daemon of {mig}: {err}") from err

    async def observe(self) -> NodeState:
        try:
            return await self.backend.observe()
        except BackendError as err:
            raise ClaimError(f"cannot read the GPUs: {err}") from err

    async def create(self, ref: str, place: Placement) -> GpuInstance:
        """Make the GPU instance at the placement and its compute instance (one journaled step)."""
        step = f"create {place.profile.name}@{place.start} for claim {ref}"
        async with self._step(place.gpu.uuid, step):
            try:
                gi = await self.backend.create_instance(place.gpu.uuid, place.profile.name, place.start)
            except BackendError as err:
                raise ClaimError(f"claim {ref}: cannot make {place.where}: {err}") from err
        log.info("ondemand_instance_created", claim=ref, gpu=place.gpu.index, profile=gi.profile,
                 start=gi.start, gpu_instance=gi.id)  # fmt: skip
        return gi

    async def destroy(self, ref: str, gpu: str, gi: GpuInstance) -> None:
        """Destroy a GPU instance the checkpoint gives to claim `ref` (its compute instances first), or
        with `ref` "" an idle foreign one no claim holds (`reclaimForeign: idle`); InstanceBusyError
        when processes run on it (NVML IN_USE: nothing destroyed)."""
        whose = f"claim {ref}" if ref else "no claim (made by someone else, reclaimed while idle)"
        step = f"destroy {gi.profile}@{gi.start} (GPU instance {gi.id}) of {whose}"
        async with self._step(GpuUuid(gpu), step):
            try:
                await self.backend.destroy_instance(GpuUuid(gpu), gi.id)
            except GpuBusyError as err:
                raise InstanceBusyError(f"{whose}: {err}") from err
            except BackendError as err:
                raise ClaimError(f"{whose}: cannot destroy the MIG instance {gi.profile} at slot "
                                 f"{gi.start} (GPU instance {gi.id}) on {gpu}: {err}") from err  # fmt: skip
        log.info("ondemand_instance_destroyed", claim=ref or None, gpu=gpu, profile=gi.profile,
                 start=gi.start, gpu_instance=gi.id)  # fmt: skip

    async def forget_crashed_step(self) -> None:
        """Remove a journal that an on-demand step of a killed agent left (the checkpoint says what it
        did); a crashed rollout's journal (it has targets) is the rollout's to finish."""
        async with self._locked():
            unfinished = await asyncio.to_thread(self.journal.unfinished)
            if unfinished is not None and not unfinished.targets:
                log.warning("ondemand_journal_recovered", step=unfinished.in_flight)
                await asyncio.to_thread(self.journal.finish)

    @contextlib.asynccontextmanager
    async def _step(self, gpu: GpuUuid, step: str) -> AsyncIterator[None]:
        async with self._locked():
            unfinished = await asyncio.to_thread(self.journal.unfinished)
            if unfinished is not None and unfinished.targets:
                raise ClaimError(
                    f"{step}: waits for the GPU change a killed agent left half-done (journal "
                    f"{self.journal.path}) to be finished; the kubelet retries"
                )
            try:
                await asyncio.to_thread(self.journal.begin, {})
                n = await asyncio.to_thread(self.journal.step, gpu, step)
            except JournalError as err:
                raise ClaimError(f"{step}: {err}") from err
            try:
                yield
            finally:  # the step ended, done or failed cleanly: only a killed agent leaves the journal
                with contextlib.suppress(JournalError):
                    await asyncio.to_thread(self.journal.done, n)
                    await asyncio.to_thread(self.journal.finish)

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """The journal's lock, waited for while the rollout (or `sharing apply`) holds it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lock_wait_s
        with contextlib.ExitStack() as stack:
            while True:
                try:
                    stack.enter_context(self.journal.locked())
                    break
                except JournalLockedError as err:
                    if loop.time() >= deadline:
                        raise ClaimError(f"the GPUs are being changed: {err}; the kubelet retries") from err
                    await asyncio.sleep(LOCK_POLL_S)
                except JournalError as err:
                    raise ClaimError(str(err)) from err
            yield
