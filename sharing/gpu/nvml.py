"""The GPU backend over NVML: the only module that imports `pynvml`.

`NvmlBackend` takes anything that satisfies the typed `nvmlapi.Nvml` surface: the real `pynvml`
module bound to the libnvidia-ml.so.1 under the driver root (`open_nvml`; in tests the fake
driver's, hack/fakedriver), so the code that runs on real GPUs is the code the tests run. Every
NVML call runs on one dedicated worker thread, never on the event loop. Reading is `nvmlread`'s;
this module changes MIG (nvmlDeviceSetMigMode reports refusal in its activation status instead of
raising; GPU instances are created at explicit placements from the driver's own profile table;
compute instances are destroyed before their GPU instance), polls XID events, hands the usage sampler
a reader of its own (`nvmlusage`, on the sampler's thread), logs once per GPU
where the driver disagrees with the hardware catalog, and turns NVML errors into BackendError
subclasses that name the GPU and say what to do. Each NVML call that changes MIG is timed here, in
`_timed`, for the rollout's steps and the on-demand prepares alike (`MigSeconds`).
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import ParamSpec, TypeVar

import structlog

from sharing.devices import APPLICATION_XIDS
from sharing.errors import BackendError
from sharing.gpu.backend import GpuBusyError, MigSeconds, NvmlUnavailableError
from sharing.gpu.devfiles import DeviceFiles, DriverFiles
from sharing.gpu.naming import CI_ENUM_FOR_SLICES
from sharing.gpu.nvmlapi import Handle, Nvml, code, optional_int
from sharing.gpu.nvmlerrors import backend_error
from sharing.gpu.nvmllib import name_os_thread, preload
from sharing.gpu.nvmlread import NvmlReader, compute_instance
from sharing.gpu.nvmlusage import NvmlUsageReader
from sharing.mig import Catalog, Product, differences
from sharing.model import GpuInstance, GpuUuid, HealthEvent, NodeState

T = TypeVar("T")
P = ParamSpec("P")
log = structlog.get_logger(__name__)

_NOT_ATTRIBUTED = 0xFFFFFFFF
DMI_PRODUCT_NAME = Path("/sys/class/dmi/id/product_name")


def read_machine(path: Path = DMI_PRODUCT_NAME) -> str | None:
    """The machine's product name (what GPU feature discovery labels gpu.machine); None when unreadable."""
    try:
        return path.read_text("utf-8", "replace").strip() or None
    except OSError:
        return None


def load_pynvml(driver_root: Path) -> Nvml:
    """The real `pynvml`, bound to the NVML library under `driver_root` (what go-nvml's
    WithLibraryPath does): loaded here by path, so pynvml's nvmlInit, which opens libnvidia-ml.so.1
    by name with ctypes.CDLL, gets this one, because the dynamic loader reuses a loaded library whose
    SONAME is the name asked for (glibc dlopen). One library per process: another root fails."""
    try:
        import pynvml  # noqa: PLC0415  (only when asked for: machines without GPUs never load it)
    except ImportError as err:
        raise NvmlUnavailableError(
            "the NVML Python binding is not installed (pip install nvidia-ml-py)"
        ) from err
    preload(driver_root)
    module: Nvml = pynvml
    return module


def open_nvml(
    catalog: Catalog,
    driver_root: Path = Path("/"),
    *,
    host_driver_root: Path | None = None,
    ignored_xids: Collection[int] = APPLICATION_XIDS,
    mig_seconds: MigSeconds | None = None,
) -> NvmlBackend:
    """The backend over the NVIDIA driver under `driver_root` (its library, its device files); the
    node sees that root at `host_driver_root` (the CDI spec's host paths), by default the same path."""
    return NvmlBackend(
        load_pynvml(driver_root),
        catalog,
        ignored_xids=ignored_xids,
        machine=read_machine,
        device_files=DriverFiles(driver_root, host_driver_root),
        mig_seconds=mig_seconds,
    )


class NvmlBackend:
    """GpuBackend over the NVML surface."""

    def __init__(
        self,
        nvml: Nvml,
        catalog: Catalog,
        *,
        event_poll_s: float = 0.5,
        ignored_xids: Collection[int] = APPLICATION_XIDS,
        machine: Callable[[], str | None] | None = None,
        device_files: DeviceFiles | None = None,
        mig_seconds: MigSeconds | None = None,
    ) -> None:
        self._nvml = nvml
        self._mig_seconds = mig_seconds
        self.device_files: DeviceFiles = device_files or DriverFiles()
        self._catalog = catalog
        self._ignored_xids = frozenset(ignored_xids)
        self._event_poll_s = event_poll_s
        self._machine = machine
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="nvml", initializer=name_os_thread, initargs=(b"nvml",)
        )
        self._initialised = False
        self._closed = False
        self._read = NvmlReader(nvml)
        self._checked: set[str] = set()
        self.catalog_differences: dict[str, tuple[str, ...]] = {}
        """Per GPU UUID: where its driver disagrees with the catalog (also logged once)."""

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
                    "(run nvidia-smi)?"
                ) from err
            self._initialised = True
        return work()

    def _timed(self, operation: str, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """One NVML call that changes MIG, its time reported to `mig_seconds` (the one place both the
        rollout's steps and the on-demand prepares run through)."""
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            if self._mig_seconds is not None:
                self._mig_seconds(operation, time.perf_counter() - started)

    async def observe(self) -> NodeState:
        """Every GPU, each read on its own: a GPU whose reads fail is listed in `unreadable`."""
        try:
            state = await self._call(self._read.observe)
        except self._nvml.NVMLError as err:
            raise backend_error(self._nvml, err, "counting the GPUs", "this node") from err
        for gpu in state.gpus:
            if gpu.profiles is not None and gpu.uuid not in self._checked:
                self._check(gpu.uuid, gpu.index, gpu.product, gpu.pci_device_id, gpu.profiles)
        machine = self._machine() if self._machine is not None else None
        return replace(state, machine=machine)

    def _check(self, uuid: str, index: int, name: str, pci: int | None, table: Product) -> None:
        """Log once per GPU where its driver and the catalog disagree."""
        self._checked.add(uuid)
        known = self._catalog.for_gpu(name, pci)
        if not isinstance(known, Product):
            log.info("gpu_not_in_catalog", gpu=index, product=name, profiles=[p.name for p in table.profiles])
            return
        found = differences(table, known)
        if found:
            self.catalog_differences[uuid] = found
            log.warning(
                "catalog_disagrees_with_driver", gpu=index, product=known.name, differences=list(found)
            )

    async def profiles(self, gpu: GpuUuid) -> Product | None:
        """The MIG profile table the driver reports for a GPU (None: no MIG, or none listed now)."""
        n = self._nvml

        def work() -> Product | None:
            handle, where = self._read.find(gpu)
            try:
                n.nvmlDeviceGetMigMode(handle)
                return self._read.table(handle, gpu)
            except n.NVMLError as err:
                if code(err) == n.NVML_ERROR_NOT_SUPPORTED:
                    return None
                raise backend_error(n, err, "reading MIG profiles", where) from err

        return await self._call(work)

    # ---- changes -----------------------------------------------------------------------------

    async def set_mig_mode(self, gpu: GpuUuid, enabled: bool) -> bool:
        """Ask for MIG on or off; True when the change waits for a GPU reset."""
        n = self._nvml
        mode = n.NVML_DEVICE_MIG_ENABLE if enabled else n.NVML_DEVICE_MIG_DISABLE
        doing = "enabling MIG" if enabled else "disabling MIG"

        def work() -> bool:
            handle, where = self._read.find(gpu)
            self._read.forget(gpu)  # what held for the old MIG mode is read again
            try:
                status = self._timed(
                    "enable_mig" if enabled else "disable_mig", n.nvmlDeviceSetMigMode, handle, mode
                )
                current, _ = n.nvmlDeviceGetMigMode(handle)
            except n.NVMLError as err:
                raise backend_error(n, err, doing, where) from err
            # The activation status is returned, not raised: RESET_REQUIRED leaves it pending.
            if status not in (n.NVML_SUCCESS, n.NVML_ERROR_IN_USE, n.NVML_ERROR_RESET_REQUIRED):
                raise BackendError(f"{doing} on {where}: NVML activation status {status}")
            if status == n.NVML_ERROR_IN_USE and current != mode:
                # A process started since the GPU was found idle. "The caller of this API is expected
                # to idle the device and retry setting the mode again" (nvml.h, nvmlDeviceSetMigMode):
                # the request is withdrawn (the current mode asked for), so that nothing waits for a
                # reset the GPU does not need, and the change is tried again once the GPU is idle.
                try:
                    self._timed(
                        "disable_mig" if enabled else "enable_mig", n.nvmlDeviceSetMigMode, handle, current
                    )
                except n.NVMLError as err:
                    raise backend_error(
                        n, err, f"{doing} (withdrawing it: the GPU is in use)", where
                    ) from err
                raise GpuBusyError(
                    f"{doing} on {where}: in use (processes run on it); tried again once it is idle"
                )
            return bool(current != mode)

        return await self._call(work)

    async def set_compute_mode(self, gpu: GpuUuid, exclusive: bool) -> None:
        """Exclusive-process compute mode (an MPS GPU, or MIG device by its MIG UUID: only its MPS
        server holds a context) or default.

        nvmlDeviceSetComputeMode "takes effect immediately" and is not persistent across reboots
        (nvml.h); MPS wants EXCLUSIVE_PROCESS (https://docs.nvidia.com/deploy/mps/latest/,
        "Starting and Stopping MPS on Linux").
        """
        n = self._nvml
        mode = n.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS if exclusive else n.NVML_COMPUTEMODE_DEFAULT
        doing = "setting exclusive-process compute mode" if exclusive else "setting the default compute mode"

        def work() -> None:
            if gpu.startswith("MIG-"):  # "If MIG is enabled on a GPU, device must be MIG device handle"
                try:
                    handle, where = n.nvmlDeviceGetHandleByUUID(gpu), f"MIG device {gpu}"
                except n.NVMLError as err:
                    raise backend_error(n, err, doing, f"MIG device {gpu}") from err
            else:
                handle, where = self._read.find(gpu)
            try:
                if n.nvmlDeviceGetComputeMode(handle) != mode:
                    n.nvmlDeviceSetComputeMode(handle, mode)
            except n.NVMLError as err:
                raise backend_error(n, err, doing, where) from err

        await self._call(work)

    async def destroy_instance(self, gpu: GpuUuid, gi_id: int) -> None:
        """Destroy the GPU instance `gi_id`: its compute instances first, then itself."""
        n = self._nvml

        def work() -> None:
            handle, where = self._read.find(gpu)
            try:
                gi = n.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            except n.NVMLError as err:
                raise backend_error(n, err, f"finding GPU instance {gi_id}", where) from err
            try:
                for ci in self._read.compute_instances_of(gpu, gi):
                    self._timed("destroy_compute_instance", n.nvmlComputeInstanceDestroy, ci)
                self._timed("destroy_gpu_instance", n.nvmlGpuInstanceDestroy, gi)
            except n.NVMLError as err:
                raise backend_error(n, err, f"destroying GPU instance {gi_id}", where) from err

        await self._call(work)

    async def create_instance(self, gpu: GpuUuid, profile: str, start: int) -> GpuInstance:
        """Create `profile` at `start` with one compute instance spanning it (completes a half-built one)."""
        n = self._nvml

        def work() -> GpuInstance:
            handle, where = self._read.find(gpu)
            doing = f"creating {profile}@{start}"
            try:
                table = self._read.table(handle, gpu)
                known = table.profiles if table is not None else ()
                chosen = next((p for p in known if p.name == profile), None)
                if chosen is None:
                    valid = ", ".join(p.name for p in known) or "the driver lists none"
                    raise BackendError(f"{doing} on {where}: no such MIG profile (valid: {valid})")
                if start not in chosen.placements:
                    raise BackendError(
                        f"{doing} on {where}: {profile} cannot start at slot {start} "
                        f"(valid: {', '.join(map(str, chosen.placements))})"
                    )
                gi, created = self._gi_at(handle, (chosen.id, chosen.max_count), start, doing, where), False
                if gi is None:
                    placement = n.c_nvmlGpuInstancePlacement_t()
                    placement.start, placement.size = start, chosen.size
                    gi = self._timed(
                        "create_gpu_instance",
                        n.nvmlDeviceCreateGpuInstanceWithPlacement,
                        handle,
                        chosen.id,
                        ctypes.byref(placement),
                    )
                    created = True
                try:
                    ci_info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi,
                        CI_ENUM_FOR_SLICES[chosen.compute_slices],
                        n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    )
                    ci = self._timed(
                        "create_compute_instance", n.nvmlGpuInstanceCreateComputeInstance, gi, ci_info.id
                    )
                except n.NVMLError:
                    if created:  # leave no GPU instance without its compute instance behind
                        self._timed("destroy_gpu_instance", n.nvmlGpuInstanceDestroy, gi)
                    raise
                return self._made(handle, gi, ci, chosen.name, ci_info.multiprocessorCount)
            except n.NVMLError as err:
                raise backend_error(n, err, doing, where) from err

        return await self._call(work)

    def _made(
        self, handle: Handle, gi: Handle, ci: Handle, profile: str, multiprocessors: int
    ) -> GpuInstance:
        """The instance just made, from its own handles and its one MIG device (not the GPU's others)."""
        n = self._nvml
        info = n.nvmlGpuInstanceGetInfo(gi)
        ci_info = n.nvmlComputeInstanceGetInfo(ci)
        found = self._read.mig_device(handle, info.id, ci_info.id)
        made = compute_instance(info.id, ci_info, found, multiprocessors)
        return GpuInstance(
            id=info.id,
            profile=profile,
            start=info.placement.start,
            size=info.placement.size,
            compute_instances=(made,),
        )

    def _gi_at(
        self, handle: Handle, profile: tuple[int, int], start: int, doing: str, where: str
    ) -> Handle | None:
        """The GPU instance of the profile (id, max count) at `start` if it has no compute instance yet."""
        n = self._nvml
        for gi in self._read.gpu_instances(handle, *profile):
            if n.nvmlGpuInstanceGetInfo(gi).placement.start == start:
                if self._read.compute_instances(gi):
                    raise BackendError(f"{doing} on {where}: that instance already exists")
                return gi
        return None

    # ---- usage -------------------------------------------------------------------------------

    def usage_reader(self) -> NvmlUsageReader:
        """A reader of what the GPUs are doing, for the usage sampler's own thread (NVML is
        thread-safe): it does not wait behind this backend's worker, nor holds it up."""
        return NvmlUsageReader(self._nvml, time.monotonic, time.time)

    # ---- health ------------------------------------------------------------------------------

    async def health_events(self) -> AsyncIterator[HealthEvent]:
        """Critical XIDs (ignored_xids skipped) and recoveries as HealthEvents, until closed."""
        n = self._nvml
        recovery = optional_int(n, "nvmlEventTypeGpuRecoveryAction", 0)

        def register() -> Handle:
            event_set = n.nvmlEventSetCreate()
            for index in range(n.nvmlDeviceGetCount()):
                handle = n.nvmlDeviceGetHandleByIndex(index)
                # Recovery-action events (R575+ drivers) say when a GPU needs no action any more:
                # that is how a GPU marked unhealthy by an XID becomes healthy again. Older drivers
                # refuse the mask; XIDs alone are registered then. A lost GPU is skipped.
                for mask in (n.nvmlEventTypeXidCriticalError | recovery, n.nvmlEventTypeXidCriticalError):
                    try:
                        n.nvmlDeviceRegisterEvents(handle, mask, event_set)
                        break
                    except n.NVMLError as err:
                        if code(err) not in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_GPU_IS_LOST):
                            raise
                        if code(err) == n.NVML_ERROR_GPU_IS_LOST:
                            break
            return event_set

        event_set = await self._call(register)
        try:
            while not self._closed:
                events = await self._call(lambda: self._drain(event_set, recovery))
                for event in events:
                    yield event
                if not events:
                    await asyncio.sleep(self._event_poll_s)
        finally:
            if not self._closed:
                await self._call(lambda: n.nvmlEventSetFree(event_set))

    def _drain(self, event_set: Handle, recovery: int) -> list[HealthEvent]:
        """Every event waiting in the set, without blocking the worker."""
        n = self._nvml
        events: list[HealthEvent] = []
        while True:
            try:
                data = n.nvmlEventSetWait(event_set, 0)
            except n.NVMLError as err:
                if code(err) == n.NVML_ERROR_TIMEOUT:
                    return events
                raise
            gpu_uuid = GpuUuid(n.nvmlDeviceGetUUID(data.device))
            self._read.forget(gpu_uuid)  # an XID or a reset: read everything of the GPU again
            if recovery and data.eventType == recovery:
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
                HealthEvent(gpu_uuid=gpu_uuid, healthy=False, xid=int(data.eventData), mig_uuid=mig_uuid)
            )

    async def close(self) -> None:
        """Shut NVML down and stop the worker thread."""
        if self._closed:
            return
        if self._initialised:
            await self._call(self._nvml.nvmlShutdown)
        self._closed = True
        self._worker.shutdown(wait=True)
