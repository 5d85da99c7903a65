import math
import os
import threading
import time

import numpy as np
import pytest

from trainwatch import rankrow, slots
from trainwatch.rank.slotwriter import SlotWriter


def read(seg, index, now=0.0):
    """The RankRow of local slot `index`, or None when it was never written."""
    rows = [r for r in rankrow.decode(seg.read_table(), now) if r.local_rank == index]
    return rows[0] if rows else None


@pytest.fixture
def segment(tmp_path):
    path = str(tmp_path / "seg")
    slots.create_segment(path, 4)
    seg = slots.Segment(path)
    yield seg
    seg.close()


def writer(seg, index, rank=None):
    return SlotWriter(seg, index, pid=os.getpid(), rank=index if rank is None else rank, world_size=4, restart=0)


def test_unwritten_slot_reads_none(segment):
    assert read(segment, 0) is None
    assert rankrow.decode(segment.read_table(), 0.0) == []


def test_step_and_sampler_round_trip(segment):
    w = writer(segment, 2, rank=6)
    w.write_step(7, 1.25, 0.5, 0.2, 0.1, 100.0, 90.0, slots.PHASE_CODES["backward"], 99.5, 14)
    w.write_sampler(101.0, True, 7, [slots.CollectiveGroup(0, 30, 29, "allreduce"), slots.CollectiveGroup(1, 5, 5, "barrier")])
    snap = read(segment, 2, now=102.0)
    assert (snap.rank, snap.local_rank, snap.step, snap.phase, snap.py_collectives) == (6, 2, 7, "backward", 14)
    assert snap.loss == 1.25 and snap.last_step_s == 2.0 and snap.heartbeat_age_s == 1.0
    assert snap.groups == (slots.CollectiveGroup(0, 30, 29, "allreduce"), slots.CollectiveGroup(1, 5, 5, "barrier"))
    table = segment.read_table()
    assert list(table["pid"] > 0) == [False, False, True, False]
    assert table["step"][2] == 7 and table["groups"][2][0]["enqueued"] == 30


def test_torn_write_is_never_returned(segment):
    """A reader racing a writer sees either the old or the new record, never a mix."""
    w = writer(segment, 0)
    stop = threading.Event()

    def spin():
        i = 0
        while not stop.is_set():
            i += 1
            # step and py_collectives always equal: a torn read would split them
            w.write_step(i, float(i), float(i), 0.0, 0.0, float(i), 0.0, 1, float(i), i)

    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(3000):
            s = read(segment, 0)
            if s is not None:
                assert s.step == s.py_collectives == int(s.loss)
            table = segment.read_table()
            if table["pid"][0]:
                assert table["step"][0] == table["py_collectives"][0]
    finally:
        stop.set()
        t.join()


def _hammer(path, index, seconds):
    seg = slots.Segment(path)
    w = SlotWriter(seg, index, pid=os.getpid(), rank=index, world_size=2, restart=0)
    w.write_step(1, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0, 0.0, 1)
    i, deadline = 1, time.monotonic() + seconds
    while time.monotonic() < deadline:
        i += 1
        w.write_fast(i, 1.0, 1.0, 0.1, 0.1, float(i), 0.0, 1, 1, 0.0, i, colls=i, seq=i)
        w.write_phase(2, 1, float(i), i)
        w.write_sampler(float(i), True, i, [slots.CollectiveGroup(0, i, i, "allreduce")], float(i), i)


def test_table_reads_are_never_torn_across_processes(tmp_path):
    """Writers in other processes hammering their slots as fast as they can:
    every row read is a whole record (step == collectives == heartbeat)."""
    import multiprocessing as mp

    path = str(tmp_path / "seg")
    slots.create_segment(path, 2)
    seg = slots.Segment(path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(path, i, 3.0)) for i in range(2)]
    for p in procs:
        p.start()
    try:
        reads = checked = 0
        deadline = time.monotonic() + 20
        previous = None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            table = seg.read_table(previous=previous)
            previous = table
            reads += 1
            live = table[table["pid"] > 0]
            started = live[live["step"] > 1]
            checked += len(started)
            assert (started["step"] == started["py_collectives"]).all()
            ring = started["ring"][np.arange(len(started)), started["step"] % slots.RING]
            assert (ring["step"] == started["step"]).all() and (ring["colls"] == started["step"]).all()
            assert (started["cpu_s"] == started["sampled_step"]).all()
            assert (started["groups"]["enqueued"][:, 0] == started["sampled_step"]).all()
    finally:
        for p in procs:
            p.join(timeout=30)
    assert checked > 100, (reads, checked)


def test_control_channel(segment):
    w = writer(segment, 1)
    segment.request_checkpoint(1, 3)
    assert w.read_request() == 3
    w.write_checkpoint_status(3, slots.CKPT_OK, 42)
    assert segment.read_control(1) == (3, 3, slots.CKPT_OK, 42)


def test_clear_resets_slot(segment):
    w = writer(segment, 3)
    w.write_step(5, 1.0, 1.0, 0.1, 0.1, 1.0, 0.0, 0, 0.0, 0)
    segment.clear(3)
    assert read(segment, 3) is None


def test_bad_segment_file_is_a_clear_error(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"x" * 4096)
    p.chmod(0o600)
    with pytest.raises(ValueError, match="unknown slot layout"):
        slots.Segment(str(p))


def test_api_records_into_slot(tmp_path, monkeypatch):
    from trainwatch.rank import telemetry as api

    path = str(tmp_path / "seg")
    slots.create_segment(path, 2)
    seg = slots.Segment(path)
    tw = api.Telemetry(seg, 1, rank=1, world_size=2, restart=0, attached=True)
    with tw.phase("data"):
        assert read(seg, 1).phase == "data"
    with tw.phase("backward"):
        pass
    tw.step(loss=2.5, grad_norm=1.5)
    s = read(seg, 1)
    assert (s.step, s.loss, s.grad_norm, s.phase) == (1, 2.5, 1.5, "compute")  # past start-up
    assert s.step_source == "reported"
    assert s.step_s >= 0 and not math.isnan(s.compute_s) and s.compute_s <= s.step_s
    tw.step(step=10)
    assert read(seg, 1).step == 10
    with pytest.raises(ValueError, match="unknown phase"):
        with tw.phase("bogus"):
            pass


def test_rank_keeps_its_worst_loss_until_the_sidecar_reads(tmp_path):
    from trainwatch.rank import telemetry as api

    path = str(tmp_path / "seg")
    slots.create_segment(path, 1)
    seg = slots.Segment(path)
    tw = api.Telemetry(seg, 0, rank=0, world_size=1, restart=0, attached=True)
    seg.acknowledge_read(seg.read_table())
    for loss in (3.0, 90.0, 2.9):
        tw.step(loss=loss, grad_norm=1.0)
    row = seg.read_table()[0]
    assert (row["loss"], row["peak_loss"], row["peak_loss_step"]) == (2.9, 90.0, 2)
    seg.acknowledge_read(seg.read_table())  # read step 3: a new window starts with the next step
    tw.step(loss=2.8, grad_norm=1.0)
    row = seg.read_table()[0]
    assert (row["peak_loss"], row["peak_loss_step"]) == (2.8, 4)
    tw.step(loss=float("nan"), grad_norm=1.0)
    tw.step(loss=2.7, grad_norm=1.0)
    row = seg.read_table()[0]
    assert math.isnan(row["peak_loss"]) and row["peak_loss_step"] == 5  # NaN sticks within a window


def test_a_spike_published_between_the_read_and_its_acknowledgement_is_kept(tmp_path):
    """The sidecar copies the table, the rank publishes a spike, then the
    sidecar acknowledges: the acknowledgement names the step it read, so the
    rank keeps the unread spike for the next read instead of dropping it."""
    from trainwatch.rank import telemetry as api

    path = str(tmp_path / "seg")
    slots.create_segment(path, 1)
    seg = slots.Segment(path)
    tw = api.Telemetry(seg, 0, rank=0, world_size=1, restart=0, attached=True)
    for loss in (3.0, 2.9):
        tw.step(loss=loss, grad_norm=1.0)
    copied = seg.read_table()  # the sidecar's copy: step 2
    tw.step(loss=150.0, grad_norm=40.0)  # step 3 spikes before the acknowledgement
    seg.acknowledge_read(copied)
    tw.step(loss=2.8, grad_norm=1.0)  # step 4 sees the acknowledgement of step 2
    row = seg.read_table()[0]
    assert (row["peak_loss"], row["peak_loss_step"]) == (150.0, 3)
    assert (row["peak_grad"], row["peak_grad_step"]) == (40.0, 3)
    seg.acknowledge_read(seg.read_table())  # now step 4 was read, the spike with it
    tw.step(loss=2.7, grad_norm=1.0)
    row = seg.read_table()[0]
    assert (row["peak_loss"], row["peak_loss_step"]) == (2.7, 5)


def test_truncated_segment_is_a_clear_error(tmp_path):
    path = str(tmp_path / "seg")
    slots.create_segment(path, 4)
    os.truncate(path, slots.HEADER_SIZE + slots.SLOT_SIZE)  # the header still claims 4 slots
    with pytest.raises(ValueError, match="truncated"):
        slots.Segment(path)


def test_layout_is_declared_once_and_derived():
    dt = slots.slot_dtype()
    for name in ("step", "loss", "phase", "step_source", "active_mono", "cpu_s", "io_bytes", "ckpt_ready"):
        assert dt.fields[name][1] == slots.OFFSETS[name]
    assert dt.itemsize == slots.SLOT_SIZE
    assert slots.A_DYN_OFF == slots.OFFSETS["step"] and slots.C_OFF == slots.OFFSETS["ckpt_request"]
    # regions never share a cache line: each has its own single writer
    assert len({slots.OFFSETS[f"region_{r}"] // 64 for r in "APBC"}) == 4


def test_activity_marks_and_ring_of_step_ends(tmp_path):
    from trainwatch.rank import telemetry as api

    path = str(tmp_path / "seg")
    slots.create_segment(path, 1)
    seg = slots.Segment(path)
    tw = api.Telemetry(seg, 0, rank=0, world_size=1, restart=0, attached=True)
    tw.count_batch()
    tw.count_batch()
    tw.mark_active()
    for step in range(1, 7):
        tw.world_collectives += 2
        tw.step(loss=1.0)
    row = seg.read_table()[0]
    assert row["batches"] == 2 and row["active_mono"] > 0 and row["first_step"] == 1
    ring = sorted(row["ring"].tolist())
    assert ring == [(3, 6, -1), (4, 8, -1), (5, 10, -1), (6, 12, -1)]


_COUNTING = """
import sys, torch, torch.distributed as dist
from trainwatch import slots
from trainwatch.rank import collectives, telemetry as api
from trainwatch.rank.slotwriter import SlotWriter
path, store = sys.argv[1], sys.argv[2]
slots.create_segment(path, 1)
seg = slots.Segment(path)
tw = api.Telemetry(seg, 0, rank=0, world_size=1, restart=0, attached=True)
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
collectives.install(tw)
tw.sample_now()  # picks up the default group's sequence counter
with tw.phase("forward"):
    dist.all_reduce(torch.ones(2))
    dist.barrier()
    dist.all_reduce(torch.ones(2), async_op=True).wait()
    assert tw.phase_name == "forward"  # each wait was marked `collective`, then the phase came back
assert tw._wait_s > 0  # ... and its time is not compute
tw.step(loss=1.0)
entry = seg.read_table()[0]["ring"][1]
assert entry["step"] == 1 and entry["colls"] == 3 and entry["seq"] >= 3, entry
dist.destroy_process_group()
print("ok")
"""


def test_collectives_are_counted_and_mark_the_rank_waiting(tmp_path):
    """A real (single-rank) gloo group, in its own process (the wrappers are
    process-wide): Python collectives and the default group's sequence number
    land in the end-of-step ring; blocking calls and work.wait() are waits."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _COUNTING, str(tmp_path / "seg"), str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


_FR_AFTER_DESTROY = """
import os, sys
os.environ["TORCH_FR_BUFFER_SIZE"] = "100"
import torch, torch.distributed as dist
from trainwatch.rank.flightrec import FlightRecorderReader
fr = FlightRecorderReader()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import time
for _ in range(3):
    dist.all_reduce(torch.ones(2))
# gloo marks an op complete in the flight recorder from its own thread, just
# after the caller's all_reduce returns: wait for it, bounded
deadline = time.monotonic() + 30
live = fr.sample()
while not (live and live[0].completed >= 3) and time.monotonic() < deadline:
    time.sleep(0.01)
    live = fr.sample()
assert live and fr.available and live[0].completed >= 3, live
dist.destroy_process_group()
assert fr.sample() == live, fr.sample()
print("ok")
"""


def test_flight_recorder_state_outlives_the_group(tmp_path):
    """A sampler round after destroy_process_group republishes the groups'
    final state, never the wrapper's counts (they miss DDP's collectives)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _FR_AFTER_DESTROY, str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_stable_group_ids_mean_the_same_group_on_every_rank():
    from trainwatch.rank.flightrec import stable_group_id

    assert stable_group_id("0") == 0 and stable_group_id("3") == 3
    hashed = stable_group_id("a3f9c2e1")
    assert hashed >= 1 << 30 and hashed == stable_group_id("a3f9c2e1")


def test_a_planted_segment_is_refused_never_followed(tmp_path) -> None:
    """/dev/shm is world-writable: a path someone else put there first is not ours."""
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    link = tmp_path / "trainwatch-seg.slots"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="already exists"):
        slots.create_segment(str(link), 2)
    with pytest.raises(ValueError, match="symlink"):
        slots.Segment(str(link))
    assert target.read_bytes() == b"precious"
    path = str(tmp_path / "shared.slots")
    slots.create_segment(path, 2)
    assert os.stat(path).st_mode & 0o777 == 0o600
    os.chmod(path, 0o666)  # readable and writable by anyone: not a private segment
    with pytest.raises(ValueError, match="not a private regular file"):
        slots.Segment(path)
    with pytest.raises(ValueError, match="not a private regular file"):  # a device or pipe
        os.mkfifo(tmp_path / "fifo", 0o600)
        slots.Segment(str(tmp_path / "fifo"))
