"""NVML poller, Xid event watcher and GPU <-> rank mapping, against the fake NVML.

The real pynvml is exercised too: on a machine without an NVIDIA driver,
start() must say False, not raise.
"""

from __future__ import annotations

import queue

import pytest

from trainwatch.inject.fake_nvml import FakeNvml
from trainwatch.watchdog.nvml import (
    NO_GPU_MESSAGE,
    GpuSample,
    NvmlPoller,
    XidEventWatcher,
    decode_throttle_reasons,
    map_gpus_to_local_ranks,
)

WAIT_S = 5.0  # upper bound for anything crossing the watcher thread


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(gpu_count=2)


@pytest.fixture
def poller(fake):
    p = NvmlPoller(fake)
    assert p.start()
    yield p
    p.shutdown()


def test_no_gpu_message_is_one_line():
    assert NO_GPU_MESSAGE == "no NVIDIA GPU: hardware checks off"


def test_real_pynvml_without_gpu_returns_false():
    pytest.importorskip("pynvml")
    poller = NvmlPoller()
    try:
        started = poller.start()
    finally:
        poller.shutdown()
    if started:
        pytest.skip("this machine has a working NVIDIA driver")
    assert started is False
    assert poller.sample() == []


def test_start_fails_quietly_when_library_missing():
    fake = FakeNvml(init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    poller = NvmlPoller(fake)
    assert poller.start() is False
    assert fake.init_calls == 1
    assert poller.sample() == []
    poller.shutdown()  # harmless


def test_sample_reads_every_field(fake, poller):
    gpu = fake.gpus[1]
    gpu.utilization_pct = 87
    gpu.memory_used_bytes = 40 * 1024**3
    gpu.temperature_c = 71
    gpu.power_mw = 612_500
    gpu.sm_clock_mhz = 1755
    gpu.throttle_mask = 0x4 | 0x40
    gpu.remapped_rows = (2, 1, 1, 0)
    gpu.retired_pages = {fake.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x1000, 0x2000]}
    samples = poller.sample()
    assert [s.index for s in samples] == [0, 1]
    s = samples[1]
    assert s.uuid == gpu.uuid
    assert s.pci_bus_id == "0000:4b:00.0"
    assert s.utilization_pct == 87
    assert s.memory_used_bytes == 40 * 1024**3
    assert s.memory_total_bytes == 80 * 1024**3
    assert s.temperature_c == 71
    assert s.power_w == pytest.approx(612.5)
    assert s.sm_clock_mhz == 1755
    assert s.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert (s.ecc_volatile_corrected, s.ecc_volatile_uncorrected) == (0, 0)
    assert (s.retired_pages_single_bit, s.retired_pages_double_bit) == (0, 2)
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (2, 1)
    assert s.remapped_rows_pending is True and s.remapped_rows_failure is False


def test_not_supported_fields_become_none(fake, poller):
    fake.gpus[0].unsupported |= {
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetUUID",
    }
    s = poller.sample()[0]
    assert s.power_w is None
    assert s.ecc_aggregate_uncorrected is None and s.ecc_volatile_corrected is None
    assert s.retired_pages_single_bit is None
    assert s.remapped_rows_pending is None and s.remapped_rows_failure is None
    assert s.throttle_reasons is None
    assert s.uuid is None
    assert s.temperature_c == 35  # the supported fields still arrive
    assert poller.sample()[1].power_w is not None  # and the other GPU is untouched


def test_older_driver_throttle_reasons_fallback(fake, poller):
    fake.gpus[0].unsupported.add("nvmlDeviceGetCurrentClocksEventReasons")
    fake.gpus[0].throttle_mask = 0x1
    assert poller.sample()[0].throttle_reasons == ("gpu_idle",)


def test_ecc_injection_shows_in_next_sample(fake, poller):
    before = poller.sample()[1]
    fake.inject_ecc(1, uncorrected=1, corrected=3)
    after = poller.sample()[1]
    assert after.ecc_volatile_uncorrected == before.ecc_volatile_uncorrected + 1
    assert after.ecc_aggregate_uncorrected == before.ecc_aggregate_uncorrected + 1
    assert after.ecc_volatile_corrected == before.ecc_volatile_corrected + 3
    assert poller.sample()[0].ecc_volatile_uncorrected == 0


def test_decode_throttle_reasons():
    assert decode_throttle_reasons(0) == ()
    assert decode_throttle_reasons(0x8 | 0x80) == ("hw_slowdown", "hw_power_brake_slowdown")
    assert decode_throttle_reasons(0x400) == ("bit10",)


def test_xid_event_watcher_delivers_events(fake, poller):
    received: queue.Queue = queue.Queue()
    watcher = XidEventWatcher(poller, received.put, wait_ms=50)
    watcher.start()
    try:
        assert watcher.wait_ready(WAIT_S)
        assert watcher.registered_gpus == 2
        assert fake.inject_xid(1, 79) == 1
        event = received.get(timeout=WAIT_S)
        assert event.code == 79
        assert event.pci == "0000:4b:00.0"
        assert event.severity == "critical"
        assert event.action == "reboot_node"
        assert event.line_no is None and not event.is_sxid
        fake.inject_xid(0, 13)
        assert received.get(timeout=WAIT_S).pci == "0000:3b:00.0"
    finally:
        watcher.stop(timeout=WAIT_S)
    assert fake.watched_gpus() == set()  # the event set was freed


def test_watcher_skips_gpus_without_xid_events(fake, poller):
    fake.gpus[0].xid_events = False
    received: queue.Queue = queue.Queue()
    watcher = XidEventWatcher(poller, received.put, wait_ms=50)
    watcher.start()
    try:
        assert watcher.wait_ready(WAIT_S)
        assert watcher.registered_gpus == 1
        assert fake.inject_xid(0, 48) == 0
        fake.inject_xid(1, 48)
        assert received.get(timeout=WAIT_S).code == 48
    finally:
        watcher.stop(timeout=WAIT_S)


def test_watcher_survives_a_failing_callback(fake, poller):
    received: queue.Queue = queue.Queue()

    def callback(event):
        if event.code == 13:
            raise RuntimeError("consumer bug")
        received.put(event)

    watcher = XidEventWatcher(poller, callback, wait_ms=50)
    watcher.start()
    try:
        assert watcher.wait_ready(WAIT_S)
        fake.inject_xid(0, 13)
        fake.inject_xid(0, 94)
        assert received.get(timeout=WAIT_S).code == 94
    finally:
        watcher.stop(timeout=WAIT_S)


def test_watcher_stops_promptly(fake, poller):
    watcher = XidEventWatcher(poller, lambda event: None, wait_ms=20)
    watcher.start()
    assert watcher.wait_ready(WAIT_S)
    watcher.stop(timeout=WAIT_S)
    assert fake.watched_gpus() == set()


def test_watcher_without_nvml_does_nothing():
    poller = NvmlPoller(FakeNvml(init_error=FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert not poller.start()
    watcher = XidEventWatcher(poller, lambda event: None)
    watcher.start()
    assert watcher.wait_ready(0.1)
    watcher.stop()


def test_watcher_rejects_bad_wait(poller):
    with pytest.raises(ValueError, match="wait_ms"):
        XidEventWatcher(poller, lambda event: None, wait_ms=0)


# --- GPU <-> local rank mapping ----------------------------------------------------

def _samples(n: int) -> list[GpuSample]:
    return [GpuSample(index=i, uuid=f"GPU-{i:x}a1b2c3-0000", pci_bus_id=None) for i in range(n)]


def test_default_rank_i_uses_gpu_i():
    assert map_gpus_to_local_ranks(_samples(8), None, 4) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_visible_device_indices():
    assert map_gpus_to_local_ranks(_samples(8), "4,5,6,7", 4) == {0: 4, 1: 5, 2: 6, 3: 7}


def test_visible_device_uuids_full_and_abbreviated():
    samples = _samples(4)
    value = f"{samples[3].uuid},GPU-1a1b"
    assert map_gpus_to_local_ranks(samples, value, 2) == {0: 3, 1: 1}


def test_visible_devices_stop_at_first_invalid_entry():
    assert map_gpus_to_local_ranks(_samples(4), "2,9,3", 3) == {0: 2}


def test_empty_visible_devices_hides_every_gpu():
    assert map_gpus_to_local_ranks(_samples(4), "", 2) == {}


def test_more_ranks_than_gpus_maps_only_the_gpus():
    assert map_gpus_to_local_ranks(_samples(2), None, 4) == {0: 0, 1: 1}


def test_negative_nproc_is_rejected():
    with pytest.raises(ValueError, match="nproc"):
        map_gpus_to_local_ranks(_samples(2), None, -1)
