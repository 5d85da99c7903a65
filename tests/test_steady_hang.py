"""A steady job's own hang threshold (trainwatch.watchdog.detectors.steady):
a 100 ms-step job is called hung within 2 s, while cold, irregular, busy or
fetching ranks keep the conservative floor. Synthetic slot tables, injected
clock."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slot_tables import SyncJob, set_rows
from trainwatch.state import JobDir
from trainwatch.watchdog import thresholds
from trainwatch.watchdog.detectors import HangConfig, HangDetector


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def steps(det, job, n, **kw) -> list:
    out = []
    for _ in range(n):
        out += det.check(job.step(**kw))
        out += det.check(job.at(job.now + job.step_s / 2))
    return out


def stall(det, job, *, culprit=1, phase="forward", until=6.0, every=0.1) -> tuple[float, object]:
    """Rank `culprit` stops in `phase`, the others wait in a collective; ticks
    every `every` s: (seconds to the incident, the incident) or (None, None)."""
    others = [int(r) for r in job.table["rank"] if r != culprit]
    set_rows(job.table, culprit, phase=phase)
    set_rows(job.table, others, phase="collective")
    t0 = float(job.table["progress_mono"].max())
    for k in range(1, int(until / every) + 1):
        found = det.check(job.at(t0 + k * every))
        if found:
            return round(k * every, 3), found[0]
    return None, None


def test_a_steady_100ms_job_is_called_hung_within_2s_naming_the_still_rank():
    det = HangDetector()
    job = SyncJob(4, step_s=0.1)
    assert steps(det, job, 40) == []
    latency, inc = stall(det, job)
    assert 1.5 <= latency <= 1.7
    assert inc.culprit_ranks == [1] and inc.victims == [0, 2, 3]
    assert inc.evidence["culprits"][1]["threshold_steady"] is True
    assert inc.evidence["threshold_s"] == pytest.approx(1.5)
    assert det.thresholds_in_force(job.table["rank"])["steady_s"] == pytest.approx(1.5)


def test_steps_are_counted_not_ticks():
    """Steps of 60 ms against a 150 ms tick: each tick sees two or three steps
    and the history holds one time per tick. 45 steps are 45 steps."""
    det = HangDetector()
    job = SyncJob(4, step_s=0.06)
    for _ in range(15):
        view = None
        for _ in range(3):
            view = job.step()
        assert det.check(view) == []
    assert int(det._step_s.counts(job.table["rank"]).min()) < 20
    latency, inc = stall(det, job)
    assert 1.5 <= latency <= 1.7 and inc.culprit_ranks == [1]


def test_a_cold_job_keeps_the_floor():
    """Fewer than steady_min_steps steps on every rank: the fixed 5 s floor."""
    det = HangDetector()
    job = SyncJob(4, step_s=0.1)
    steps(det, job, 10)
    latency, _ = stall(det, job)
    assert latency is not None and latency > 4.9


@pytest.mark.parametrize("longest_s,expect", [(0.6, (1.5, 1.7)), (0.9, (1.8, 2.0)), (3.0, (4.9, 5.2))],
                         ids=["short", "one-slower-step", "irregular"])
def test_the_longest_step_the_job_ever_made_bounds_the_threshold(longest_s, expect):
    """Twice the longest training step is the least threshold; a job that once
    took a 3 s step is irregular and keeps the floor, for good."""
    det = HangDetector()
    job = SyncJob(4, step_s=0.1)
    steps(det, job, 10)
    det.check(job.step(dt=longest_s))
    steps(det, job, 60)  # long out of the 50-step p99 window
    latency, _ = stall(det, job)
    assert expect[0] <= latency <= expect[1]


def test_a_still_rank_nobody_waits_on_keeps_the_floor():
    """Every rank still outside a collective (a pause of the whole job, a
    DataLoader restart): nobody waits on anybody, so the floor holds."""
    det = HangDetector()
    job = SyncJob(2, step_s=0.1)
    steps(det, job, 40)
    set_rows(job.table, [0, 1], phase="forward")
    t0 = job.now
    assert det.check(job.at(t0 + 3.0)) == []


@pytest.mark.parametrize("phase", ["data", "checkpoint", "eval", "init"])
def test_a_fetch_or_slow_phase_keeps_its_allowance(phase):
    det = HangDetector()
    job = SyncJob(2, step_s=0.1)
    steps(det, job, 40)
    latency, _ = stall(det, job, phase=phase, until=4.0)
    assert latency is None


def test_a_rank_writing_keeps_the_floor():
    """I/O moving (a checkpoint written without a phase marker): not held."""
    det = HangDetector()
    job = SyncJob(2, step_s=0.1)
    job.table["io_bytes"] = 0
    steps(det, job, 40)
    set_rows(job.table, 1, phase="forward")
    set_rows(job.table, 0, phase="collective")
    t0 = job.now
    for k in range(0, 41):
        set_rows(job.table, 1, io_bytes=k * 1_000_000)  # 10 MB/s
        assert det.check(job.at(t0 + 0.1 * k)) == []


def test_a_rank_spinning_in_python_is_held_like_a_sleeping_one():
    """CPU moving is no excuse in a job whose every step took 100 ms."""
    det = HangDetector()
    job = SyncJob(2, step_s=0.1)
    for _ in range(40):
        job.table["cpu_s"] = job.now  # both ranks compute the whole step
        det.check(job.step())
        job.table["cpu_s"] = job.now
        det.check(job.at(job.now + 0.05))
    set_rows(job.table, 1, phase="forward")
    set_rows(job.table, 0, phase="collective")
    t0 = job.now
    found = []
    for k in range(1, 21):
        set_rows(job.table, 1, cpu_s=t0 + 0.1 * k)
        found += det.check(job.at(t0 + 0.1 * k))
        if found:
            break
    assert found[0].culprit_ranks == [1] and 1.5 <= round(0.1 * k, 3) <= 1.7


def test_off_with_a_zero_steady_floor():
    det = HangDetector(HangConfig(steady_floor_s=0.0))
    job = SyncJob(2, step_s=0.1)
    steps(det, job, 40)
    latency, inc = stall(det, job)
    assert latency > 4.9 and inc.evidence["culprits"][1]["threshold_steady"] is False


def test_a_restarted_job_is_steady_again_after_three_steps_from_thresholds_json(home):
    d = JobDir("steady").create()
    det = HangDetector()
    kept = thresholds.Persisted(d.thresholds_file, [det])
    job = SyncJob(2, step_s=0.1)
    steps(det, job, 40)
    assert kept.maybe_save(force=True)
    saved = json.loads(d.thresholds_file.read_text())["steps"]
    assert saved["p99_s"] == pytest.approx(0.1) and saved["longest_s"] == pytest.approx(0.1)
    assert thresholds.read_steady(d.thresholds_file) == (pytest.approx(0.1), pytest.approx(0.1), saved["samples"])

    det2 = HangDetector()
    thresholds.Persisted(d.thresholds_file, [det2])
    job2 = SyncJob(2, step_s=0.1)
    steps(det2, job2, 5)  # the first step is never timed: 4 timed steps each
    latency, inc = stall(det2, job2)
    assert 1.5 <= latency <= 1.7 and inc.evidence["culprits"][1]["threshold_steady"]

    cold = HangDetector()
    job3 = SyncJob(2, step_s=0.1)
    steps(cold, job3, 5)
    assert stall(cold, job3)[0] > 4.9


def test_a_restart_of_one_rank_drops_the_steady_threshold_until_it_steps_again():
    det = HangDetector()
    job = SyncJob(2, step_s=0.1)
    steps(det, job, 40)
    job.table["pid"][1] += 1000  # a new process
    job.table["start_mono"][1] = job.now
    det.check(job.at(job.now + 0.05))
    latency, _ = stall(det, job)
    assert latency > 4.9


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.dictionaries(st.text(max_size=12), st.one_of(
    st.none(), st.integers(), st.floats(), st.text(max_size=8),
    st.dictionaries(st.text(max_size=10), st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=5)))),
    max_size=5).map(lambda d: json.dumps({"version": 1, "phases": {}, **d}, allow_nan=True).encode())))
def test_any_steps_entry_is_a_seed_or_nothing(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("t") / "thresholds.json"
    path.write_bytes(raw)
    got = thresholds.read_steady(path)
    assert got is None or (0 < got[0] <= thresholds.MAX_SECONDS and 0 <= got[1] and got[2] > 0)
    det = HangDetector()
    thresholds.Persisted(path, [det])  # never raises
    job = SyncJob(2, step_s=0.1)
    assert steps(det, job, 6) == []
    assert np.isfinite(det.steady.longest)
