"""Zero-code stragglers from collective arrival times: the rank side (what the
sampler publishes from the flight recorder) and the straggler detector's
arrival-order evidence, driven with synthetic slot tables and made-up times."""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slot_tables import make_table, set_ring, view
from util import SCRIPTS, events, reap, start, stop_group, wait_for

from trainwatch import slots
from trainwatch.rank.flightrec import ArrivalRing, FlightRecorderReader
from trainwatch.watchdog.detectors import StragglerConfig, StragglerDetector
from trainwatch.watchdog.detectors.arrival import ArrivalTable
from trainwatch.watchdog.detectors.base import TickView

EPOCH_NS = 1_700_000_000 * 10**9
ENQ, STARTED = slots.ARRIVAL_ENQUEUED, slots.ARRIVAL_STARTED


class ArrivalJob:
    """`n` ranks in lock step: each step is `colls` collectives of the default
    group; at each, rank r arrives `late[r]` s after the group (plus jitter).
    Each rank publishes through the real ArrivalRing, as its sampler would;
    one tick per step. `startup` collectives come before the first step, with
    rank 1 two seconds late to them (slow to load its data)."""

    def __init__(self, n: int, *, step_s: float = 0.3, colls: int = 1, source: int = ENQ, startup: int = 3,
                 seed: int = 0):
        self.n, self.step_s, self.colls = n, step_s, colls
        self.sources = np.full(n, source)
        self.offset = np.zeros(n)  # a rank's clock (or its kind of time) off the others'
        self.table = make_table(n, now=0.0, step=0, step_s=np.nan, compute_s=np.nan, phase="init", start_mono=0.0)
        self.now = 0.0
        self.seq = 0
        self.rings = [ArrivalRing() for _ in range(n)]
        self.found: list[dict[int, tuple[int, int]]] = [{} for _ in range(n)]
        self.rng = np.random.default_rng(seed)
        for _ in range(startup):
            self._collective(np.where(np.arange(n) == 1, 2.0, 0.0), 0.0)
        self.publish()

    def _collective(self, late: np.ndarray, jitter: float) -> None:
        self.seq += 1
        t = self.now + late + self.offset + (self.rng.normal(0, jitter, self.n) if jitter else 0.0)
        for r in range(self.n):
            ns = EPOCH_NS + int(t[r] * 1e9)
            # gloo: only time_created_ns; NCCL with timing: the start, a little after.
            self.found[r][self.seq] = (ns, ns + 1000) if self.sources[r] == STARTED else (ns, 0)
            if len(self.found[r]) > 200:  # the flight recorder's buffer rolls over
                del self.found[r][min(self.found[r])]

    def publish(self, ranks=None) -> None:
        t = self.table
        for r in range(self.n) if ranks is None else ranks:
            got = self.rings[r].update(self.found[r])
            if got is None:
                continue
            source, entries = got
            t["arrival_source"][r] = source
            t["narrivals"][r] = len(entries)
            t["arrivals"]["seq"][r] = 0
            t["arrivals"]["t_ns"][r] = 0
            for i, (s, ns) in enumerate(entries):
                t["arrivals"]["seq"][r, i] = s
                t["arrivals"]["t_ns"][r, i] = ns

    def step(self, late=None, *, jitter: float = 0.002, compute=None, publish=None) -> TickView:
        late = np.zeros(self.n) if late is None else np.asarray(late, dtype=float)
        for _ in range(self.colls):
            self._collective(late, jitter)
        dt = self.step_s + max(0.0, float(late.max()))
        self.now += dt
        t = self.table
        t["step"] += 1
        t["step_s"] = dt
        t["compute_s"] = np.nan if compute is None else compute
        t["progress_mono"] = t["phase_mono"] = t["heartbeat_mono"] = self.now
        t["phase"] = slots.PHASE_CODES["data"]
        for r in range(self.n):
            set_ring(t, int(t["step"][r]), colls=0, seq=self.seq, ranks=[r])
        self.publish(publish)
        return view(t, self.now)


def run(det: StragglerDetector, job: ArrivalJob, steps: int, late_of=lambda i: None, **kw) -> list:
    """(step index, incident) for every incident over `steps` steps."""
    return [(i, inc) for i in range(steps) for inc in det.check(job.step(late_of(i), **kw))]


def straggler_from(step: int, rank: int = 2, n: int = 4, delay: float = 0.3):
    return lambda i: np.where(np.arange(n) == rank, delay, 0.0) if i >= step else None


# ---- the rank side: what the sampler publishes ---------------------------------------------------


def created(seqs, t0=0):
    return {s: (EPOCH_NS + t0 + s * 1000, 0) for s in seqs}


def test_ring_publishes_every_collective_of_a_slow_job():
    ring = ArrivalRing()
    assert ring.update({}) is None
    source, entries = ring.update(created(range(1, 6)))
    assert source == ENQ and [s for s, _ in entries] == [1, 2, 3, 4, 5]
    source, entries = ring.update(created(range(1, 9)))
    assert [s for s, _ in entries] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert dict(entries)[7] == EPOCH_NS + 7000


def test_ring_subsamples_a_fast_job_with_a_power_of_two_stride_and_keeps_the_last_16():
    ring = ArrivalRing()
    _, entries = ring.update(created(range(1, 101)))
    seqs = [s for s, _ in entries]
    # 100 new: multiples of 16 (6 of them) are the first stride that fits in half the ring
    assert seqs == [16, 32, 48, 64, 80, 96]
    _, entries = ring.update(created(range(1, 131)))  # 30 new: every 4th
    assert [s for s, _ in entries] == [16, 32, 48, 64, 80, 96, 104, 108, 112, 116, 120, 124, 128]
    for top in range(131, 2000, 37):
        _, entries = ring.update(created(range(max(1, top - 1999), top + 1)))
    seqs = [s for s, _ in entries]
    assert len(seqs) == slots.ARRIVALS and seqs == sorted(seqs) and seqs[-1] > 1900


def test_rings_sampled_at_different_moments_meet_on_common_sequence_numbers():
    fast, slow = ArrivalRing(), ArrivalRing()
    fast_seen, slow_seen = set(), set()
    for top in range(3, 400, 3):  # 3 collectives between two rounds of one rank ...
        fast_seen |= {s for s, _ in fast.update(created(range(1, top + 1)))[1]}
        if top % 21 == 0:  # ... 21 between two rounds of the other (its sampler was late)
            slow_seen |= {s for s, _ in slow.update(created(range(1, top + 1)))[1]}
    common = fast_seen & slow_seen
    assert len(common) >= 40 and all(s % 2 == 0 for s in common)


def test_ring_prefers_device_start_times_and_starts_over_on_a_new_group():
    ring = ArrivalRing()
    found = {s: (EPOCH_NS + s, EPOCH_NS + s + 500 if s <= 4 else 0) for s in range(1, 7)}
    source, entries = ring.update(found)
    # seqs 5, 6 have not started yet: left out until they have
    assert source == STARTED and entries == [(s, EPOCH_NS + s + 500) for s in range(1, 5)]
    found.update({5: (EPOCH_NS + 5, EPOCH_NS + 900), 6: (EPOCH_NS + 6, EPOCH_NS + 950)})
    assert ring.update(found)[1][-2:] == [(5, EPOCH_NS + 900), (6, EPOCH_NS + 950)]
    # destroy_process_group + init_process_group: numbers start over
    source, entries = ring.update({1: (EPOCH_NS + 10**9, 0), 2: (EPOCH_NS + 2 * 10**9, 0)})
    assert source == ENQ and [s for s, _ in entries] == [1, 2]


def fake_dump(entries, pg_status=None) -> str:
    return json.dumps({"version": "2.10", "entries": entries,
                       "pg_status": pg_status if pg_status is not None else {"0": {"last_enqueued_collective": "9",
                                                                                     "last_completed_collective": "9"}}})


def entry(seq, pg=0, name="0", *, created_ns=None, started=0, p2p=False, op="gloo:all_reduce"):
    return {"collective_seq_id": seq, "pg_id": pg, "process_group": [name, "default_pg" if name == "0" else "x"],
            "is_p2p": p2p, "profiling_name": op, "time_created_ns": created_ns or EPOCH_NS + seq * 10**6,
            "time_discovered_started_ns": started}


@pytest.fixture
def reader(monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    r = FlightRecorderReader()
    box = {"dump": fake_dump([])}
    r._fn = lambda **kw: box["dump"]
    return r, box


def test_reader_publishes_the_default_groups_collectives_only(reader):
    r, box = reader
    box["dump"] = fake_dump([
        entry(1), entry(2), entry(1, pg=1, name="1"),  # a subgroup's own numbering
        entry(3, p2p=True, op="gloo:send"),  # point-to-point: not a collective every rank joins
        {"collective_seq_id": "x", "pg_id": 0, "process_group": ["0"]},  # malformed: skipped
        {"pg_id": 0, "process_group": ["0"]},  # no seq: skipped
        entry(4), "not an entry", entry(5, started=0),
    ])
    groups = r.sample()
    assert r.available and [g.pg for g in groups] == [0]
    assert r.arrivals == (ENQ, [(1, EPOCH_NS + 10**6), (2, EPOCH_NS + 2 * 10**6), (4, EPOCH_NS + 4 * 10**6),
                                (5, EPOCH_NS + 5 * 10**6)])


def test_reader_with_nccl_timing_publishes_start_times(reader):
    r, box = reader
    box["dump"] = fake_dump([entry(s, started=EPOCH_NS + s * 10**6 + 777) for s in (1, 2, 3)] + [entry(4)])
    r.sample()
    assert r.arrivals == (STARTED, [(s, EPOCH_NS + s * 10**6 + 777) for s in (1, 2, 3)])


@pytest.mark.parametrize("dump", ["not json", "[1, 2]", json.dumps({"entries": 5, "pg_status": []}),
                                  json.dumps({"entries": [{"collective_seq_id": 1, "pg_id": "zero"}]}),
                                  json.dumps({"entries": [entry(10**30)], "pg_status": {"0": "x"}})])
def test_reader_publishes_nothing_from_a_dump_of_the_wrong_shape(reader, dump):
    r, box = reader
    box["dump"] = dump
    r.sample()  # never raises
    assert r.arrivals is None


def test_reader_publishes_nothing_when_the_dump_fails_or_the_group_is_gone(reader, monkeypatch):
    r, box = reader
    box["dump"] = fake_dump([entry(1), entry(2)])
    r.sample()
    assert r.arrivals is not None

    def broken(**kw):
        raise RuntimeError("flight recorder gone")

    r._fn = broken
    assert r.sample() is None and r.arrivals is None
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    r.sample()
    assert r.arrivals is None


class FakeRecorder:
    """A flight recorder whose whole-buffer dump costs `cost_s` of a fake clock,
    with `per_round` collectives launched between two sampler rounds."""

    def __init__(self, cost_s: float, per_round: int = 10, per_entry_s: float = 0.0, capacity: int = 2000):
        self.now, self.cost_s, self.per_round = 0.0, cost_s, per_round
        self.per_entry_s, self.capacity = per_entry_s, capacity
        self.seq, self.done = 0, 0
        self.spent = 0.0

    def __call__(self, includeCollectives=True, onlyActive=False):
        entries = []
        if includeCollectives:
            # per_entry_s: a dump costs what the buffer holds (as torch's does), else cost_s.
            held = self.capacity if self.per_entry_s else 50
            entries = [entry(s) for s in range(max(1, self.seq - held + 1), self.seq + 1)]
            cost = self.per_entry_s * len(entries) if self.per_entry_s else self.cost_s
            self.now += cost
            self.spent += cost
        status = {"0": {"last_enqueued_collective": str(self.seq), "last_completed_collective": str(self.done)}}
        return fake_dump(entries, status)

    def round(self, dt=0.2):
        self.now += dt
        self.seq += self.per_round
        self.done = self.seq


def fake_reader(monkeypatch, rec: FakeRecorder) -> FlightRecorderReader:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    r = FlightRecorderReader(clock=lambda: rec.now)
    r._fn = rec
    return r


@pytest.mark.parametrize("cost_s", [0.001, 0.03, 0.13])
def test_reader_reads_the_whole_buffer_within_its_duty_budget(monkeypatch, cost_s):
    """10 collectives per 0.2 s round: every round reads the cheap status; the
    whole buffer (30-130 ms at 2000 entries) at most once per max(1 s, cost /
    0.5%), so its share of the rank's time stays under 0.5% + one read."""
    from trainwatch.rank.flightrec import FULL_READ_DUTY, FULL_READ_MIN_S

    rec = FakeRecorder(cost_s)
    r = fake_reader(monkeypatch, rec)
    for _ in range(600):
        rec.round()
        groups = r.sample()
        assert groups[0].enqueued == rec.seq  # the sequence numbers are always current
    span = rec.now
    assert r.full_reads <= 1 + span / max(FULL_READ_MIN_S, cost_s / FULL_READ_DUTY)
    assert r.full_reads * cost_s / span <= FULL_READ_DUTY * 1.2 or r.full_reads * FULL_READ_MIN_S <= span + 1
    assert r.arrivals is None or r.arrivals[1]  # published when read, else left as they were


def test_reader_budgets_the_buffer_as_it_fills_not_as_it_was(monkeypatch):
    """1500 collectives a second fill the 2000-entry buffer within two seconds: a
    first read of a young buffer is cheap, the next of a full one is not. At no
    time may the reads have taken more than the duty budget plus that first read
    (the second read used to come after 1 s, at the young buffer's price)."""
    from trainwatch.rank.flightrec import FULL_READ_DUTY

    rec = FakeRecorder(0.0, per_round=300, per_entry_s=40e-6)
    r = fake_reader(monkeypatch, rec)
    first = None
    for _ in range(1500):  # 300 s
        rec.round()
        r.sample()
        first = rec.spent if first is None else first
        assert rec.spent <= FULL_READ_DUTY * rec.now * 1.02 + first, (rec.now, r.full_reads)
    assert r.full_reads >= 15  # still read about every 16 s (80 ms / 0.5%)


def test_reader_reads_nothing_more_while_no_collective_runs(monkeypatch):
    rec = FakeRecorder(0.05, per_round=0)
    rec.seq = rec.done = 5
    r = fake_reader(monkeypatch, rec)
    for _ in range(100):
        rec.round()
        r.sample()
    assert r.full_reads == 1


def test_reader_publishes_the_op_of_a_collective_the_rank_waits_in(monkeypatch):
    """The op is published only when read at the group's current sequence number;
    a rank parked in a collective for a second gets it read at once."""
    rec = FakeRecorder(0.1)
    r = fake_reader(monkeypatch, rec)
    for _ in range(30):
        rec.round()
        r.sample()
    rec.round()
    rec.done = rec.seq - 1  # parked in rec.seq from now on
    ops = []
    for _ in range(8):
        rec.now += 0.2
        ops.append(r.sample()[0].last_op)
    assert ops[-1] == "all_reduce" and ops[0] == ""


def test_reader_is_off_without_the_flight_recorder(monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    r = FlightRecorderReader()
    assert r.sample() is None and r.arrivals is None


def _gloo_rank(rank: int, world: int, path: str, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    reader = FlightRecorderReader()
    t = torch.ones(4)
    for _ in range(6):
        if rank == 1:
            time.sleep(0.1)  # rank 1 enters every all_reduce 0.1 s after rank 0
        dist.all_reduce(t)
    dist.barrier()
    reader.sample()
    out.put((rank, reader.arrivals))
    dist.destroy_process_group()


def test_real_gloo_ranks_publish_their_arrival_times(tmp_path):
    """Two real gloo ranks with the flight recorder on; rank 1 sleeps 0.1 s before
    each all_reduce: its published arrivals are 0.1 s after rank 0's at the same seq."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert got[0] is not None and got[1] is not None, got
    (src0, a0), (src1, a1) = got[0], got[1]
    assert src0 == src1 == ENQ
    common = sorted(set(dict(a0)) & set(dict(a1)))
    assert len(common) >= 6, (a0, a1)
    diffs = [(dict(a1)[s] - dict(a0)[s]) / 1e9 for s in common[:6]]
    assert all(0.07 < d < 0.3 for d in diffs), diffs


# ---- the detector: arrival order ------------------------------------------------------------------


def test_the_rank_every_collective_waits_for_is_the_straggler():
    det = StragglerDetector()
    found = run(det, ArrivalJob(4), 40, straggler_from(5))
    i, inc = found[0]
    assert inc.kind == "straggler" and inc.culprit_ranks == [2] and inc.victims == [0, 1, 3]
    assert inc.runbook == "straggler" and inc.severity == "medium"
    ev = inc.evidence
    assert ev["source"] == "collective_arrival" and ev["arrival_source"] == "enqueued"
    assert ev["lateness_s"][2] == pytest.approx(0.3, abs=0.01)
    assert ev["fraction_last"][2] >= 0.6 and ev["collectives_compared"][2] >= 5
    assert ev["z"][2] >= 3 and ev["slow_for_s"] >= 2.0
    assert "rank 2 enters collectives last, 0.29" in inc.summary or "last, 0.30" in inc.summary and "ranks 0,1,3 wait for it" in inc.summary
    # slow from its 6th step: 3 of 5 compared collectives late, then 5 evaluations over >= 2 s
    assert 10 <= i <= 14, i
    # one incident, reported on every tick from then on (the engine makes it one)
    assert all(inc.culprit_ranks == [2] for _, inc in found) and len(found) == 40 - i


def test_a_two_rank_job_and_the_compute_ratio_in_the_evidence():
    det = StragglerDetector()
    job = ArrivalJob(2, startup=0)
    found = run(det, job, 40, lambda i: np.array([0.0, 0.25 if i >= 8 else 0.0]), compute=np.array([0.05, 0.3]))
    assert found and all(inc.culprit_ranks == [1] for _, inc in found)
    inc = next(inc for _, inc in found if inc.evidence["source"] == "collective_arrival")
    assert inc.culprit_ranks == [1] and inc.victims == [0]
    # the compute path's ratio of the same rank, quoted where known (the gauge's value)
    assert inc.evidence["slowdown_ratio"] == pytest.approx(6.0, rel=0.01) == det.current_ratios()[1]


def test_jitter_does_not_make_a_straggler():
    det = StragglerDetector()
    rng = np.random.default_rng(3)

    def by_turns(i):
        # the scheduler favours ranks by turns: one rank 60-120 ms late for 6 steps at a time
        late = rng.normal(0, 0.03, 4)
        late[(i // 6) % 4] += rng.uniform(0.06, 0.12)
        return late

    assert run(det, ArrivalJob(4), 120, by_turns, jitter=0.03) == []
    # +60 ms each collective: a straggler on a quiet node, not under +-30 ms of jitter
    slow = lambda i: np.where(np.arange(4) == 1, 0.06 if i >= 8 else 0.0, 0.0)
    assert run(StragglerDetector(), ArrivalJob(4, seed=1), 60, slow, jitter=0.04) == []
    found = run(StragglerDetector(), ArrivalJob(4, seed=1), 60, slow, jitter=0.002)
    assert found and found[0][1].culprit_ranks == [1]


def test_small_lateness_is_noise():
    slow = lambda i: np.where(np.arange(4) == 3, 0.03, 0.0)  # 30 ms, always last
    assert run(StragglerDetector(), ArrivalJob(4), 60, slow, jitter=0.0005) == []


def test_straggler_must_persist():
    blip = lambda i: np.where(np.arange(4) == 2, 0.5, 0.0) if 10 <= i < 14 else None
    assert run(StragglerDetector(), ArrivalJob(4), 60, blip) == []
    # fast steps: five slow evaluations in a row are not enough before persist_s (2 s)
    det = StragglerDetector()
    found = run(det, ArrivalJob(4, step_s=0.05), 80, straggler_from(5, delay=0.1))
    i, inc = found[0]
    assert inc.culprit_ranks == [2] and inc.evidence["slow_for_s"] >= 2.0
    fast = run(StragglerDetector(StragglerConfig(persist_s=0.0)), ArrivalJob(4, step_s=0.05), 80,
               straggler_from(5, delay=0.1))
    assert fast[0][0] < i


def test_start_up_collectives_are_not_compared():
    # rank 1 reached the 8 start-up collectives 2 s late (loading its data); with
    # one collective per 10 s step they would fill the window for a minute
    det = StragglerDetector()
    assert run(det, ArrivalJob(4, step_s=10.0, startup=8), 30) == []
    assert det._arrival.active


def test_a_restarted_rank_starts_over():
    det = StragglerDetector()
    job = ArrivalJob(4)
    found = run(det, job, 80, straggler_from(8))
    assert found and found[-1][1].culprit_ranks == [2]
    # the job restarts from a checkpoint: new processes, step 10, a new process group
    job.table["pid"] += 100
    job.table["step"] = 10
    job.table["restart"] = 1
    job.seq = 0
    job.found = [{} for _ in range(4)]
    job.rings = [ArrivalRing() for _ in range(4)]
    for _ in range(3):
        job._collective(np.zeros(4), 0.0)
    # nothing is carried over: the new rank 2 is healthy, and the new rank 1 is found on its own
    assert run(det, job, 20) == []
    found = run(det, job, 40, straggler_from(8, rank=1))
    assert found and {inc.culprit_ranks[0] for _, inc in found} == {1}


def test_a_new_process_group_in_the_same_process_starts_over():
    det = StragglerDetector()
    job = ArrivalJob(4)
    assert run(det, job, 8, straggler_from(0)) == []  # slow, not yet for long enough
    job.seq = 0  # destroy_process_group + init_process_group: numbers start over
    job.found = [{} for _ in range(4)]
    assert run(det, job, 20) == []
    found = run(det, job, 30, straggler_from(0, rank=3))
    assert found and {inc.culprit_ranks[0] for _, inc in found} == {3}


def test_only_ranks_of_the_same_arrival_source_are_compared():
    det = StragglerDetector()
    job = ArrivalJob(5)
    # rank 4 reports device start times, which come after the enqueue times of its peers
    job.sources[4] = STARTED
    job.offset[4] = 0.5
    found = run(det, job, 40, straggler_from(5, n=5))
    inc = found[0][1]
    assert inc.culprit_ranks == [2] and inc.victims == [0, 1, 3]
    assert inc.evidence["arrival_source"] == "enqueued"
    # the majority decides: three ranks on device times, two enqueuing
    det = StragglerDetector()
    job = ArrivalJob(5)
    job.sources[:3] = STARTED
    job.offset[3:] = -0.4
    assert run(det, job, 40) == []


def test_ranks_publishing_at_different_strides_still_meet():
    det = StragglerDetector()
    job = ArrivalJob(4, colls=6)
    found = []
    for i in range(60):
        # ranks 0 and 2 publish every step (6 new: every seq), 1 and 3 every 4th (24 new: every 4th seq)
        v = job.step(straggler_from(5)(i), publish=[0, 2] + ([1, 3] if i % 4 == 0 else []))
        found += det.check(v)
    assert found and found[0].culprit_ranks == [2] and found[0].victims == [0, 1, 3]
    assert all(s % 4 == 0 for s in job.table["arrivals"]["seq"][1] if s)


def test_arrivals_take_precedence_over_compute_time():
    # compute time blames rank 1 (its DataLoader wait is counted as compute), the
    # arrivals show rank 1 is not late: nobody is a straggler
    compute = np.array([0.1, 0.4, 0.1, 0.1])
    det = StragglerDetector()
    assert run(det, ArrivalJob(4), 40, compute=compute) == []
    assert det.current_ratios()[1] == pytest.approx(4.0)  # the gauge still reads compute time
    # without arrivals (flight recorder off) the compute path speaks
    det = StragglerDetector()
    found = run(det, ArrivalJob(4), 40, compute=compute, publish=[])
    assert found and found[0][1].culprit_ranks == [1] and found[0][1].evidence["source"] == "compute"
    # or with the arrival evidence turned off
    det = StragglerDetector(StragglerConfig(arrivals=False))
    assert run(det, ArrivalJob(4), 40, compute=compute)[0][1].evidence["source"] == "compute"


def test_one_incident_when_both_evidences_name_the_same_rank():
    from trainwatch.watchdog.engine import DetectorEngine

    det = StragglerDetector()
    job = ArrivalJob(4)
    compute = np.array([0.1, 0.1, 0.4, 0.1])
    per_tick = [det.check(job.step(straggler_from(8)(i), compute=compute)) for i in range(40)]
    assert all(len(got) <= 1 for got in per_tick)
    reported = [got[0] for got in per_tick if got]
    assert reported and all(inc.culprit_ranks == [2] for inc in reported)
    # the arrivals judge the ranks: theirs is the evidence, reported on every tick from the first
    first = next(i for i, got in enumerate(per_tick) if got)
    assert all(per_tick[first:]) and {inc.evidence["source"] for inc in reported} == {"collective_arrival"}
    # through the engine: one incident
    job, engine, emitted = ArrivalJob(4), DetectorEngine([StragglerDetector()]), []
    for i in range(40):
        emitted += engine.tick(job.step(straggler_from(8)(i), compute=compute))
    assert [inc.culprit_ranks for inc in emitted] == [[2]]


def test_a_compute_incident_reported_before_the_arrivals_start_is_kept_until_they_confirm_it():
    from trainwatch.watchdog.engine import DetectorEngine

    def ticks():
        job = ArrivalJob(4)
        compute = np.array([0.1, 0.1, 0.4, 0.1])
        for i in range(50):
            # no arrivals published for the first 20 steps (the flight recorder came up late)
            yield job.step(straggler_from(0)(i), compute=compute, publish=[] if i < 20 else None)

    det = StragglerDetector()
    sources = [(got[0].evidence["source"] if got else None) for got in map(det.check, ticks())]
    first = next(i for i, src in enumerate(sources) if src)
    # compute time named it first; no gap while the arrivals build up. The arrivals
    # never saw it on time (no baseline of its own to fall behind), so they neither
    # clear it nor claim it: compute time keeps it.
    assert sources[first] == "compute" and None not in sources[first:], sources
    engine = DetectorEngine([StragglerDetector()])
    assert [inc.culprit_ranks for v in ticks() for inc in engine.tick(v)] == [[2]]


def test_arrivals_clear_a_compute_culprit_they_see_on_time():
    # a rank whose compute time looks slow while it reaches every collective on time
    # (its wait is spent outside the wait phases): compute names it, arrivals clear it
    det = StragglerDetector()
    compute = np.array([0.1, 0.1, 0.1, 0.6])
    found = run(det, ArrivalJob(4, startup=0), 40, compute=compute)
    assert found == [] and det.current_ratios()[3] == pytest.approx(6.0)


def test_ranks_without_arrivals_are_still_judged_on_compute_time():
    # ranks 0-3 publish arrivals; ranks 4-7 (say, another node's older sampler) do not
    det = StragglerDetector()
    compute = np.full(8, 0.1)
    compute[6] = 0.5
    found = run(det, ArrivalJob(8), 40, compute=compute, publish=[0, 1, 2, 3])
    assert found and found[0][1].culprit_ranks == [6] and found[0][1].evidence["source"] == "compute"


def test_straggler_config_validates_the_arrival_fields():
    from trainwatch.watchdog.config import SidecarConfig, launch_flags
    from trainwatch.watchdog.detectorconfig import DetectorsConfig

    # The ranges are one table checked on the whole config (watchdog.config.RANGES).
    with pytest.raises(ValueError, match="arrival-last-fraction"):
        SidecarConfig(detectors=DetectorsConfig(straggler=StragglerConfig(arrival_last_fraction=1.5)))
    with pytest.raises(ValueError, match="arrival-window"):
        SidecarConfig(detectors=DetectorsConfig(straggler=StragglerConfig(arrival_window=0)))

    options = {f.option: f for f in launch_flags()}
    for flag in ("--straggler-arrival-min-lateness-s", "--straggler-arrival-last-fraction",
                 "--straggler-arrival-window", "--no-straggler-arrivals"):
        assert flag in options and options[flag].help


def test_arrival_table_reads_only_entries_of_the_asked_sequence_number():
    table = ArrivalTable()
    assert len(set(table.column(np.array([8, 16, 24, 32])).tolist())) == 4
    ranks = np.array([0, 0, 1, 5])
    table.put(ranks, np.array([8, 16, 8, 24]), np.array([1.0, 2.0, 3.0, 4.0]))
    m = table.matrix(np.array([0, 1, 5, 7]), np.array([8, 16, 24, 32]))
    assert np.array_equal(np.isnan(m), [[False, False, True, True], [False, True, True, True],
                                        [True, True, False, True], [True, True, True, True]])
    assert m[0, 1] == 2.0 and m[2, 2] == 4.0
    table.reset(np.array([0]))
    assert np.isnan(table.matrix(np.array([0]), np.array([8, 16]))).all()


# ---- at scale, and hostile slot contents ----------------------------------------------------------


def big_job_ticks(n: int, ticks: int, culprit: int):
    """Ticks of an n-rank job: every rank publishes its last 16 collectives
    (3 per step) each tick; `culprit` arrives 0.2 s late."""
    rng = np.random.default_rng(0)
    t = make_table(n, now=0.0, step=1)
    out = []
    for k in range(ticks):
        step = 2 + k
        t["step"] = step
        t["progress_mono"] = t["heartbeat_mono"] = 0.3 * step
        seq = 3 * step - np.arange(16)[::-1][None, :]
        t["arrival_source"] = ENQ
        t["narrivals"] = 16
        t["arrivals"]["seq"] = seq
        # on time for its first steps (its own baseline), then 0.2 s late
        late = np.where((np.arange(n) == culprit) & (k >= 8), 0.2, 0.0)[:, None] + rng.normal(0, 0.002, (n, 16))
        t["arrivals"]["t_ns"] = EPOCH_NS + ((seq * 0.1 + late) * 1e9).astype(np.int64)
        out.append(view(t, 0.3 * step))
    return out


def test_thousands_of_ranks_one_straggler_in_milliseconds():
    det = StragglerDetector()
    ticks = big_job_ticks(4096, 50, culprit=4000)
    times, found = [], []
    for v in ticks:
        start = time.perf_counter()
        found += det.check(v)
        times.append(time.perf_counter() - start)
    assert found and found[0].culprit_ranks == [4000] and len(found[0].victims) == 4095
    # vectorised: a Python loop over the ranks would take far longer (generous for loaded machines)
    assert statistics.median(times) < 0.1, statistics.median(times)


ints64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds=st.lists(st.tuples(
    st.lists(st.tuples(ints64, ints64), min_size=4 * slots.ARRIVALS, max_size=4 * slots.ARRIVALS),
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=4, max_size=4),
    st.lists(st.sampled_from([0, 1, 2, 3]), min_size=4, max_size=4),
    st.lists(st.integers(0, 3), min_size=4, max_size=4),
), min_size=1, max_size=6))
def test_any_arrival_slot_contents_never_break_the_detector(rounds):
    det = StragglerDetector(StragglerConfig(persist=1, persist_s=0.0, arrival_min_collectives=1))
    t = make_table(4, step=3)
    for i, (entries, sources, steps, pids) in enumerate(rounds):
        arr = np.array(entries, dtype=np.int64).reshape(4, slots.ARRIVALS, 2)
        t["arrivals"]["seq"] = arr[..., 0]
        t["arrivals"]["t_ns"] = arr[..., 1]
        t["arrival_source"] = sources
        t["narrivals"] = sources
        t["step"] = steps
        t["pid"] = 1000 + np.array(pids)
        for inc in det.check(view(t, 100.0 + i)):
            assert inc.kind == "straggler" and inc.culprit_ranks
            json.dumps(inc.to_json())
    det.current_ratios()



# ---- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fr_buffer, source", [("2000", "collective_arrival"), ("0", "compute")],
                         ids=["flight-recorder", "flight-recorder-off"])
def test_zero_code_straggler_in_an_unmodified_ddp_script(tmp_path, fr_buffer, source):
    """4 real gloo ranks of an unmodified DDP script (no trainwatch import); rank 2
    sleeps 0.3 s before every batch from step 30 (after the healthy steps that set
    each rank's own arrival baseline). With the flight recorder (on by
    default) the arrivals name it; with TORCH_FR_BUFFER_SIZE=0 the zero-code
    compute time (step time less backward, where DDP's all-reduce waits) does."""
    job = f"zc-straggler-{uuid.uuid4().hex[:6]}"
    proc = start(tmp_path, "launch", "--nproc-per-node", "4", "--job", job, "--no-restart",
                 "--inject", "straggler:delay=0.3,rank=2,step=30", str(SCRIPTS / "plain_ddp.py"), "--steps", "100000",
                 TORCH_FR_BUFFER_SIZE=fr_buffer)
    try:
        def found():
            if proc.poll() is not None:
                raise AssertionError(f"launch exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
            return [e for e in events(tmp_path, job) if e.kind == "straggler"]

        incident = wait_for(found, 120, interval=0.25, what="a straggler incident")[0]
    finally:
        stop_group(proc)
        reap(tmp_path)
    assert incident.culprit_ranks == [2] and incident.victims == [0, 1, 3], incident
    ev = incident.evidence
    assert ev["source"] == source, ev
    if source == "collective_arrival":
        assert ev["arrival_source"] == "enqueued"  # gloo: enqueue times
        assert ev["lateness_s"]["2"] == pytest.approx(0.3, abs=0.1)
        assert ev["fraction_last"]["2"] >= 0.6 and ev["collectives_compared"]["2"] >= 5
    fired = json.loads((tmp_path / "jobs" / job / "control" / "faults.jsonl").read_text().splitlines()[0])
    assert 0 < incident.detected_mono - fired["mono"] < 15
    assert not [e for e in events(tmp_path, job) if e.kind == "straggler" and e.culprit_ranks != [2]]


def test_a_rank_last_by_role_is_no_straggler_until_it_falls_behind_its_own_baseline():
    """A two-stage pipeline's first stage reaches the end-of-step broadcast last,
    0.2 s after its peers, from its first step on: that is its role. The same rank
    slowing by another 0.3 s is a straggler."""
    role = lambda i: np.where(np.arange(4) == 0, 0.2, 0.0)  # noqa: E731
    det = StragglerDetector()
    assert run(det, ArrivalJob(4), 80, role) == []
    assert det._arrival.active
    slower = lambda i: np.where(np.arange(4) == 0, 0.5 if i >= 20 else 0.2, 0.0)  # noqa: E731
    found = run(StragglerDetector(), ArrivalJob(4), 60, slower)
    assert found and found[0][1].culprit_ranks == [0]
    assert found[0][1].evidence["baseline_lateness_s"][0] == pytest.approx(0.2, abs=0.02)


def test_a_rank_slow_from_its_first_step_is_named_by_its_compute_time():
    """A bad GPU is slow from the first step: the arrivals never saw it on time,
    so their own-baseline rule takes its lateness for a role and stays silent.
    Its compute time, 3x its peers' at every step, names it, and the arrivals,
    which see it late, do not clear it."""
    compute = np.array([0.1, 0.3, 0.1, 0.1])
    slow = straggler_from(0, rank=1, delay=0.2)
    found = run(StragglerDetector(), ArrivalJob(4, startup=0), 40, slow, compute=compute)
    assert found and {tuple(inc.culprit_ranks) for _, inc in found} == {(1,)}
    assert found[0][1].evidence["source"] == "compute" and found[0][0] <= 15
    # A role that computes like its peers is still no straggler.
    assert run(StragglerDetector(), ArrivalJob(4, startup=0), 40, slow, compute=np.full(4, 0.1)) == []
