"""What the GPUs are doing, read through NVML for the usage sampler, without changing anything.

Per GPU: power, temperature (nvmlDeviceGetTemperatureV; nvmlDeviceGetTemperature on older drivers),
memory (nvmlDeviceGetMemoryInfo_v2: `used` leaves the driver's reserve out) and, without MIG,
utilization ("On MIG-enabled GPUs, querying device utilization rates is not currently supported",
nvml.h). Per device (the GPU without MIG, else each MIG device by its own handle: "Per-instance
information can be queried by using specific MIG device handles"): memory, the compute processes by
host PID and the MPS clients ("processes with a compute context running on a device as MPS
clients"), and without MIG each process's SM share since the last reading
(nvmlDeviceGetProcessUtilization from the newest sample seen; NOT_FOUND "If no valid sample entries
are found since the lastSeenTimeStamp": none used the SMs). Per GPU instance on Hopper and newer:
SM and graphics activity through GPM between this reading's sample and the last one's (nvml.h wants
them "greater than 100ms" apart; the sampler's interval is seconds), started over when the instance's
MIG device changed. What a GPU cannot read (GPM on an A100) is None and said once in the log.

Synchronous: a reader belongs to one thread (the sampler's; NVML "is thread-safe so it is safe to
make simultaneous NVML calls from multiple threads", nvml.h), beside the backend's worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from sharing.gpu.nvmlapi import Handle, Nvml, code
from sharing.model import GpuUuid, bounded
from sharing.readings import DeviceReading, GpuReading, NodeReadings, ProcessReading, UnreadableReading

log = structlog.get_logger(__name__)
T = TypeVar("T")

GPM_MIN_INTERVAL_S = 0.1
"""nvml.h, nvmlGpmMigSampleGet: "The interval between two ... calls should be greater than 100ms"."""


@dataclass
class _GpmState:
    """The last GPM sample of one GPU instance, and which MIG device it was taken of."""

    sample: Handle
    spare: Handle
    device: str
    at: float


class NvmlUsageReader:
    """Reads NodeReadings through NVML; keeps what makes the next reading a difference (timestamps,
    GPM samples) and what has been said once."""

    def __init__(self, nvml: Nvml, clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self._nvml = nvml
        self._clock = clock
        self._wall = wall
        self._initialised = False
        self._seen: dict[str, int] = {}
        """Per GPU UUID: the newest process-utilization sample timestamp read (microseconds)."""
        self._gpm_support: dict[str, bool] = {}
        self._gpm: dict[tuple[str, int], _GpmState] = {}
        self._said: set[tuple[str, str]] = set()

    def read(self) -> NodeReadings:
        """Every GPU now; a GPU whose reads fail is listed in `unreadable`, the others as usual."""
        n = self._nvml
        if not self._initialised:
            n.nvmlInit()  # reference counted: the backend's worker holds its own
            self._initialised = True
        at = self._wall()
        gpus: list[GpuReading] = []
        unreadable: list[UnreadableReading] = []
        instances: set[tuple[str, int]] = set()
        for index in range(n.nvmlDeviceGetCount()):
            try:
                gpus.append(self._gpu(index, instances))
            except n.NVMLError as err:
                unreadable.append(UnreadableReading(index, bounded(f"NVML error {code(err)}: {err}")))
        for key in set(self._gpm) - instances:  # GPU instances gone (or their GPU unreadable)
            self._free(self._gpm.pop(key))
        return NodeReadings(at, tuple(gpus), tuple(unreadable))

    def close(self) -> None:
        """Free the GPM samples and release NVML."""
        for state in self._gpm.values():
            self._free(state)
        self._gpm.clear()
        if self._initialised:
            self._nvml.nvmlShutdown()
            self._initialised = False

    # ---- one GPU -------------------------------------------------------------------------------

    def _gpu(self, index: int, instances: set[tuple[str, int]]) -> GpuReading:
        n = self._nvml
        handle = n.nvmlDeviceGetHandleByIndex(index)
        uuid = GpuUuid(n.nvmlDeviceGetUUID(handle))
        power = self._optional(uuid, index, "power", lambda: n.nvmlDeviceGetPowerUsage(handle) / 1000)
        temperature = self._optional(uuid, index, "temperature", lambda: self._temperature(handle))
        used, total = self._memory(handle)
        try:
            mig = n.nvmlDeviceGetMigMode(handle)[0] == n.NVML_DEVICE_MIG_ENABLE
        except n.NVMLError as err:
            if code(err) != n.NVML_ERROR_NOT_SUPPORTED:
                raise
            mig = False
        if not mig:
            utilization = self._optional(
                uuid, index, "utilization", lambda: n.nvmlDeviceGetUtilizationRates(handle).gpu / 100
            )
            device = DeviceReading(uuid, used, total, self._processes(handle, self._sm(uuid, handle)))
            return GpuReading(index, uuid, power, temperature, used, total, utilization, False,
                              self._gpm_supported(uuid, index, handle), (device,))  # fmt: skip
        gpm = self._gpm_supported(uuid, index, handle)
        devices = [
            self._mig_device(uuid, handle, mig_handle, gpm, instances) for mig_handle in self._migs(handle)
        ]
        if used is None:  # the aggregate needs privileges: the sum of the MIG devices'
            known = [d.memory_used_bytes for d in devices]
            used = None if None in known else sum(k or 0 for k in known)
        return GpuReading(index, uuid, power, temperature, used, total, None, True, gpm, tuple(devices))

    def _mig_device(
        self, gpu: str, handle: Handle, mig: Handle, gpm: bool, instances: set[tuple[str, int]]
    ) -> DeviceReading:
        n = self._nvml
        uuid = n.nvmlDeviceGetUUID(mig)
        gi = n.nvmlDeviceGetGpuInstanceId(mig)
        used, total = self._memory(mig)
        sm = graphics = None
        if gpm:
            instances.add((gpu, gi))
            sm, graphics = self._gpm_activity(gpu, handle, gi, uuid)
        return DeviceReading(uuid, used, total, self._processes(mig, None), gi, sm, graphics)

    def _migs(self, handle: Handle) -> list[Handle]:
        """The GPU's MIG devices; indices may have holes (NOT_FOUND, as `NvmlReader.mig_handles`)."""
        n = self._nvml
        found = []
        for index in range(n.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                found.append(n.nvmlDeviceGetMigDeviceHandleByIndex(handle, index))
            except n.NVMLError as err:
                if code(err) not in (n.NVML_ERROR_NOT_FOUND, n.NVML_ERROR_INVALID_ARGUMENT):
                    raise
        return found

    def _temperature(self, handle: Handle) -> float:
        n = self._nvml
        try:
            return float(n.nvmlDeviceGetTemperatureV(handle, n.NVML_TEMPERATURE_GPU))
        except n.NVMLError as err:
            if code(err) != n.NVML_ERROR_FUNCTION_NOT_FOUND:  # a driver older than nvmlDeviceGetTemperatureV
                raise
            return float(n.nvmlDeviceGetTemperature(handle, n.NVML_TEMPERATURE_GPU))

    def _memory(self, handle: Handle) -> tuple[int | None, int | None]:
        """(used, total) bytes: v2's `used` leaves the driver's reserve out; v1 on drivers without v2.
        (None, None) without the privileges a GPU handle in MIG mode needs for the aggregate."""
        n = self._nvml
        try:
            try:
                info = n.nvmlDeviceGetMemoryInfo(handle, n.nvmlMemory_v2)
            except n.NVMLError as err:
                if code(err) not in (n.NVML_ERROR_FUNCTION_NOT_FOUND, n.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                    raise
                info = n.nvmlDeviceGetMemoryInfo(handle)
        except n.NVMLError as err:
            if code(err) not in (n.NVML_ERROR_NO_PERMISSION, n.NVML_ERROR_NOT_SUPPORTED):
                raise
            return None, None
        return int(info.used), int(info.total)

    def _processes(self, handle: Handle, sm: dict[int, float] | None) -> tuple[ProcessReading, ...] | None:
        """The device's compute processes and MPS clients; `sm` (per PID) where per-process
        utilization is read."""
        n = self._nvml
        try:
            found = list(n.nvmlDeviceGetComputeRunningProcesses(handle))
            pids = {p.pid for p in found}
            try:
                found += [p for p in n.nvmlDeviceGetMPSComputeRunningProcesses(handle) if p.pid not in pids]
            except n.NVMLError as err:
                if code(err) not in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
                    raise
        except n.NVMLError as err:
            if code(err) != n.NVML_ERROR_NO_PERMISSION:
                raise
            return None
        return tuple(
            ProcessReading(
                p.pid,
                None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                None if sm is None else sm.get(p.pid, 0.0),
            )
            for p in found
        )

    def _sm(self, uuid: str, handle: Handle) -> dict[int, float] | None:
        """Per PID, its mean SM share over the samples since the newest one read before; {} when
        none used the SMs; None where NVML cannot say (said once)."""
        n = self._nvml
        try:
            samples = n.nvmlDeviceGetProcessUtilization(handle, self._seen.get(uuid, 0))
        except n.NVMLError as err:
            if code(err) == n.NVML_ERROR_NOT_FOUND:
                return {}
            if code(err) not in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise
            self._once(uuid, "process_utilization", str(err))
            return None
        shares: dict[int, list[int]] = {}
        for sample in samples:
            shares.setdefault(sample.pid, []).append(sample.smUtil)
            self._seen[uuid] = max(self._seen.get(uuid, 0), sample.timeStamp)
        return {pid: sum(values) / len(values) / 100 for pid, values in shares.items()}

    # ---- GPM -----------------------------------------------------------------------------------

    def _gpm_supported(self, uuid: str, index: int, handle: Handle) -> bool:
        """Whether the GPU supports GPM ("per system for the supplied device": asked once)."""
        known = self._gpm_support.get(uuid)
        if known is None:
            n = self._nvml
            try:
                known = bool(n.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
            except n.NVMLError as err:
                if code(err) not in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
                    raise
                known = False
            self._gpm_support[uuid] = known
            if not known:
                log.info(
                    "gpm_not_supported", gpu=index, uuid=uuid,
                    means="no SM activity per MIG device on this GPU (GPM needs Hopper or newer)",
                )  # fmt: skip
        return known

    def _gpm_activity(
        self, gpu: str, handle: Handle, gi: int, device: str
    ) -> tuple[float | None, float | None]:
        """(SM, graphics) activity of GPU instance `gi` since the last reading; None at its first."""
        n = self._nvml
        key = (gpu, gi)
        state = self._gpm.get(key)
        if state is not None and state.device != device:  # destroyed and made again: start over
            self._free(self._gpm.pop(key))
            state = None
        try:
            if state is None:
                state = self._gpm[key] = _GpmState(
                    n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc(), device, 0.0
                )
                n.nvmlGpmMigSampleGet(handle, gi, state.sample)
                state.at = self._clock()
                return None, None
            now = self._clock()
            if now - state.at <= GPM_MIN_INTERVAL_S:
                return None, None
            n.nvmlGpmMigSampleGet(handle, gi, state.spare)
            get = n.c_nvmlGpmMetricsGet_t()
            get.version = n.NVML_GPM_METRICS_GET_VERSION
            get.numMetrics = 2
            get.sample1, get.sample2 = state.sample, state.spare
            get.metrics[0].metricId = n.NVML_GPM_METRIC_SM_UTIL
            get.metrics[1].metricId = n.NVML_GPM_METRIC_GRAPHICS_UTIL
            n.nvmlGpmMetricsGet(get)
        except n.NVMLError as err:  # the instance went meanwhile, or GPM failed: started over next time
            self._once(gpu, f"gpm/{gi}", str(err), gpu_instance=gi)
            if key in self._gpm:
                self._free(self._gpm.pop(key))
            return None, None
        state.sample, state.spare, state.at = state.spare, state.sample, now
        sm, graphics = get.metrics[0], get.metrics[1]
        return (
            sm.value / 100 if sm.nvmlReturn == n.NVML_SUCCESS else None,
            graphics.value / 100 if graphics.nvmlReturn == n.NVML_SUCCESS else None,
        )

    def _free(self, state: _GpmState) -> None:
        n = self._nvml
        for sample in (state.sample, state.spare):
            try:
                n.nvmlGpmSampleFree(sample)
            except n.NVMLError as err:
                log.warning("gpm_sample_not_freed", error=str(err))

    # ---- what a GPU cannot read ----------------------------------------------------------------

    def _optional(self, uuid: str, index: int, what: str, read: Callable[[], T]) -> T | None:
        """`read()`, or None where the GPU does not support it (said once per GPU and reading)."""
        n = self._nvml
        try:
            return read()
        except n.NVMLError as err:
            if code(err) not in (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise
            self._once(uuid, what, str(err), gpu=index)
            return None

    def _once(self, uuid: str, what: str, error: str, **context: object) -> None:
        if (uuid, what) not in self._said:
            self._said.add((uuid, what))
            log.info("gpu_reading_not_supported", reading=what, uuid=uuid, error=error, **context)
