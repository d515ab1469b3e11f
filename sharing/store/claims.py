"""The DRA front-end's checkpoint: the claims prepared on this node, kept on disk between prepare and
unprepare.

The kubelet may call NodeUnprepareResources in another process than the one that prepared the claim
(an agent restart, a rolling update), after the claim and its pod are gone from the API server, and
it retries both calls after its own restarts; the Go helper says to keep such a checkpoint
(https://github.com/kubernetes/dynamic-resource-allocation/blob/master/kubeletplugin/draplugin.go,
"NodeUnprepareResources"). The devices a prepared claim holds count as held for every change of the
GPUs, so losing this file would let a change destroy a device in use: it is written atomically
(temp file, fsync, rename) and read strictly. A file that is not what this code writes is an error
that names the file and is left where it is for a person to look at, never overwritten (the claims it
lists would be forgotten) and never half-trusted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharing.devices import MpsSettings
from sharing.errors import SharingError
from sharing.store.files import NotAFileError, read_capped
from sharing.text import bounded

VERSION = 1
MAX_BYTES = 8 << 20
"""A node prepares a few hundred claims at most (256 pods per claim, a few devices each)."""


class CheckpointError(SharingError):
    """The checkpoint cannot be read or written."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint holds what this code never writes; nothing in it is trusted."""


@dataclass(frozen=True, slots=True)
class OwnedInstance:
    """A MIG instance the agent created for a claim (an on-demand device), or one it adopted for it
    (`foreign`): the checkpoint is the authority on which instances are the agent's, so nothing else
    is ever destroyed.

    `gi_id` is None while the instance is being made: the intent is on disk before the NVML call, so
    a crash in between is rolled forward (the instance is complete: adopted) or back (half-built:
    destroyed) from what the GPU really has at `start`."""

    gpu_uuid: str
    profile: str
    start: int
    size: int
    gi_id: int | None = None
    ci_id: int | None = None
    foreign: bool = False
    """Made by someone else (a static config, mig-parted, nvidia-smi) and adopted for the claim: its
    unprepare leaves it where it is (`sharing.dra.foreign`)."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim: the allocation result, the device it maps to, its CDI names."""

    requests: tuple[str, ...]
    pool: str
    device: str
    """The DRA device name in the pool (`gpu-0`, `gpu-0-mig-1`)."""
    uuid: str
    """The UUID a container gets (MIG UUID for a MIG device), what the rollout counts as held."""
    gpu_uuid: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None
    admin_access: bool = False
    instance: OwnedInstance | None = None
    """The MIG instance made for this device at prepare (on-demand devices only)."""
    mps: MpsSettings | None = None
    """The limits of the MPS control daemon started for the device (an on-demand MIG device whose
    claim asks for MPS): it runs while the claim is prepared and ends before its instance."""


@dataclass(frozen=True, slots=True)
class PreparedPod:
    """A pod the claim was reserved for when it was prepared."""

    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A claim prepared on this node."""

    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    pods: tuple[PreparedPod, ...] = ()
    pending: bool = False
    """Its prepare was making instances and has not finished: written before the first NVML call,
    so an agent killed in the middle finds out at start what to roll forward or back."""


class ClaimCheckpoint:
    """The checkpoint file; `path` need not exist (then no claim is prepared)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, PreparedClaim]:
        """{claim UID: claim}; empty when the file does not exist.

        CheckpointCorruptError when the file is not a checkpoint, CheckpointError when it cannot be read.
        """
        try:
            raw = read_capped(self.path, MAX_BYTES)
        except NotAFileError as err:
            raise self._corrupt(str(err)) from None
        except OSError as err:
            raise CheckpointError(
                f"cannot read the DRA claim checkpoint {self.path}: {err.strerror}"
            ) from err
        if raw is None:
            return {}
        try:
            return _parse(raw)
        except (ValueError, TypeError) as err:
            raise self._corrupt(bounded(str(err) or type(err).__name__, 200)) from None

    def save(self, claims: Mapping[str, PreparedClaim]) -> None:
        """Replace the file with `claims`, atomically; CheckpointError when it cannot be written."""
        body = {"version": VERSION, "claims": {uid: _claim_json(c) for uid, c in sorted(claims.items())}}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as out:
                out.write(json.dumps(body, indent=1, sort_keys=True) + "\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)  # a crash leaves the old checkpoint or the new one
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise CheckpointError(
                f"cannot write the DRA claim checkpoint {self.path}: {err.strerror}"
            ) from err

    def _corrupt(self, why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"the DRA claim checkpoint {self.path} is not one this agent writes ({why}); no claim is "
            "prepared or counted free until a person looks at it: move it away once no pod on this "
            "node uses a claim (`kubectl get resourceclaims -A`), and the agent starts afresh"
        )


def _claim_json(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "namespace": claim.namespace,
        "name": claim.name,
        "devices": [
            {
                "requests": list(d.requests),
                "pool": d.pool,
                "device": d.device,
                "uuid": d.uuid,
                "gpuUUID": d.gpu_uuid,
                "cdiDeviceIDs": list(d.cdi_ids),
                "shareID": d.share_id,
                "adminAccess": d.admin_access,
                **({"instance": _instance_json(d.instance)} if d.instance is not None else {}),
                **({"mps": _mps_json(d.mps)} if d.mps is not None else {}),
            }
            for d in claim.devices
        ],
        "pods": [{"name": p.name, "uid": p.uid} for p in claim.pods],
        **({"pending": True} if claim.pending else {}),
    }


def _instance_json(i: OwnedInstance) -> dict[str, Any]:
    return {
        "gpuUUID": i.gpu_uuid, "profile": i.profile, "start": i.start, "size": i.size,
        "gpuInstance": i.gi_id, "computeInstance": i.ci_id, **({"foreign": True} if i.foreign else {}),
    }  # fmt: skip


def _mps_json(m: MpsSettings) -> dict[str, Any]:
    return {"activeThreadPercentage": m.active_thread_percentage, "pinnedMemoryMiB": m.pinned_memory_mib}


def _parse(raw: bytes) -> dict[str, PreparedClaim]:
    if len(raw) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text at byte {err.start}") from None
    value = _dict(value, "the file")
    if value.get("version") != VERSION:
        raise ValueError(f"version {bounded(repr(value.get('version')), 20)}, expected {VERSION}")
    claims = {}
    for uid, raw_entry in _dict(_get(value, "claims", "the file"), "claims").items():
        where = f"claims.{bounded(uid, 60)}"
        entry = _dict(raw_entry, where)
        devices = tuple(
            _device(_dict(d, f"{where}.devices[{i}]"), f"{where}.devices[{i}]")
            for i, d in enumerate(_list(_get(entry, "devices", where), f"{where}.devices"))
        )
        pods = tuple(
            PreparedPod(_str(p, "name", where), _str(p, "uid", where))
            for p in (_dict(x, f"{where}.pods") for x in _list(_get(entry, "pods", where), f"{where}.pods"))
        )
        namespace, name = _str(entry, "namespace", where), _str(entry, "name", where)
        pending = entry.get("pending", False)
        if not isinstance(pending, bool):
            raise TypeError(f"{where}.pending is not a boolean")
        claims[uid] = PreparedClaim(namespace, name, uid, devices, pods, pending)
    return claims


def _device(d: dict[str, Any], where: str) -> PreparedDevice:
    share = _get(d, "shareID", where)
    if share is not None and not isinstance(share, str):
        raise TypeError(f"{where}.shareID is not a string")
    admin = _get(d, "adminAccess", where)
    if not isinstance(admin, bool):
        raise TypeError(f"{where}.adminAccess is not a boolean")
    return PreparedDevice(
        requests=_strs(_get(d, "requests", where), f"{where}.requests"),
        pool=_str(d, "pool", where),
        device=_str(d, "device", where),
        uuid=_str(d, "uuid", where),
        gpu_uuid=_str(d, "gpuUUID", where),
        cdi_ids=_strs(_get(d, "cdiDeviceIDs", where), f"{where}.cdiDeviceIDs"),
        share_id=share,
        admin_access=admin,
        instance=_instance(d["instance"], f"{where}.instance") if "instance" in d else None,
        mps=_mps(d["mps"], f"{where}.mps") if "mps" in d else None,
    )


def _mps(value: Any, where: str) -> MpsSettings:
    m = _dict(value, where)
    return MpsSettings(1, _int(m, "activeThreadPercentage", where), _int(m, "pinnedMemoryMiB", where))


def _instance(value: Any, where: str) -> OwnedInstance:
    i = _dict(value, where)
    ids = [_get(i, k, where) for k in ("gpuInstance", "computeInstance")]
    if not all(x is None or _is_int(x) for x in ids):
        raise TypeError(f"{where}: gpuInstance/computeInstance is not an integer")
    foreign = i.get("foreign", False)
    if not isinstance(foreign, bool):
        raise TypeError(f"{where}.foreign is not a boolean")
    return OwnedInstance(
        gpu_uuid=_str(i, "gpuUUID", where),
        profile=_str(i, "profile", where),
        start=_int(i, "start", where),
        size=_int(i, "size", where),
        gi_id=ids[0],
        ci_id=ids[1],
        foreign=foreign,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    value = _get(obj, key, where)
    if not _is_int(value):
        raise TypeError(f"{where}.{key} is not an integer")
    return int(value)


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{where} is not an object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{where} is not a list")
    return value


def _get(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ValueError(f"{where}: {key} is missing")
    return obj[key]


def _str(obj: dict[str, Any], key: str, where: str) -> str:
    value = _get(obj, key, where)
    if not isinstance(value, str):
        raise TypeError(f"{where}.{key} is not a string")
    return value


def _strs(value: Any, where: str) -> tuple[str, ...]:
    items = _list(value, where)
    if not all(isinstance(x, str) for x in items):
        raise TypeError(f"{where} holds something other than strings")
    return tuple(items)
