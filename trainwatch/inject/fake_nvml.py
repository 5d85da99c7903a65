"""A fake NVML with N settable GPUs, for tests and demos on GPU-less machines.

``FakeNvml`` offers exactly the pynvml names ``trainwatch.watchdog.nvml``
uses: the ``NVMLError`` class, the ``NVML_*`` / ``nvmlEventType*`` constants
and the ``nvml*`` functions, with pynvml's argument order and return shapes.
Tests change a ``FakeGpu``'s fields, mark fields unsupported, inject ECC
errors and Xid events, and the poller sees them as if a driver reported them.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field



class FakeNvmlError(Exception):
    """Stand-in for pynvml.NVMLError: carries the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")


_ERROR_TEXT = {
    1: "Uninitialized",
    3: "Not Supported",
    10: "Timeout",
    12: "NVML Shared Library Not Found",
    15: "GPU is lost",
}


@dataclass(frozen=True, slots=True)
class FakeHandle:
    """Opaque device handle, like pynvml's pointer but comparable."""

    index: int
    """Index of the fake GPU this handle opens."""


@dataclass(slots=True)
class FakeGpu:
    """Settable state of one fake GPU (mutable on purpose: tests change it)."""

    index: int
    """Device index."""
    uuid: str
    """UUID string NVML would report."""
    bus_id: str
    """PCI bus id in NVML's own format: 8-digit domain, upper case."""
    utilization_pct: int = 0
    """GPU utilization percent."""
    memory_used_bytes: int = 0
    """Memory in use, bytes."""
    memory_total_bytes: int = 80 * 1024**3
    """Memory installed, bytes."""
    temperature_c: int = 35
    """Core temperature, Celsius."""
    power_mw: int = 70_000
    """Power draw, milliwatts (NVML's unit)."""
    sm_clock_mhz: int = 1980
    """SM clock, MHz."""
    throttle_mask: int = 0
    """Clock event reasons bitmask."""
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)
    """(error type, counter type) -> count."""
    retired_pages: dict[int, list[int]] = field(default_factory=dict)
    """Retirement cause -> list of page addresses."""
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    """(correctable, uncorrectable, pending, failure) as NVML returns them."""
    unsupported: set[str] = field(default_factory=set)
    """Names of nvml* functions that raise Not Supported for this GPU."""
    xid_events: bool = True
    """Whether the GPU accepts Xid event registration."""


@dataclass(slots=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(slots=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(slots=True)
class _PciInfo:
    busId: str  # noqa: N815 - pynvml's field name
    bus: int
    device: int
    domain: int


@dataclass(slots=True)
class _EventData:
    device: FakeHandle
    eventType: int  # noqa: N815 - pynvml's field name
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


class _EventSet:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: deque[_EventData] = deque()
        self.registered: dict[int, int] = {}  # gpu index -> event type mask


class FakeNvml:
    """Drop-in for the pynvml module, backed by ``gpus``."""

    NVMLError = FakeNvmlError
    NVML_SUCCESS = 0
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nvmlEventTypeXidCriticalError = 0x0000000000000008  # noqa: N815 - pynvml's name

    def __init__(self, gpu_count: int = 2, *, init_error: int | None = None) -> None:
        self.gpus = [
            FakeGpu(index=i,
                    uuid=f"GPU-{i:08x}-0000-4000-8000-{i:012x}",
                    bus_id=f"00000000:{0x3B + i * 0x10:02X}:00.0")
            for i in range(gpu_count)
        ]
        # When set, nvmlInit raises NVMLError with this code (e.g. library not found).
        self.init_error = init_error
        self.initialized = False
        self.init_calls = 0
        self._lock = threading.Lock()
        self._event_sets: list[_EventSet] = []

    # --- test controls ---------------------------------------------------------

    def inject_ecc(self, gpu: int, uncorrected: int = 1, corrected: int = 0) -> None:
        """Add ECC errors to GPU ``gpu``'s volatile and aggregate counters."""
        state = self.gpus[gpu]
        for error_type, amount in ((self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, uncorrected),
                                   (self.NVML_MEMORY_ERROR_TYPE_CORRECTED, corrected)):
            for counter in (self.NVML_VOLATILE_ECC, self.NVML_AGGREGATE_ECC):
                key = (error_type, counter)
                state.ecc[key] = state.ecc.get(key, 0) + amount

    def inject_xid(self, gpu: int, code: int) -> int:
        """Deliver Xid ``code`` from GPU ``gpu`` to every event set watching it; return how many."""
        delivered = 0
        with self._lock:
            event_sets = list(self._event_sets)
        for event_set in event_sets:
            with event_set.cond:
                mask = event_set.registered.get(gpu, 0)
                if not mask & self.nvmlEventTypeXidCriticalError:
                    continue
                event_set.queue.append(_EventData(FakeHandle(gpu),
                                                  self.nvmlEventTypeXidCriticalError, code))
                event_set.cond.notify_all()
                delivered += 1
        return delivered

    def watched_gpus(self) -> set[int]:
        """Indices of GPUs some live event set is registered for."""
        with self._lock:
            return {gpu for es in self._event_sets for gpu in es.registered}

    # --- pynvml surface ------------------------------------------------------------

    def _check(self) -> None:
        if not self.initialized:
            raise FakeNvmlError(self.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: FakeHandle, function: str) -> FakeGpu:
        self._check()
        gpu = self.gpus[handle.index]
        if function in gpu.unsupported:
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's name
        self.init_calls += 1
        if self.init_error is not None:
            raise FakeNvmlError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._check()
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:  # noqa: N802
        self._check()
        if not 0 <= index < len(self.gpus):
            raise FakeNvmlError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> _PciInfo:  # noqa: N802
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        domain, bus, rest = gpu.bus_id.split(":")
        return _PciInfo(busId=gpu.bus_id, bus=int(bus, 16), device=int(rest.split(".")[0], 16),
                        domain=int(domain, 16))

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> _Utilization:  # noqa: N802
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return _Utilization(gpu=gpu.utilization_pct, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> _Memory:  # noqa: N802
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        return _Memory(total=gpu.memory_total_bytes,
                       free=gpu.memory_total_bytes - gpu.memory_used_bytes,
                       used=gpu.memory_used_bytes)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock_type: int) -> int:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetClockInfo").sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").throttle_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:  # noqa: N802
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").throttle_mask

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int,  # noqa: N802
                                    counter_type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        return gpu.ecc.get((error_type, counter_type), 0)

    def nvmlDeviceGetRetiredPages(self, handle: FakeHandle, cause: int) -> list[int]:  # noqa: N802
        return list(self._gpu(handle, "nvmlDeviceGetRetiredPages").retired_pages.get(cause, []))

    def nvmlDeviceGetRemappedRows(  # noqa: N802
            self, handle: FakeHandle) -> tuple[int, int, int, int]:
        return self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped_rows

    def nvmlEventSetCreate(self) -> _EventSet:  # noqa: N802
        self._check()
        event_set = _EventSet()
        with self._lock:
            self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int,  # noqa: N802
                                 event_set: _EventSet) -> None:
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        if event_types & self.nvmlEventTypeXidCriticalError and not gpu.xid_events:
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)
        with event_set.cond:
            event_set.registered[gpu.index] = event_set.registered.get(gpu.index, 0) | event_types

    def nvmlEventSetWait_v2(  # noqa: N802
            self, event_set: _EventSet, timeout_ms: int) -> _EventData:
        self._check()
        with event_set.cond:
            if not event_set.queue:
                event_set.cond.wait(timeout_ms / 1000.0)
            if not event_set.queue:
                raise FakeNvmlError(self.NVML_ERROR_TIMEOUT)
            return event_set.queue.popleft()

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:  # noqa: N802
        with self._lock:
            if event_set in self._event_sets:
                self._event_sets.remove(event_set)


__all__ = ["FakeGpu", "FakeHandle", "FakeNvml", "FakeNvmlError"]
