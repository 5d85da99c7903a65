"""Learnt hang thresholds: per-phase lengths learnt from the slots, used once a
phase was seen ending often enough, never below the floor, never for a rank
that visibly works, and kept in the job directory for the next sidecar.
Time is injected; nothing sleeps."""

from __future__ import annotations

import io
import json
import logging
import os

import numpy as np
import pytest
from slot_tables import SyncJob, make_table, set_rows

from trainwatch import slots, state
from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.watchdog import thresholds
from trainwatch.watchdog.detectors import HangConfig, HangDetector
from trainwatch.watchdog.detectors.base import PhaseLearner
from trainwatch.watchdog.sidecar import Sidecar


def steps_with_checkpoints(det: HangDetector, job: SyncJob, n: int, *, ckpt_s: float = 1.0) -> None:
    """`n` steps, each followed by a `ckpt_s` checkpoint phase (all ranks, nobody waits)."""
    for _ in range(n):
        assert det.check(job.step(dt=1.0)) == []
        set_rows(job.table, list(job.table["rank"]), phase="checkpoint", phase_mono=job.now + 0.01)
        assert det.check(job.at(job.now + ckpt_s / 2)) == []
        # the next step starts (phase data) once the checkpoint is written
        set_rows(job.table, list(job.table["rank"]), phase="data", phase_mono=job.now + 0.01 + ckpt_s)
        assert det.check(job.at(job.now + 0.01 + ckpt_s + 0.05)) == []


def stuck_in_checkpoint(job: SyncJob) -> float:
    """Every rank enters a checkpoint that never ends; returns when it began."""
    job.step(dt=1.0)
    t0 = job.now + 0.01
    set_rows(job.table, list(job.table["rank"]), phase="checkpoint", phase_mono=t0)
    return t0


def first_incident(det: HangDetector, job: SyncJob, t0: float, until_s: float, dt: float = 0.1):
    for k in range(1, int(until_s / dt) + 1):
        found = det.check(job.at(t0 + k * dt))
        if found:
            return k * dt, found[0]
    return None, None


# ---- the benefit ---------------------------------------------------------------------------


def test_a_stuck_1s_checkpoint_is_caught_at_the_floor_not_after_60s():
    det = HangDetector()
    job = SyncJob(4)
    steps_with_checkpoints(det, job, 12)
    assert det.phases.learnt()["checkpoint"][0] == pytest.approx(1.0, abs=0.02)
    t0 = stuck_in_checkpoint(job)
    when, inc = first_incident(det, job, t0, 70.0)
    assert when == pytest.approx(5.0, abs=0.15)  # max(floor 5 s, 3 x 1 s), not the 60 s allowance
    assert inc.category == "checkpoint_io" and inc.culprit_ranks == [0, 1, 2, 3]
    assert inc.evidence["culprits"][0]["threshold_learnt"] is True
    assert inc.evidence["culprits"][0]["threshold_s"] == pytest.approx(5.0, abs=0.02)


def test_a_lower_floor_leaves_factor_times_the_learnt_length():
    det = HangDetector(HangConfig(floor_s=2.0))
    job = SyncJob(2)
    steps_with_checkpoints(det, job, 12)
    t0 = stuck_in_checkpoint(job)
    when, _ = first_incident(det, job, t0, 70.0, dt=0.05)
    assert when == pytest.approx(3.0, abs=0.1)  # 3 x the learnt 1 s
    det2 = HangDetector(HangConfig(floor_s=2.0, phase_factor=5.0))
    job2 = SyncJob(2)
    steps_with_checkpoints(det2, job2, 12)
    when, _ = first_incident(det2, job2, stuck_in_checkpoint(job2), 70.0, dt=0.05)
    assert when == pytest.approx(5.0, abs=0.1)


def test_a_stuck_eval_is_caught_at_the_floor():
    det = HangDetector()
    job = SyncJob(2)
    ranks = [0, 1]
    for _ in range(12):  # a step, then a 2 s eval pass of 0.1 s batches
        det.check(job.step(dt=1.0))
        t_eval = job.now + 0.01
        set_rows(job.table, ranks, phase="eval", phase_mono=t_eval)
        for k in range(1, 20):
            set_rows(job.table, ranks, active_mono=t_eval + k * 0.1)
            assert det.check(job.at(t_eval + k * 0.1 + 0.05)) == []
        set_rows(job.table, ranks, phase="compute", phase_mono=t_eval + 2.0)
        assert det.check(job.at(t_eval + 2.05)) == []
    job.step(dt=1.0)
    t0 = job.now + 0.01
    set_rows(job.table, ranks, phase="eval", phase_mono=t0, active_mono=t0 + 0.5)  # one batch, then nothing
    when, inc = first_incident(det, job, t0, 70.0)
    assert when == pytest.approx(0.5 + 6.0, abs=0.15)  # 3 x the learnt 2 s from its last batch, not 60 s
    assert inc.evidence["culprits"][0]["phase"] == "eval"


def test_a_long_step_job_names_a_data_stall_in_seconds():
    """10 s steps: k x p99 = 50 s; a data phase learnt at 0.2 s (opted in) is stuck after the floor."""
    det = HangDetector(HangConfig(learn_phases=("data", "checkpoint", "eval")))
    job = SyncJob(4, step_s=10.0)
    for i in range(15):
        det.check(job.step())
        set_rows(job.table, [0, 1, 2, 3], phase="forward", phase_mono=job.now + 0.2)
        det.check(job.at(job.now + 0.3))
        set_rows(job.table, [0, 1, 2, 3], phase="backward", phase_mono=job.now + 6.0)
        found = det.check(job.at(job.now + 6.1))
        assert i < 2 or found == []  # until two step times are known, the floor holds the backward wait
    assert det.phases.learnt()["data"][0] == pytest.approx(0.2)
    job.step()
    t0 = job.now
    set_rows(job.table, 1, phase="data", phase_mono=t0 + 0.01)
    set_rows(job.table, [0, 2, 3], phase="backward", phase_mono=t0 + 0.3)
    when, inc = first_incident(det, job, t0, 60.0)
    assert when == pytest.approx(5.0, abs=0.15)
    assert inc.culprit_ranks == [1] and inc.category == "dataloader"


# ---- no false alarms -------------------------------------------------------------------------


def test_a_cold_job_keeps_the_fixed_allowance():
    det = HangDetector()
    job = SyncJob(4)
    steps_with_checkpoints(det, job, 9)  # one short of phase_min_samples
    t0 = stuck_in_checkpoint(job)
    for dt in range(1, 31):
        assert det.check(job.at(t0 + dt)) == []
    assert len(det.check(job.at(t0 + 61))) == 1


def test_a_rank_working_through_a_longer_checkpoint_is_honest_and_learnt():
    det = HangDetector()
    job = SyncJob(2)
    steps_with_checkpoints(det, job, 12)
    t0 = stuck_in_checkpoint(job)
    for k in range(1, 151):  # 30 s of checkpoint I/O: far past 3 x the learnt 1 s
        now = t0 + k * 0.2
        set_rows(job.table, [0, 1], cpu_s=k * 0.02, io_bytes=k * 10_000_000)
        assert det.check(job.at(now)) == [], now - t0
    set_rows(job.table, [0, 1], phase="data", phase_mono=t0 + 30.0)
    det.check(job.at(t0 + 30.05))
    assert det.phases.learnt()["checkpoint"][0] > 25.0  # the long one ended: the next one is allowed as much


def test_learnt_thresholds_never_go_below_the_floor_nor_above_the_fixed_allowance():
    det = HangDetector()
    job = SyncJob(2)
    steps_with_checkpoints(det, job, 12, ckpt_s=0.05)
    limits = det.phases.limits(5.0, 3.0)
    assert limits[slots.PHASE_CODES["checkpoint"]] == 5.0
    assert np.isinf(limits[slots.PHASE_CODES["backward"]]) and np.isinf(limits[slots.PHASE_CODES["init"]])
    # a phase learnt longer than its fixed allowance leaves the allowance in force
    det = HangDetector()
    det.phases.seed({"checkpoint": (40.0, 50)})
    job = SyncJob(2)
    for _ in range(5):
        det.check(job.step())
    t0 = stuck_in_checkpoint(job)
    assert det.check(job.at(t0 + 59.0)) == []
    assert len(det.check(job.at(t0 + 61.0))) == 1


def test_learning_can_be_switched_off():
    det = HangDetector(HangConfig(learn_phases=()))
    job = SyncJob(2)
    steps_with_checkpoints(det, job, 12)
    assert det.phases.learnt() == {}
    t0 = stuck_in_checkpoint(job)
    assert det.check(job.at(t0 + 30.0)) == []


# ---- the learner -----------------------------------------------------------------------------


def test_learner_records_a_phase_when_it_ends_and_only_then():
    learner = PhaseLearner(("data", "checkpoint"), 8, min_samples=1)
    t = make_table(2, now=10.0, phase="data")
    learner.update(t)
    set_rows(t, 0, phase="checkpoint", phase_mono=10.5)
    learner.update(t)
    assert learner.learnt() == {"data": (pytest.approx(0.5), 1)}
    # the same phase whose start jitters (the aggregator rebases every summary) is the same stretch
    set_rows(t, 0, phase_mono=10.8)
    learner.update(t)
    set_rows(t, 0, phase_mono=10.3)
    learner.update(t)
    # a restarted process (new pid) starts no duration across the restart
    set_rows(t, 0, pid=5000, phase="data", phase_mono=20.0)
    learner.update(t)
    assert "checkpoint" not in learner.learnt()
    # re-entering the same phase well after its start ends the first stretch
    set_rows(t, 1, phase_mono=14.0)
    learner.update(t)
    set_rows(t, 1, phase_mono=15.5)
    learner.update(t)
    # the longest of every rank's p99, with the most samples one rank has
    assert learner.learnt()["data"] == (pytest.approx(0.99 * 4.0 + 0.01 * 1.5), 2)
    assert np.isinf(learner.limits(1.0, 3.0)[slots.PHASE_CODES["checkpoint"]])
    assert learner.limits(1.0, 3.0)[slots.PHASE_CODES["data"]] == pytest.approx(3 * 3.975)


def test_learnt_value_is_the_highest_rank_quantile():
    learner = PhaseLearner(("checkpoint",), 64, min_samples=1)
    t = make_table(3, now=1.0, phase="checkpoint")
    learner.update(t)
    # ranks 0 and 1 write their shard in 1 s, rank 2 (more state) in 4 s
    set_rows(t, [0, 1], phase="data", phase_mono=2.0)
    set_rows(t, 2, phase="data", phase_mono=5.0)
    learner.update(t)
    assert learner.learnt() == {"checkpoint": (pytest.approx(4.0), 1)}


def test_seeded_values_count_until_live_ones_suffice():
    learner = PhaseLearner(("checkpoint",), 64, min_samples=3)
    learner.seed({"checkpoint": (2.0, 20), "backward": (1.0, 20)})
    assert learner.learnt() == {"checkpoint": (2.0, 20)}
    t = make_table(1, now=1.0, phase="checkpoint")
    learner.update(t)
    for i, end in enumerate((1.5, 3.0, 4.5)):  # three 0.5 s checkpoints
        set_rows(t, 0, phase="data", phase_mono=end)
        learner.update(t)
        if i < 2:
            assert learner.learnt()["checkpoint"] == (2.0, 21 + i)  # the longer of both, both counted
        set_rows(t, 0, phase="checkpoint", phase_mono=end + 1.0)
        learner.update(t)
    assert learner.learnt()["checkpoint"] == (pytest.approx(0.5), 3)


# ---- kept in the job directory -----------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_thresholds_round_trip_and_seed_a_cold_detector(home):
    d = state.JobDir("j").create()
    det = HangDetector()
    job = SyncJob(2)
    steps_with_checkpoints(det, job, 12)
    clock = [100.0]
    saver = thresholds.Persisted(d.thresholds_file, [det], lambda: clock[0])
    assert saver.maybe_save() is True and saver.maybe_save() is False
    saved = json.loads(d.thresholds_file.read_text())
    assert saved["version"] == 1 and saved["phases"]["checkpoint"]["samples"] == 12
    # a new sidecar of the job: nothing observed yet, the checkpoint threshold is the learnt one
    fresh = HangDetector()
    loaded = thresholds.Persisted(d.thresholds_file, [fresh])
    assert loaded.describe()["checkpoint"]["threshold_s"] == 5.0
    job2 = SyncJob(2)
    for _ in range(3):
        fresh.check(job2.step())
    when, _ = first_incident(fresh, job2, stuck_in_checkpoint(job2), 70.0)
    assert when == pytest.approx(5.0, abs=0.15)


@pytest.mark.parametrize("data", [b"", b"\xff\xfe garbage", b"[1, 2]", b'{"version": 2, "phases": {}}',
                                  b'{"version": true, "phases": {"checkpoint": {"p99_s": 1, "samples": 3}}}',
                                  b"[" * 100_000, b'{"version": 1, "phases": []}'])
def test_a_corrupt_thresholds_file_is_a_logged_skip(home, caplog, data):
    d = state.JobDir("j").create()
    d.thresholds_file.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="trainwatch.thresholds"):
        assert thresholds.read(d.thresholds_file) == {}
    assert "learnt hang thresholds skipped" in caplog.text


def test_bad_entries_are_skipped_and_good_ones_kept(home, caplog):
    d = state.JobDir("j").create()
    d.thresholds_file.write_text(json.dumps({"version": 1, "phases": {
        "checkpoint": {"p99_s": 1.5, "samples": 12}, "backward": {"p99_s": 1.0, "samples": 12},
        "eval": {"p99_s": -1, "samples": 12}, "data": {"p99_s": 0.1, "samples": True}, "forward": [1]}}))
    with caplog.at_level(logging.WARNING, logger="trainwatch.thresholds"):
        assert thresholds.read(d.thresholds_file) == {"checkpoint": (1.5, 12)}
    assert "4 entries" in caplog.text


def test_the_sidecar_keeps_what_it_learnt_for_the_next_one(home, tmp_path):
    class Clock:
        t = 1000.0

        def __call__(self):
            return self.t

    d = state.JobDir("sc").create()
    d.thresholds_file.write_bytes(b"\x00not json")  # an earlier, corrupt file: skipped, never fatal
    seg = str(tmp_path / "seg")
    slots.create_segment(seg, 2)
    clock = Clock()
    sc = Sidecar("sc", seg, node="n0", clock=clock, out=io.StringIO())
    assert sc.thresholds.learnt() == {}
    ws = [SlotWriter(slots.Segment(seg), i, pid=os.getpid(), rank=i, world_size=2, restart=0) for i in range(2)]
    data, ckpt = slots.PHASE_CODES["data"], slots.PHASE_CODES["checkpoint"]
    for step in range(1, 14):  # 1 s steps, each followed by a 1 s checkpoint
        clock.t += 1.0
        for w in ws:
            w.write_step(step, 2.0, 1.0, 1.0, 0.5, clock.t, 0.0, ckpt, clock.t, step)
            w.write_sampler(clock.t, True, step, [slots.CollectiveGroup(0, step, step, "allreduce")])
        assert sc.tick() == []
        clock.t += 1.0
        for w in ws:
            w.write_phase(data, slots.STEP_REPORTED, clock.t, step)
            w.write_sampler(clock.t, True, step, [slots.CollectiveGroup(0, step, step, "allreduce")])
        assert sc.tick() == []
    sc.write_snapshot()
    assert json.loads(d.telemetry_file.read_text())["hang_thresholds"]["checkpoint"]["threshold_s"] == 5.0
    assert thresholds.read(d.thresholds_file)["checkpoint"][0] == pytest.approx(1.0)
    # the next sidecar of the job starts from it
    again = Sidecar("sc", seg, node="n0", clock=clock, out=io.StringIO())
    assert again.thresholds.describe()["checkpoint"] == {"p99_s": 1.0, "samples": 13, "threshold_s": 5.0}
