"""GPU health from NVML: per-GPU samples, Xid events, GPU <-> local rank mapping.

The ``nvml`` module is injected (default: ``pynvml`` from nvidia-ml-py) so the
same code runs against ``trainwatch.inject.fake_nvml.FakeNvml`` in tests.
Only ``nvml.NVMLError``, ``nvml.NVML_*`` constants and ``nvml.nvml*``
functions are used, exactly as pynvml spells them.

Without a GPU (no driver, no library) ``NvmlPoller.start()`` returns False and
the caller prints ``NO_GPU_MESSAGE`` once; nothing here raises for that case.
Every per-field read is guarded: a field the GPU does not support is None.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainwatch.diagnostics.kernel_log import XidEvent, normalize_pci
from trainwatch.diagnostics.xid import lookup

log = logging.getLogger(__name__)

NO_GPU_MESSAGE = "no NVIDIA GPU: hardware checks off"
"""The one line printed when NVML cannot start."""

# Clock event ("throttle") reason bits, as defined in nvml.h. Kept here rather
# than read from the module so decoding is a pure function of the mask.
THROTTLE_REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x0000000000000001, "gpu_idle"),
    (0x0000000000000002, "applications_clocks_setting"),
    (0x0000000000000004, "sw_power_cap"),
    (0x0000000000000008, "hw_slowdown"),
    (0x0000000000000010, "sync_boost"),
    (0x0000000000000020, "sw_thermal_slowdown"),
    (0x0000000000000040, "hw_thermal_slowdown"),
    (0x0000000000000080, "hw_power_brake_slowdown"),
    (0x0000000000000100, "display_clock_setting"),
)

XID_CRITICAL_ERROR_EVENT = 0x0000000000000008
"""nvmlEventTypeXidCriticalError, as defined in nvml.h."""


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One reading of one GPU; a field is None when the GPU cannot report it."""

    index: int
    """NVML device index (PCI bus order)."""
    uuid: str | None
    """GPU UUID, e.g. 'GPU-0b11d014-...'."""
    pci_bus_id: str | None
    """PCI address, lower case, 4-digit domain: '0000:3b:00.0'."""
    utilization_pct: int | None = None
    """Percent of the last sample period a kernel was running."""
    memory_used_bytes: int | None = None
    """Device memory in use, bytes."""
    memory_total_bytes: int | None = None
    """Device memory installed, bytes."""
    temperature_c: int | None = None
    """GPU core temperature, degrees Celsius."""
    power_w: float | None = None
    """Board power draw, watts."""
    sm_clock_mhz: int | None = None
    """Current SM clock, MHz."""
    throttle_reasons: tuple[str, ...] | None = None
    """Active clock event (throttle) reasons, decoded to names."""
    ecc_volatile_corrected: int | None = None
    """Corrected ECC errors since the driver loaded."""
    ecc_volatile_uncorrected: int | None = None
    """Uncorrected ECC errors since the driver loaded."""
    ecc_aggregate_corrected: int | None = None
    """Corrected ECC errors over the GPU's lifetime."""
    ecc_aggregate_uncorrected: int | None = None
    """Uncorrected ECC errors over the GPU's lifetime."""
    retired_pages_single_bit: int | None = None
    """Pages retired after repeated single-bit errors (pre-Ampere GPUs)."""
    retired_pages_double_bit: int | None = None
    """Pages retired after a double-bit error (pre-Ampere GPUs)."""
    remapped_rows_correctable: int | None = None
    """Memory rows remapped after correctable errors (Ampere and newer)."""
    remapped_rows_uncorrectable: int | None = None
    """Memory rows remapped after uncorrectable errors (Ampere and newer)."""
    remapped_rows_pending: bool | None = None
    """True when a remap waits for the next GPU reset."""
    remapped_rows_failure: bool | None = None
    """True when a remap failed: the GPU is an RMA candidate."""


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """Names of the reason bits set in ``mask``; unknown bits read as 'bit<N>'."""
    names = [name for bit, name in THROTTLE_REASON_BITS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASON_BITS:
        known |= bit
    unknown = mask & ~known
    position = 0
    while unknown:
        if unknown & 1:
            names.append(f"bit{position}")
        unknown >>= 1
        position += 1
    return tuple(names)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """A hashable identity for a device handle.

    pynvml handles are ctypes pointers, and two pointer objects to the same
    device compare unequal; their address is what identifies the device.
    """
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


def _import_pynvml() -> Any | None:
    try:
        import pynvml  # noqa: PLC0415 - optional at runtime, imported on demand
    except ImportError:
        return None
    return pynvml


class NvmlPoller:
    """Samples every GPU through NVML; safe to use on machines without one."""

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml if nvml is not None else _import_pynvml()
        self._started = False

    @property
    def nvml(self) -> Any | None:
        """The NVML module in use (None when pynvml is not installed)."""
        return self._nvml

    @property
    def started(self) -> bool:
        """True between a successful start() and shutdown()."""
        return self._started

    def start(self) -> bool:
        """Initialize NVML; False (never an exception) when there is no usable GPU."""
        if self._nvml is None:
            return False
        try:
            self._nvml.nvmlInit()
        except (self._nvml.NVMLError, OSError) as exc:
            log.debug("nvmlInit failed: %s", exc)
            return False
        self._started = True
        return True

    def shutdown(self) -> None:
        """Release NVML; harmless when it never started."""
        if not self._started:
            return
        self._started = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> NvmlPoller:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _read(self, fn: Callable[..., Any], *args: Any) -> Any | None:
        # One unsupported (or failing) counter must not hide all the others.
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def device_count(self) -> int:
        """Number of GPUs NVML sees (0 when not started)."""
        if not self._started:
            return 0
        count = self._read(self._nvml.nvmlDeviceGetCount)
        return int(count) if count is not None else 0

    def handles(self) -> list[tuple[int, Any]]:
        """(index, handle) for every GPU NVML can open."""
        result = []
        for index in range(self.device_count()):
            handle = self._read(self._nvml.nvmlDeviceGetHandleByIndex, index)
            if handle is not None:
                result.append((index, handle))
        return result

    def sample(self) -> list[GpuSample]:
        """One GpuSample per GPU; empty when NVML is not started."""
        return [self._sample_one(index, handle) for index, handle in self.handles()]

    def _sample_one(self, index: int, handle: Any) -> GpuSample:
        nv, read = self._nvml, self._read
        uuid = read(nv.nvmlDeviceGetUUID, handle)
        pci = read(nv.nvmlDeviceGetPciInfo, handle)
        util = read(nv.nvmlDeviceGetUtilizationRates, handle)
        memory = read(nv.nvmlDeviceGetMemoryInfo, handle)
        power_mw = read(nv.nvmlDeviceGetPowerUsage, handle)
        rows = read(nv.nvmlDeviceGetRemappedRows, handle)
        return GpuSample(
            index=index,
            uuid=_text(uuid) if uuid is not None else None,
            pci_bus_id=normalize_pci(_text(pci.busId)) if pci is not None else None,
            utilization_pct=int(util.gpu) if util is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            temperature_c=read(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            sm_clock_mhz=read(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
            throttle_reasons=self._throttle_reasons(handle),
            ecc_volatile_corrected=self._ecc(handle, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                             nv.NVML_VOLATILE_ECC),
            ecc_volatile_uncorrected=self._ecc(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                               nv.NVML_VOLATILE_ECC),
            ecc_aggregate_corrected=self._ecc(handle, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                              nv.NVML_AGGREGATE_ECC),
            ecc_aggregate_uncorrected=self._ecc(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                nv.NVML_AGGREGATE_ECC),
            retired_pages_single_bit=self._retired(
                handle, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
            retired_pages_double_bit=self._retired(
                handle, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
            remapped_rows_correctable=int(rows[0]) if rows is not None else None,
            remapped_rows_uncorrectable=int(rows[1]) if rows is not None else None,
            remapped_rows_pending=bool(rows[2]) if rows is not None else None,
            remapped_rows_failure=bool(rows[3]) if rows is not None else None,
        )

    def _ecc(self, handle: Any, error_type: int, counter_type: int) -> int | None:
        value = self._read(self._nvml.nvmlDeviceGetTotalEccErrors, handle, error_type, counter_type)
        return int(value) if value is not None else None

    def _retired(self, handle: Any, cause: int) -> int | None:
        pages = self._read(self._nvml.nvmlDeviceGetRetiredPages, handle, cause)
        return len(pages) if pages is not None else None

    def _throttle_reasons(self, handle: Any) -> tuple[str, ...] | None:
        # Drivers >= 535 name these "clock event reasons"; older ones only
        # have the "throttle reasons" call. Try the new name first.
        for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                     "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(self._nvml, name, None)
            if fn is None:
                continue
            mask = self._read(fn, handle)
            if mask is not None:
                return decode_throttle_reasons(int(mask))
        return None

    def pci_by_handle(self) -> list[tuple[int, Any, str | None]]:
        """(index, handle, pci bus id) for every GPU; used to label NVML events."""
        result = []
        for index, handle in self.handles():
            pci = self._read(self._nvml.nvmlDeviceGetPciInfo, handle)
            bus_id = normalize_pci(_text(pci.busId)) if pci is not None else None
            result.append((index, handle, bus_id))
        return result


class XidEventWatcher:
    """Background thread turning NVML Xid events into XidEvent callbacks.

    NVML blocks in ``nvmlEventSetWait_v2`` for at most ``wait_ms``, so ``stop()``
    returns within about that long. The callback runs on the watcher thread.
    """

    def __init__(self, poller: NvmlPoller, on_event: Callable[[XidEvent], None], *,
                 wait_ms: int = 500, error_backoff_s: float = 1.0) -> None:
        if wait_ms <= 0:
            raise ValueError(f"wait_ms must be a positive number of milliseconds; got {wait_ms}")
        self._poller = poller
        self._on_event = on_event
        self._wait_ms = wait_ms
        self._error_backoff_s = error_backoff_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered = 0

    @property
    def registered_gpus(self) -> int:
        """How many GPUs accepted Xid event registration (valid once ready)."""
        return self._registered

    def start(self) -> None:
        """Start the thread; a no-op when it already runs or NVML is not started."""
        if self._thread is not None or not self._poller.started:
            self._ready.set()
            return
        self._thread = threading.Thread(target=self._run, name="trainwatch-xid-watcher",
                                        daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Block until events are registered (or watching was impossible)."""
        return self._ready.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to finish and wait up to ``timeout`` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        nv = self._poller.nvml
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("cannot watch Xid events: %s", exc)
            self._ready.set()
            return
        try:
            pci_of = self._register(event_set)
            self._ready.set()
            if pci_of:
                self._loop(event_set, pci_of)
        finally:
            self._ready.set()
            try:
                nv.nvmlEventSetFree(event_set)
            except nv.NVMLError as exc:
                log.debug("nvmlEventSetFree failed: %s", exc)

    def _register(self, event_set: Any) -> dict[Any, str | None]:
        """Register every GPU that offers Xid events; return handle key -> PCI id."""
        nv = self._poller.nvml
        pci_of: dict[Any, str | None] = {}
        for index, handle, pci in self._poller.pci_by_handle():
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
            except nv.NVMLError as exc:
                # Some GPUs (and vGPUs) do not offer Xid events; watch the rest.
                log.debug("GPU %d: no Xid events: %s", index, exc)
                continue
            pci_of[_handle_key(handle)] = pci
        self._registered = len(pci_of)
        return pci_of

    def _loop(self, event_set: Any, pci_of: dict[Any, str | None]) -> None:
        nv = self._poller.nvml
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(event_set, self._wait_ms)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    continue
                # A lost GPU makes every wait fail at once; back off instead of spinning.
                log.warning("NVML event wait failed: %s", exc)
                self._stop.wait(self._error_backoff_s)
                continue
            event = self._to_event(data, pci_of)
            if event is None:
                continue
            try:
                self._on_event(event)
            except Exception:  # noqa: BLE001 - one bad callback must not end the watch
                log.exception("Xid event callback failed")

    @staticmethod
    def _to_event(data: Any, pci_of: dict[Any, str | None]) -> XidEvent | None:
        if not int(data.eventType) & XID_CRITICAL_ERROR_EVENT:
            return None
        code = int(data.eventData)
        pci = pci_of.get(_handle_key(data.device))
        info = lookup(code)
        return XidEvent(code=code, pci=pci, pid=None, process=None,
                        text=f"NVML event: Xid {code} ({info.name})",
                        severity=info.severity, action=info.action,
                        line_no=None, timestamp=None)


def map_gpus_to_local_ranks(samples: Sequence[GpuSample], cuda_visible_devices: str | None,
                            nproc: int) -> dict[int, int]:
    """Map local rank -> NVML GPU index, the way torchrun's ranks pick GPUs.

    Each local rank i uses CUDA device i, which is the i-th entry of
    CUDA_VISIBLE_DEVICES (an index or a UUID, possibly abbreviated) or GPU i
    when the variable is unset. Ranks beyond the visible GPUs get no entry.
    NVML numbers GPUs in PCI order; CUDA does too when CUDA_DEVICE_ORDER is
    PCI_BUS_ID, and on nodes of identical GPUs its default order agrees.
    """
    if nproc < 0:
        raise ValueError(f"nproc must be >= 0; got {nproc}")
    indices = sorted(sample.index for sample in samples)
    if cuda_visible_devices is None:
        visible = indices
    else:
        visible = _parse_visible_devices(samples, cuda_visible_devices)
    return {rank: visible[rank] for rank in range(min(nproc, len(visible)))}


def _parse_visible_devices(samples: Sequence[GpuSample], value: str) -> list[int]:
    known = {sample.index for sample in samples}
    visible: list[int] = []
    for raw in value.split(","):
        entry = raw.strip()
        index = _resolve_device(samples, known, entry)
        # CUDA stops at the first entry it cannot resolve and ignores the rest.
        if index is None:
            break
        if index not in visible:
            visible.append(index)
    return visible


def _resolve_device(samples: Sequence[GpuSample], known: set[int], entry: str) -> int | None:
    if entry.isdigit():
        index = int(entry)
        return index if index in known else None
    if entry.upper().startswith("GPU-"):
        prefix = entry.lower()
        matches = [s.index for s in samples if s.uuid and s.uuid.lower().startswith(prefix)]
        # An abbreviated UUID is only valid when it names exactly one GPU.
        return matches[0] if len(matches) == 1 else None
    return None
