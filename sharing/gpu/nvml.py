"""The GPU backend over NVML: the only module that imports `pynvml`.

`NvmlBackend` takes a pynvml-shaped module object: the real `pynvml` (see `open_nvml`) or
`simnvml.SimNvml`, so the code that runs on real GPUs is the code the tests run. Every NVML call
runs on one dedicated worker thread, never on the event loop. Reading is `nvmlread`'s; this module
changes MIG (nvmlDeviceSetMigMode reports refusal in its activation status instead of raising;
GPU instances are created at explicit placements; compute instances are destroyed before their
GPU instance), polls XID events, and turns NVML errors into BackendError subclasses that name the
GPU and say what to do.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sharing.catalog import Catalog
from sharing.errors import BackendError
from sharing.gpu.backend import (
    GpuBusyError,
    GpuNotFoundError,
    InsufficientResourcesError,
    NotSupportedError,
    NvmlUnavailableError,
)
from sharing.gpu.naming import CI_ENUM_FOR_SLICES
from sharing.gpu.nvmlread import NvmlProfile, NvmlReader
from sharing.model import GpuInstance, GpuUuid, HealthEvent, NodeState

T = TypeVar("T")

_NOT_ATTRIBUTED = 0xFFFFFFFF
# Application errors (bad kernel, page fault in user code) say nothing about the GPU's health;
# NVIDIA's device plugin skips the same list.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def open_nvml(catalog: Catalog, *, ignored_xids: Collection[int] = APPLICATION_XIDS) -> NvmlBackend:
    """The backend over the real NVML library (loaded when first used)."""
    try:
        import pynvml  # noqa: PLC0415  (only when asked for: machines without GPUs never load it)
    except ImportError as err:
        raise NvmlUnavailableError(
            "the NVML Python binding is not installed (pip install nvidia-ml-py); "
            "without NVIDIA GPUs use --backend sim"
        ) from err
    return NvmlBackend(pynvml, catalog, ignored_xids=ignored_xids)


class NvmlBackend:
    """GpuBackend over a pynvml-shaped module."""

    def __init__(
        self,
        nvml: Any,
        catalog: Catalog,
        *,
        event_poll_s: float = 0.5,
        ignored_xids: Collection[int] = APPLICATION_XIDS,
    ) -> None:
        self._nvml = nvml
        self._ignored_xids = frozenset(ignored_xids)
        self._event_poll_s = event_poll_s
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._initialised = False
        self._closed = False
        self._read = NvmlReader(nvml, catalog)

    # ---- the worker thread -------------------------------------------------------------------

    async def _call(self, work: Callable[[], T]) -> T:
        if self._closed:
            raise BackendError("the GPU backend is closed")
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._run, work)

    def _run(self, work: Callable[[], T]) -> T:
        if not self._initialised:
            try:
                self._nvml.nvmlInit()
            except self._nvml.NVMLError as err:
                raise NvmlUnavailableError(
                    f"NVML could not be loaded ({err}): is the NVIDIA driver installed and a GPU visible "
                    "(run nvidia-smi)? Without NVIDIA GPUs use --backend sim"
                ) from err
            self._initialised = True
        return work()

    def _error(self, err: Exception, doing: str, where: str) -> BackendError:
        code = getattr(err, "value", None)
        n = self._nvml
        text = f"{doing} on {where}"
        if code == n.NVML_ERROR_IN_USE:
            return GpuBusyError(f"{text}: in use (processes run on it); stop them, then apply again")
        if code == n.NVML_ERROR_INSUFFICIENT_RESOURCES:
            return InsufficientResourcesError(
                f"{text}: insufficient resources (the slices are taken or the profile's maximum is "
                "reached); compare `sharing export` with `sharing profiles`"
            )
        if code == n.NVML_ERROR_NOT_SUPPORTED:
            return NotSupportedError(f"{text}: not supported (the GPU has no MIG, or MIG mode is off)")
        if code == n.NVML_ERROR_NO_PERMISSION:
            return BackendError(
                f"{text}: permission denied; run as root or give access to "
                "/proc/driver/nvidia/capabilities/mig/config"
            )
        if code == n.NVML_ERROR_NOT_FOUND:
            return GpuNotFoundError(f"{text}: not found (it may have just been removed); observe again")
        if code == n.NVML_ERROR_GPU_IS_LOST:
            return BackendError(f"{text}: the GPU is lost; it needs a reset or a reboot")
        if code == n.NVML_ERROR_RESET_REQUIRED:
            return BackendError(f"{text}: the GPU needs a reset first")
        return BackendError(f"{text}: NVML error {code}: {err}")

    @property
    def profile_mismatches(self) -> set[str]:
        """Profiles whose NVIDIA-derived name differs from the catalog's (the catalog's name is used)."""
        return self._read.profile_mismatches

    async def observe(self) -> NodeState:
        """Every GPU: identity, MIG mode, instances with placements, MIG UUIDs, busy."""
        try:
            return await self._call(self._read.observe)
        except BackendError:
            raise
        except self._nvml.NVMLError as err:
            raise self._error(err, "observing the GPUs", "this node") from err

    async def profiles(self, gpu: GpuUuid) -> tuple[NvmlProfile, ...]:
        """The GPU-instance profiles the driver reports for a GPU, with their valid placements."""

        def work() -> tuple[NvmlProfile, ...]:
            handle, where = self._read.find(gpu)
            try:
                return self._read.gi_profiles(handle, gpu)
            except self._nvml.NVMLError as err:
                raise self._error(err, "reading MIG profiles", where) from err

        return await self._call(work)

    # ---- changes -----------------------------------------------------------------------------

    async def set_mig_mode(self, gpu: GpuUuid, enabled: bool) -> bool:
        """Ask for MIG on or off; True when the change waits for a GPU reset."""
        n = self._nvml
        mode = n.NVML_DEVICE_MIG_ENABLE if enabled else n.NVML_DEVICE_MIG_DISABLE
        doing = "enabling MIG" if enabled else "disabling MIG"

        def work() -> bool:
            handle, where = self._read.find(gpu)
            try:
                status = n.nvmlDeviceSetMigMode(handle, mode)
                current, _ = n.nvmlDeviceGetMigMode(handle)
            except n.NVMLError as err:
                raise self._error(err, doing, where) from err
            # The activation status is returned, not raised: IN_USE / RESET_REQUIRED leave it pending.
            if status not in (n.NVML_SUCCESS, n.NVML_ERROR_IN_USE, n.NVML_ERROR_RESET_REQUIRED):
                raise BackendError(f"{doing} on {where}: NVML activation status {status}")
            return bool(current != mode)

        return await self._call(work)

    async def destroy_instance(self, gpu: GpuUuid, gi_id: int) -> None:
        """Destroy the GPU instance `gi_id`: its compute instances first, then itself."""
        n = self._nvml

        def work() -> None:
            handle, where = self._read.find(gpu)
            try:
                gi = n.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            except n.NVMLError as err:
                raise self._error(err, f"finding GPU instance {gi_id}", where) from err
            try:
                for ci in self._read.compute_instances(gi):
                    n.nvmlComputeInstanceDestroy(ci)
                n.nvmlGpuInstanceDestroy(gi)
            except n.NVMLError as err:
                raise self._error(err, f"destroying GPU instance {gi_id}", where) from err

        await self._call(work)

    async def create_instance(self, gpu: GpuUuid, profile: str, start: int) -> GpuInstance:
        """Create `profile` at `start` with one compute instance spanning it (completes a half-built one)."""
        n = self._nvml

        def work() -> GpuInstance:
            handle, where = self._read.find(gpu)
            doing = f"creating {profile}@{start}"
            try:
                known = self._read.gi_profiles(handle, gpu)
                chosen = next((p for p in known if p.name == profile), None)
                if chosen is None:
                    raise BackendError(
                        f"{doing} on {where}: no such MIG profile (valid: {', '.join(p.name for p in known)})"
                    )
                if start not in chosen.placements:
                    raise BackendError(
                        f"{doing} on {where}: {profile} cannot start at slice {start} "
                        f"(valid: {', '.join(map(str, chosen.placements))})"
                    )
                gi, created = self._gi_at(handle, chosen, start, doing, where), False
                if gi is None:
                    placement = n.c_nvmlGpuInstancePlacement_t()
                    placement.start, placement.size = start, chosen.size
                    gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(
                        handle, chosen.id, ctypes.byref(placement)
                    )
                    created = True
                try:
                    ci_info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi,
                        CI_ENUM_FOR_SLICES[chosen.compute_slices],
                        n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    )
                    n.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
                except n.NVMLError:
                    if created:  # leave no GPU instance without its compute instance behind
                        n.nvmlGpuInstanceDestroy(gi)
                    raise
                return self._read.instance(gi, chosen, self._read.mig_devices(handle))
            except n.NVMLError as err:
                raise self._error(err, doing, where) from err

        return await self._call(work)

    def _gi_at(self, handle: Any, profile: NvmlProfile, start: int, doing: str, where: str) -> Any:
        """The existing GPU instance of `profile` at `start` if it has no compute instance yet."""
        n = self._nvml
        for gi in self._read.gpu_instances(handle, profile):
            if n.nvmlGpuInstanceGetInfo(gi).placement.start == start:
                if self._read.compute_instances(gi):
                    raise BackendError(f"{doing} on {where}: that instance already exists")
                return gi
        return None

    # ---- health ------------------------------------------------------------------------------

    async def health_events(self) -> AsyncIterator[HealthEvent]:
        """Critical XIDs (ignored_xids skipped) and recoveries as HealthEvents, until closed."""
        n = self._nvml

        def register() -> Any:
            event_set = n.nvmlEventSetCreate()
            recovery = getattr(n, "nvmlEventTypeGpuRecoveryAction", 0)
            for index in range(n.nvmlDeviceGetCount()):
                handle = n.nvmlDeviceGetHandleByIndex(index)
                # Recovery-action events (R575+ drivers) say when a GPU needs no action any more:
                # that is how a GPU marked unhealthy by an XID becomes healthy again. Older drivers
                # refuse the mask; XIDs alone are registered then.
                for mask in (n.nvmlEventTypeXidCriticalError | recovery, n.nvmlEventTypeXidCriticalError):
                    try:
                        n.nvmlDeviceRegisterEvents(handle, mask, event_set)
                        break
                    except n.NVMLError as err:
                        if err.value != n.NVML_ERROR_NOT_SUPPORTED:
                            raise
            return event_set

        event_set = await self._call(register)
        try:
            while not self._closed:
                events = await self._call(lambda: self._drain(event_set))
                for event in events:
                    yield event
                if not events:
                    await asyncio.sleep(self._event_poll_s)
        finally:
            if not self._closed:
                await self._call(lambda: n.nvmlEventSetFree(event_set))

    def _drain(self, event_set: Any) -> list[HealthEvent]:
        """Every event waiting in the set, without blocking the worker."""
        n = self._nvml
        events: list[HealthEvent] = []
        while True:
            try:
                data = n.nvmlEventSetWait(event_set, 0)
            except n.NVMLError as err:
                if err.value == n.NVML_ERROR_TIMEOUT:
                    return events
                raise
            gpu_uuid = GpuUuid(n.nvmlDeviceGetUUID(data.device))
            if data.eventType == getattr(n, "nvmlEventTypeGpuRecoveryAction", None):
                # NONE: nothing left to do, the GPU is healthy; any other action: it needs one.
                healthy = data.eventData == n.NVML_GPU_RECOVERY_ACTION_NONE
                events.append(HealthEvent(gpu_uuid=gpu_uuid, healthy=healthy))
                continue
            if data.eventType != n.nvmlEventTypeXidCriticalError or data.eventData in self._ignored_xids:
                continue
            mig_uuid = None
            if _NOT_ATTRIBUTED not in (data.gpuInstanceId, data.computeInstanceId):
                found = self._read.mig_devices(data.device).get((data.gpuInstanceId, data.computeInstanceId))
                mig_uuid = None if found is None else found[0]
            events.append(
                HealthEvent(
                    gpu_uuid=gpu_uuid,
                    healthy=False,
                    xid=int(data.eventData),
                    mig_uuid=mig_uuid,
                )
            )

    async def close(self) -> None:
        """Shut NVML down and stop the worker thread."""
        if self._closed:
            return
        if self._initialised:
            await self._call(self._nvml.nvmlShutdown)
        self._closed = True
        self._worker.shutdown(wait=True)
