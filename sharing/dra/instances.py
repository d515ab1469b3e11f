"""The claims' side of on-demand MIG instances: how prepare makes them, what the checkpoint keeps of each,
how a failed or killed prepare is undone, and how unprepare destroys them.

The checkpoint (`sharing.store.claims`) is the authority: an instance is destroyed only when it is the
one recorded for the claim (same GPU, profile, placement and IDs, and the recorded MIG device), never
while processes run on it. At start, `recover` (recorded by `settle`) adopts what the checkpoint owns
and settles a prepare a killed agent left pending: a complete instance is rolled forward (kept for the
claim; the kubelet's retried prepare finds it), a GPU instance without its compute instance is rolled
back (destroyed; the retry makes it again), and what could not be destroyed stays owned, so it is never
lost. Nothing else on the GPUs is touched. An instance the claim adopted (`foreign`, made by someone
else: `sharing.dra.foreign`) is recorded the same way but never made or destroyed here: prepare
takes it as it is, unprepare and recovery leave it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import structlog

from sharing.devices import Device, DeviceId, Health, MpsSettings
from sharing.dra.claims import Chosen, ClaimError, ClaimKey, check_config, prepared_device
from sharing.dra.foreign import reclaimable
from sharing.dra.names import CDI_KIND, claim_cdi_name
from sharing.dra.ondemand import InstanceBusyError, OnDemand, Placement, find, occupant, placement_of
from sharing.dra.records import ClaimRecords
from sharing.kube.api import AllocatedDevice, ResourceClaimObject
from sharing.mig import Catalog
from sharing.model import GpuInstance, MigUuid, NodeState
from sharing.store import CheckpointError, OwnedInstance, PreparedClaim, PreparedDevice, PreparedPod
from sharing.text import bounded

log = structlog.get_logger(__name__)

Made = tuple[AllocatedDevice, Placement, GpuInstance, bool]
"""An on-demand device of a prepare: its result, placement, instance, and whether this prepare made it."""


def made_device(
    uid: str,
    result: AllocatedDevice,
    place: Placement,
    gi: GpuInstance | None,
    *,
    mps: MpsSettings | None = None,
    foreign: bool = False,
) -> PreparedDevice:
    """An on-demand device as the checkpoint keeps it (with the limits of its MPS daemon, if it has
    one); without `gi` (or its compute instance) it is the intent to make it; `foreign`: the instance
    was there, made by someone else, and is adopted."""
    ci = gi.compute_instances[0] if gi is not None and gi.compute_instances else None
    return PreparedDevice(
        requests=(result.request.partition("/")[0],),
        pool=result.pool,
        device=result.device,
        uuid="" if ci is None else ci.uuid,
        gpu_uuid=place.gpu.uuid,
        cdi_ids=(f"{CDI_KIND}={claim_cdi_name(uid, result.device)}",),
        share_id=result.share_id,
        admin_access=result.admin_access,
        instance=OwnedInstance(
            place.gpu.uuid,
            place.profile.name,
            place.start,
            place.profile.size,
            None if gi is None else gi.id,
            None if ci is None else ci.id,
            foreign,
        ),
        mps=mps,
    )


def mig_device(place: Placement, mig: MigUuid, gi: GpuInstance | None = None, *, mps: bool = False) -> Device:
    """The inventory's view of an on-demand MIG device (for the claim checks and the CDI spec); `mps`:
    a client of its own MPS daemon."""
    ci = gi.compute_instances[0] if gi is not None and gi.compute_instances else None
    index = "" if ci is None or ci.mig_index is None else f"{place.gpu.index}:{ci.mig_index}"
    return Device(
        DeviceId(mig), Health.HEALTHY, place.gpu.numa_node, place.gpu.uuid, mig_uuid=mig, index=index, mps=mps
    )


def with_made(state: NodeState, made: Sequence[Made]) -> NodeState:
    """The node as observed before a prepare, with the instances it made (or found) in place of what
    was at their placements: what the claim's CDI spec is written from."""
    gpus = []
    for gpu in state.gpus:
        mine = [gi for _, place, gi, _ in made if place.gpu.uuid == gpu.uuid]
        kept = [gi for gi in gpu.instances if all(gi.start != m.start for m in mine)]
        instances = tuple(sorted((*kept, *mine), key=lambda g: (g.start, g.id)))
        gpus.append(replace(gpu, instances=instances) if mine else gpu)
    return replace(state, gpus=tuple(gpus))


async def undo(
    ondemand: OnDemand, ref: str, uid: str, made: Sequence[Made], served: Mapping[str, MpsSettings]
) -> tuple[PreparedDevice, ...]:
    """A prepare that failed half-way: destroy what it made (its MPS daemon first, of those in
    `served`, by MIG UUID, as unprepare does); the devices that could not be destroyed."""
    left = []
    for result, place, gi, new in made:
        if not new:
            continue
        mig = gi.compute_instances[0].uuid if gi.compute_instances else ""
        d = made_device(uid, result, place, gi, mps=served.get(mig))
        try:
            await _end_and_destroy(ondemand, ref, d, gi)
        except ClaimError as err:
            log.error("ondemand_undo_failed", claim=ref, device=result.device, error=str(err))
            left.append(d)
    return tuple(left)


async def destroy_owned(ondemand: OnDemand | None, ref: str, claim: PreparedClaim) -> None:
    """Destroy the instances made for the claim, never one with processes (then ClaimError: the
    kubelet retries the unprepare), never one the checkpoint does not give it, never one it adopted
    (foreign: `reclaimForeign: idle` may destroy that once no claim holds it); an MPS daemon of the
    claim's goes first, when no client is attached to its servers (an adopted instance's compute mode
    is put back then: it stays)."""
    owned = [d for d in claim.devices if d.instance is not None]
    if not owned:
        return
    if ondemand is None:
        raise ClaimError(
            f"claim {ref}: it holds on-demand MIG devices ({', '.join(d.device for d in owned)}) "
            "and this agent makes none now; they are kept until an agent that makes them "
            "unprepares the claim"
        )
    state = await ondemand.observe()
    for d in owned:
        assert d.instance is not None
        gi = find(state, d.instance, d.uuid)
        if gi is None:
            log.info("ondemand_instance_gone", claim=ref, device=d.device, mig=d.uuid)
            if d.mps is not None and d.uuid:
                await ondemand.end_mps(ref, d.uuid)
            continue
        if d.instance.foreign:
            await _end_mps(ondemand, ref, d, gi, restore_mode=True)
            log.info("ondemand_foreign_instance_left", claim=ref, device=d.device, mig=d.uuid)
            continue
        await _end_and_destroy(ondemand, ref, d, gi)


async def _end_and_destroy(ondemand: OnDemand, ref: str, d: PreparedDevice, gi: GpuInstance) -> None:
    """Stop the device's MPS daemon (if it has one) unless clients are attached to its servers, then
    destroy its instance unless processes run there; ClaimError (nothing more done) otherwise.

    The daemon's servers without clients are no users: one stays after its last client, a process of
    the MIG device until `quit` ends it (`sharing.model.beyond`). So its clients are asked of the
    daemon first, then the instance's processes of NVML: before the quit, all but those idle servers
    count; after it, every one (the quit ended them).
    """
    assert d.instance is not None
    found = await _end_mps(ondemand, ref, d, gi)
    if found is None:
        return
    gi = found
    if any(ci.busy for ci in gi.compute_instances):
        raise ClaimError(busy_message(ref, d))
    try:
        await ondemand.destroy(ref, d.instance.gpu_uuid, gi)
    except InstanceBusyError:
        raise ClaimError(busy_message(ref, d)) from None


async def _end_mps(
    ondemand: OnDemand, ref: str, d: PreparedDevice, gi: GpuInstance, *, restore_mode: bool = False
) -> GpuInstance | None:
    """Stop the device's MPS daemon, if it has one, unless clients are attached to its servers
    (ClaimError); the instance as it is after (None: gone)."""
    assert d.instance is not None
    if d.mps is None or not d.uuid:
        return gi
    servers = await ondemand.mps_servers(ref, d.uuid)
    if servers.serving or any(ci.busy_beyond(servers.idle) for ci in gi.compute_instances):
        raise ClaimError(busy_message(ref, d, servers.clients))
    await ondemand.end_mps(ref, d.uuid, restore_mode=restore_mode)
    return find(await ondemand.observe(), d.instance, d.uuid)


def busy_message(ref: str, d: PreparedDevice, clients: Sequence[int] = ()) -> str:
    where = "" if d.instance is None else f" ({d.instance.profile} at slot {d.instance.start})"
    mps = f" (MPS clients, PIDs {', '.join(map(str, clients[:8]))})" if clients else ""
    return (
        f"claim {ref}: its MIG device {d.uuid or d.device}{where} still has processes running on it{mps}; "
        "it is not destroyed while they run, and the kubelet retries the unprepare until they have ended"
    )


async def recover(
    ondemand: OnDemand, claims: Mapping[str, PreparedClaim]
) -> tuple[dict[str, PreparedClaim], tuple[str, ...]]:
    """The checkpoint after adopting what it owns and settling pending prepares, and the UIDs of the
    claims settled (their CDI specs may lack devices). ClaimError when the GPUs cannot be read."""
    state = await ondemand.observe()
    after = dict(claims)
    settled = []
    for uid, claim in claims.items():
        ref = f"{claim.namespace}/{claim.name}"
        if not claim.pending:
            for d in claim.devices:
                if d.instance is None:
                    continue
                gi = find(state, d.instance, d.uuid)
                event = (
                    "ondemand_instance_lost" if gi is None
                    else "ondemand_instance_adopted" if gi.compute_instances
                    else "ondemand_unprepare_unfinished"  # the kubelet's retried unprepare ends it
                )  # fmt: skip
                log.info(event, claim=ref, device=d.device, mig=d.uuid)
                if gi is not None and gi.compute_instances and d.mps is not None:
                    await _keep_serving(ondemand, ref, d.uuid, d.mps)
            continue
        if any(d.instance is not None and state.gpu(d.instance.gpu_uuid) is None for d in claim.devices):
            # Its GPU cannot be read now: what is there is unknown, so the intent stays as it is.
            log.warning("ondemand_recovery_deferred", claim=ref)
            continue
        kept = []
        for d in claim.devices:
            gi = None if d.instance is None else find(state, d.instance)
            if d.instance is None or gi is None:
                continue
            if gi.compute_instances:
                ci = gi.compute_instances[0]
                kept.append(replace(d, uuid=ci.uuid, instance=replace(d.instance, gi_id=gi.id, ci_id=ci.id)))
                log.warning("ondemand_prepare_rolled_forward", claim=ref, device=d.device)
                continue
            if d.instance.foreign:  # not ours to destroy: someone took its compute instance meanwhile
                log.warning("ondemand_foreign_instance_not_adopted", claim=ref, device=d.device)
                continue
            try:
                await ondemand.destroy(ref, d.instance.gpu_uuid, gi)
                log.warning("ondemand_prepare_rolled_back", claim=ref, device=d.device)
            except ClaimError as err:  # still there: keep it owned, so it is never lost
                kept.append(replace(d, instance=replace(d.instance, gi_id=gi.id)))
                log.error("ondemand_rollback_failed", claim=ref, device=d.device, error=str(err))
        if kept:
            after[uid] = replace(claim, devices=tuple(kept), pending=False)
        else:
            del after[uid]
        settled.append(uid)
    return after, tuple(settled)


async def _keep_serving(ondemand: OnDemand, ref: str, mig: str, settings: MpsSettings) -> None:
    """An adopted device's MPS daemon: still serving (the MPS keeper outlives the agent's container),
    or started again; a failure is logged (the claim's pods reach no daemon until it is fixed)."""
    try:
        await ondemand.serve_mps(ref, mig, settings)
    except ClaimError as err:
        log.error("ondemand_mps_not_served", claim=ref, mig=mig, error=str(err))


async def settle(ondemand: OnDemand, records: ClaimRecords) -> str:
    """Settle the on-demand instances the checkpoint owns (`recover`) and record the outcome; why it
    could not be done, or ""."""
    if any(d.instance is not None for c in records.claims.values() for d in c.devices):
        try:
            claims, settled = await recover(ondemand, records.claims)
        except ClaimError as err:
            log.error("ondemand_recovery_failed", error=str(err))
            return f"the on-demand MIG instances of the checkpoint cannot be checked: {err}"
        for uid in settled:  # a spec written before the kill may lack devices: the retry writes it
            await records.drop_spec(uid)
        if claims != records.claims:
            try:
                await asyncio.to_thread(records.checkpoint.save, claims)
            except CheckpointError as err:
                log.error("dra_checkpoint_unwritable", error=str(err))
                return str(err)
            records.claims = claims
    try:
        await ondemand.forget_crashed_step()
    except ClaimError as err:  # harmless: the next step's journal replaces it
        log.warning("ondemand_journal_not_recovered", error=str(err))
    return ""


async def reclaim(
    ondemand: OnDemand,
    records: ClaimRecords,
    gpus: Collection[str],
    allocated: Sequence[str],
    catalog: Catalog,
) -> int:
    """Destroy the idle foreign instances of `gpus` (dynamic, `reclaimForeign: idle`) that no claim of
    the checkpoint holds and none is allocated (`sharing.dra.foreign.reclaimable`); how many. One that
    has processes by the time it is destroyed (NVML IN_USE) is left, and tried again next time."""
    state = await ondemand.observe()
    done = 0
    for f in reclaimable(state, gpus, records.claims.values(), allocated, catalog):
        gi = f.instance
        try:
            await ondemand.destroy("", f.gpu.uuid, gi)
        except ClaimError as err:
            log.info(
                "foreign_instance_kept", gpu=f.gpu.index, profile=gi.profile, start=gi.start, error=str(err)
            )
            continue
        log.warning("foreign_instance_reclaimed", gpu=f.gpu.index, profile=gi.profile, start=gi.start,
                    gpu_instance=gi.id)  # fmt: skip
        done += 1
    return done


async def prepare_ondemand(
    key: ClaimKey,
    claim: ResourceClaimObject,
    chosen: Sequence[Chosen],
    wanted: Sequence[AllocatedDevice],
    *,
    ondemand: OnDemand | None,
    records: ClaimRecords,
) -> tuple[PreparedDevice, ...]:
    """Make the claim's on-demand MIG devices (or find those made for it before), then its spec; the
    claim is in the checkpoint as pending before the first instance is made."""
    ref = f"{key.namespace}/{key.name}"
    if ondemand is None:
        raise ClaimError(
            f"claim {ref}: device {bounded(wanted[0].device, 80)} is an on-demand MIG device, and "
            "this node makes none (no rule with `mig: dynamic`); delete the claim so that it is "
            "allocated again"
        )
    state = await ondemand.observe()
    places = []
    for result in wanted:
        try:
            places.append((result, placement_of(state, result.device)))
        except ClaimError as err:
            raise ClaimError(f"claim {ref}: {err}") from None
    mine = {r.device: occupant(p, records.claims, key.uid, ref) for r, p in places}
    foreign = {device for device, found in mine.items() if found is not None and found[1]}
    asked = check_config(
        claim, (*chosen, *(Chosen(r, mig_device(p, MigUuid("(made at prepare)"))) for r, p in places))
    )
    mps = {
        r.device: asked[r.device].settings(ref, r.device, p.profile.name, p.profile.memory_mib)
        for r, p in places
        if r.device in asked
    }
    if mps and ondemand.mps is None:
        raise ClaimError(f"claim {ref}: it asks for MPS, and this agent runs no MPS control daemons")
    static = tuple(prepared_device(key.uid, c) for c in chosen)
    pods = tuple(PreparedPod(p.name, p.uid) for p in claim.reserved_for)
    before = records.claims.get(key.uid)
    intent = PreparedClaim(
        key.namespace, key.name, key.uid,
        static + tuple(
            made_device(
                key.uid, r, p, _gi(mine[r.device]), mps=mps.get(r.device), foreign=r.device in foreign
            )
            for r, p in places
        ),
        pods, pending=True,
    )  # fmt: skip
    await records.save({**records.claims, key.uid: intent}, ref)
    made: list[Made] = []
    served: dict[str, MpsSettings] = {}
    try:
        for result, place in places:
            gi = _gi(mine[result.device])
            if result.device in foreign and (gi is None or not gi.compute_instances):
                raise ClaimError(
                    f"claim {ref}: the MIG instance it adopted at {place.where} has no compute "
                    "instance now (changed by someone else); it is left as it is"
                )
            if gi is None or not gi.compute_instances:
                made.append((result, place, await ondemand.create(ref, place), gi is None))
            else:
                made.append((result, place, gi, False))
        for r, _, gi, _ in made:  # before the prepare answers: the first client finds its daemon
            if r.device in mps:
                served[gi.compute_instances[0].uuid] = mps[r.device]
                await ondemand.serve_mps(ref, gi.compute_instances[0].uuid, mps[r.device])
        after = with_made(state, made)  # not the whole node read again: each create said what it made
        devices = static + tuple(
            made_device(key.uid, r, p, gi, mps=mps.get(r.device), foreign=r.device in foreign)
            for r, p, gi, _ in made
        )
        entries = [(claim_cdi_name(key.uid, c.result.device), c.device) for c in chosen] + [
            (
                claim_cdi_name(key.uid, r.device),
                mig_device(p, gi.compute_instances[0].uuid, gi, mps=r.device in mps),
            )
            for r, p, gi, _ in made
        ]
        await records.write_spec(ref, key.uid, entries, after)
        record = PreparedClaim(key.namespace, key.name, key.uid, devices, pods)
        await records.save({**records.claims, key.uid: record}, ref)
    except ClaimError:
        left = await undo(ondemand, ref, key.uid, made, served)
        await records.forget(
            ref, key.uid, before if not left else replace(intent, devices=left, pending=False)
        )
        raise
    log.info(
        "claim_prepared", claim=ref, uid=key.uid, devices=[d.device for d in devices],
        made=[p.where for _, p, _, new in made if new], pods=[p.name for p in pods], mps=sorted(served),
        adopted=[p.where for r, p, _, _ in made if r.device in foreign],
    )  # fmt: skip
    return devices


def _gi(found: tuple[GpuInstance, bool] | None) -> GpuInstance | None:
    return None if found is None else found[0]
