"""Detectors over synthetic slot tables; time is injected, nothing sleeps."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from slot_tables import SyncJob, TimelineJob, make_table, rank_exit, set_ring, set_rows, view
from trainwatch import slots
from trainwatch.watchdog.detectors import (
    REGISTRY,
    CollectiveMismatchDetector,
    DetectorsConfig,
    ExitDetector,
    HangConfig,
    HangDetector,
    LossHealthDetector,
    StragglerDetector,
    default_detectors,
)
from trainwatch.watchdog.detectors.base import RankExit, TickView
from trainwatch.watchdog.detectors.mismatch import CollectiveMismatchConfig
from trainwatch.watchdog.detectors.straggler import StragglerConfig, peer_median
from trainwatch.watchdog.incident import Incident, describe_ranks, format_ranks


def run_steps(detector, job: SyncJob, steps: int, **kw) -> list[Incident]:
    out = []
    for _ in range(steps):
        out += detector.check(job.step(**kw))
        out += detector.check(job.at(job.now + job.step_s / 2))
    return out


# ---- hang ---------------------------------------------------------------------------


def hung_job(n: int = 4, steps: int = 20) -> tuple[HangDetector, SyncJob]:
    det = HangDetector()
    job = SyncJob(n)
    assert run_steps(det, job, steps) == []
    return det, job


def test_hang_healthy_progression_reports_nothing():
    det, job = hung_job(steps=100)
    # a step three times slower than usual is still no hang
    assert det.check(job.step(dt=3.0)) == []


def test_hang_slow_first_step_within_warmup_is_not_a_hang():
    det = HangDetector()
    t = make_table(4, now=0.0, step=0, phase="forward", start_mono=0.0)
    for now in (10.0, 60.0, 110.0):
        assert det.check(view(t, now)) == []
    [inc] = det.check(view(t, 121.0))
    assert inc.kind == "hang"


def test_hang_checkpoint_alone_for_30s_is_not_a_hang():
    det, job = hung_job()
    set_rows(job.table, [0, 1, 2, 3], phase="checkpoint", phase_mono=job.now)
    for dt in range(1, 31):
        assert det.check(job.at(job.now + dt)) == []
    # past the slow-phase allowance it is one
    [inc] = det.check(job.at(job.now + 61))
    assert inc.category == "checkpoint_io"
    assert inc.culprit_ranks == [0, 1, 2, 3]


def test_hang_single_rank_job_in_checkpoint_for_30s_is_not_a_hang():
    det = HangDetector()
    job = SyncJob(1)
    run_steps(det, job, 10)
    set_rows(job.table, 0, phase="checkpoint", phase_mono=job.now)
    assert det.check(job.at(job.now + 30)) == []


def test_hang_rank_stuck_in_data_is_culprit_and_waiting_ranks_victims():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, 1, phase="data", phase_mono=t0 + 0.01)
    set_rows(job.table, [0, 2, 3], phase="backward", phase_mono=t0 + 0.3)
    assert det.check(job.at(t0 + 4.0)) == []
    [inc] = det.check(job.at(t0 + 6.2))
    assert inc.kind == "hang"
    assert inc.culprit_ranks == [1]
    assert inc.victims == [0, 2, 3]
    assert inc.category == "dataloader"
    assert inc.runbook == "hang"
    assert inc.severity == "high"
    assert "rank 1 stuck in phase 'data'" in inc.summary
    assert "at step 20" in inc.summary
    assert "ranks 0,2,3 wait in backward (victims)" in inc.summary
    assert inc.evidence["culprits"][1]["phase"] == "data"
    assert inc.evidence["step"] == 20
    json.dumps(inc.to_json(), allow_nan=False)


def test_hang_culprit_named_even_when_its_victims_cross_the_threshold_first():
    det, job = hung_job()
    t0 = job.now
    # the victims finished the step 0.2 s before the culprit did
    set_rows(job.table, [0, 2, 3], phase="collective", progress_mono=t0 - 0.2)
    set_rows(job.table, 1, phase="forward", phase_mono=t0 + 0.1)
    [inc] = det.check(job.at(t0 + 5.1))
    assert inc.culprit_ranks == [1]
    assert inc.category == "other"
    assert inc.victims == [0, 2, 3]


def test_hang_heartbeat_stale_rank_holds_the_gil():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 2, 3], phase="backward", phase_mono=t0 + 0.3)
    v = job.at(t0 + 6.0)
    # rank 2 looks like it waits too, but its sampler stopped 4 s ago: a wait in
    # a collective releases the GIL, so this rank is in a gc pause or stopped
    set_rows(v.table, 2, heartbeat_mono=t0 + 2.0)
    [inc] = det.check(v)
    assert inc.culprit_ranks == [2]
    assert inc.victims == [0, 1, 3]
    assert inc.category == "gc_collect"
    assert "holds the GIL or is stopped" in inc.summary
    assert inc.evidence["culprits"][2]["heartbeat_age_s"] == pytest.approx(4.0)


def test_hang_all_in_collective_one_rank_behind_in_seq_is_culprit():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 2, 3], phase="collective", phase_mono=t0 + 0.5)
    set_rows(job.table, [0, 1, 2], enqueued=812)
    set_rows(job.table, 3, enqueued=811)
    [inc] = det.check(job.at(t0 + 6.0))
    assert inc.culprit_ranks == [3]
    assert inc.victims == [0, 1, 2]
    assert inc.category == "collective_wait"
    assert "stuck in collectives" in inc.summary
    assert "rank 3 behind in pg 0" in inc.summary
    assert inc.evidence["collectives"] == {"pg": 0, "top_enqueued": 812, "behind": {3: 811}}


def test_hang_all_in_the_same_collective_names_no_culprit():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 2, 3], phase="collective", phase_mono=t0 + 0.5, enqueued=812)
    [inc] = det.check(job.at(t0 + 6.0))
    assert inc.culprit_ranks == []
    assert inc.victims == [0, 1, 2, 3]
    assert "all 4 stalled ranks stuck in the same collective" in inc.summary


def test_hang_rank_behind_in_step_is_culprit():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 2, 3], phase="backward")
    set_rows(job.table, 2, step=19)
    [inc] = det.check(job.at(t0 + 6.0))
    assert inc.culprit_ranks == [2]
    assert "behind at step 19" in inc.summary


def test_hang_checkpointing_rank_with_peers_waiting_fires_at_normal_threshold():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, 0, phase="checkpoint", phase_mono=t0 + 0.1)
    set_rows(job.table, [1, 2, 3], phase="collective", phase_mono=t0 + 0.2)
    [inc] = det.check(job.at(t0 + 5.5))
    assert inc.culprit_ranks == [0]
    assert inc.victims == [1, 2, 3]
    assert inc.category == "checkpoint_io"


def test_hang_threshold_follows_the_ranks_own_step_times():
    det = HangDetector()
    job = SyncJob(2, step_s=3.0)
    run_steps(det, job, 20)
    set_rows(job.table, [0, 1], phase="forward")
    # k x p99 = 15 s: a 3 s/step job is not hung after 10 s
    assert det.check(job.at(job.now + 10.0)) == []
    assert len(det.check(job.at(job.now + 15.5))) == 1


def test_hang_one_incident_per_episode():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, 1, phase="data")
    set_rows(job.table, [0, 2, 3], phase="backward")
    found = []
    for i in range(1, 300):
        found += det.check(job.at(t0 + i * 0.1))
    assert len(found) == 1
    # progress resumes: the episode ends; a later hang is a new episode
    assert run_steps(det, job, 3) == []
    set_rows(job.table, 2, phase="data")
    set_rows(job.table, [0, 1, 3], phase="backward")
    again = [i for k in range(1, 100) for i in det.check(job.at(job.now + k * 0.1))]
    assert [i.culprit_ranks for i in again] == [[2]]


def test_hang_slow_first_step_does_not_blunt_the_threshold():
    det = HangDetector()
    job = SyncJob(2)
    det.check(job.step(dt=90.0))  # compilation and warm-up
    run_steps(det, job, 10)
    set_rows(job.table, [0, 1], phase="forward")
    assert len(det.check(job.at(job.now + 5.5))) == 1


def test_hang_summary_names_the_culprits_node_in_multi_node_jobs():
    det = HangDetector()
    t = make_table(4, now=100.0, phase="backward")
    set_rows(t, 3, phase="data")
    nodes = ["node-a", "node-a", "node-b", "node-b"]
    det.check(view(t, 100.5, nodes=nodes))
    t["heartbeat_mono"] = 106.0
    [inc] = det.check(view(t, 106.0, nodes=nodes))
    assert inc.summary.startswith("hang: rank 3 (node-b) stuck in phase 'data'")
    assert inc.evidence["culprits"][3]["node"] == "node-b"


def test_hang_config_floor_is_respected():
    det = HangDetector(HangConfig(floor_s=20.0))
    job = SyncJob(2)
    run_steps(det, job, 10)
    set_rows(job.table, [0, 1], phase="data")
    assert det.check(job.at(job.now + 15)) == []


# ---- collective mismatch --------------------------------------------------------------


def offset_steps(det, t, steps, *, ranks, delta, now=50.0, source="colls"):
    """Every rank completes `steps` in turn; `ranks` end each with `delta` more
    (or fewer) collectives than the others."""
    found = []
    for k, step in enumerate(steps):
        colls = 2 * step + np.where(np.isin(t["rank"], ranks), delta, 0)
        if source == "colls":
            set_ring(t, step, colls=colls, seq=3 * step)
        else:
            set_ring(t, step, colls=2 * step, seq=3 * step + np.where(np.isin(t["rank"], ranks), delta, 0))
        set_rows(t, list(t["rank"]), step=step, progress_mono=now + k)
        found += det.check(view(t, now + k + 0.1))
    return found


def test_mismatch_needs_the_same_offset_at_several_steps():
    det = CollectiveMismatchDetector()
    t = make_table(4, now=50.0, step=7)
    assert det.check(view(t, 50.1)) == []
    assert offset_steps(det, t, [8, 9], ranks=[2], delta=-1) == []  # two steps: not yet
    [inc] = offset_steps(det, t, [10], ranks=[2], delta=-1, now=52.0)
    assert inc.kind == "collective_mismatch"
    assert inc.culprit_ranks == [2]
    assert inc.victims == [0, 1, 3]
    assert inc.runbook == "collective-mismatch"
    assert inc.category == "collective_mismatch"
    assert inc.evidence["steps"] == [8, 9, 10]
    assert inc.evidence["direction"] == "fewer"
    assert "rank 2 issued fewer Python collectives on world-spanning groups than ranks 0,1,3" in inc.summary


def test_mismatch_rank_with_an_extra_collective_is_the_minority():
    det = CollectiveMismatchDetector()
    t = make_table(4, now=50.0, step=7)
    found = offset_steps(det, t, [8, 9, 10, 11], ranks=[1], delta=+1)
    assert found and found[0].culprit_ranks == [1]
    assert found[0].evidence["direction"] == "more"
    assert "extra collective" in found[0].summary


def test_mismatch_on_the_default_groups_sequence_numbers():
    """DDP's gradient all-reduce never passes through Python: a skipped one shows
    only in the default process group's sequence number."""
    det = CollectiveMismatchDetector()
    t = make_table(2, now=50.0, step=7)
    found = offset_steps(det, t, [8, 9, 10], ranks=[1], delta=-1, source="seq")
    assert found and found[0].culprit_ranks == [1]
    assert found[0].evidence["source"] == "default_pg_seq"


def test_mismatch_one_boundary_off_by_one_is_not_a_mismatch():
    """A collective that lands on different sides of a step boundary on
    different ranks (a background thread's, say) disagrees once, then agrees."""
    det = CollectiveMismatchDetector()
    t = make_table(2, now=50.0, step=7)
    assert offset_steps(det, t, [8], ranks=[1], delta=-1) == []
    assert offset_steps(det, t, [9, 10, 11, 12], ranks=[1], delta=0, now=51.0) == []
    assert offset_steps(det, t, [13, 14], ranks=[1], delta=-1, now=60.0) == []


def test_mismatch_collectives_after_the_step_are_not_counted_in_it():
    """The live count of a rank that finished its step and then all-reduced a
    metric is ahead of a peer that has not yet: only the exact end-of-step
    counts are compared, so this never reads as a mismatch."""
    det = CollectiveMismatchDetector()
    t = make_table(2, now=50.0, step=7)
    for k in range(20):
        set_rows(t, 0, py_collectives=t["py_collectives"][0] + 1, phase="collective")
        assert det.check(view(t, 50.1 + k * 0.1)) == []


def test_mismatch_lagging_culprit_is_compared_when_it_posts():
    """Ranks 0-2 agree on a step before rank 3 reaches it: that is not an
    agreement of the whole job, so rank 3's offset still counts."""
    det = CollectiveMismatchDetector()
    t = make_table(4, now=50.0, step=7)
    found = []
    for k, step in enumerate(range(8, 12)):
        colls = 2 * step
        set_ring(t, step, colls=colls, seq=3 * step, ranks=[0, 1, 2])
        set_rows(t, [0, 1, 2], step=step)
        found += det.check(view(t, 50.0 + k))
        set_ring(t, step, colls=colls - 1, seq=3 * step, ranks=[3])
        set_rows(t, 3, step=step)
        found += det.check(view(t, 50.5 + k))
    assert found and found[0].culprit_ranks == [3]


@pytest.mark.parametrize("offsets", [[0.0, 0.37, 0.8, 1.55], [0.0, 0.01, 0.02, 0.03], [0.5, 0.0, 0.99, 0.2]])
def test_mismatch_no_false_positive_when_ranks_are_at_different_steps(offsets):
    det = CollectiveMismatchDetector()
    job = TimelineJob(offsets)
    rng = np.random.default_rng(1)
    now = 0.0
    for _ in range(600):
        now += rng.uniform(0.01, 0.15)
        assert det.check(job.at(now)) == []


def test_mismatch_live_detection_of_a_skipped_collective():
    det = CollectiveMismatchDetector()
    job = TimelineJob([0.0, 0.3, 0.45, 0.1], skip=(1, 8))
    found = []
    now = 0.0
    while now < 12.0:
        now += 0.1
        found += det.check(job.at(now))
    assert found, "the skip was never noticed"
    first = found[0]
    assert first.culprit_ranks == [1]
    # the offset is there from the step of the skip on, and confirmed three steps later
    assert first.evidence["steps"][0] == 8 and first.evidence["step"] == 10
    assert first.detected_mono < 11 * job.step_s + 0.5


def stalled_table(now: float) -> np.ndarray:
    t = make_table(4, now=now, step=30, phase="collective", enqueued=812)
    set_rows(t, [0, 1, 2, 3], phase_mono=now + 0.5, completed=811)  # each waits for its last launch
    return t


def ras_ticks(det, t, n: int = 60) -> list:
    """Ticks every 0.1 s from 100 s over a stalled table whose ranks' samplers stay alive:
    [(time, incident)] in the order found."""
    seen = []
    for i in range(1, n):
        v = view(t, 100.0 + i * 0.1)
        v.table["heartbeat_mono"] = v.now
        seen += [(v.now, inc) for inc in det.check(v)]
    return seen


def test_mismatch_ras_style_enqueued_seq_difference():
    det = CollectiveMismatchDetector()
    t = stalled_table(100.0)
    set_rows(t, 3, enqueued=811, completed=810)
    seen = ras_ticks(det, t)
    assert seen
    when, inc = seen[0]
    assert when >= 103.0 - 1e-9  # not before the stall time
    assert inc.summary == ("collective mismatch in pg 0: 3 ranks have launched up to operation 812; "
                           "rank 3 only up to 811 (all of them waiting in a collective)")
    assert inc.culprit_ranks == [3]
    assert inc.victims == [0, 1, 2]
    assert inc.evidence["source"] == "flight_recorder"
    assert inc.evidence["behind"] == {3: 811}


def sampled_ticks(det, t, n: int = 60, *, nodes=None, rebase_jitter: float = 0.0, starved_after: float = 1e9) -> list:
    """Ticks every 0.1 s from 100 s over a stalled table whose ranks' samplers run every
    0.2 s as the rank's does, each sample moving the process CPU time; after `starved_after`
    the samplers take no new sample and only summaries re-read the last one, their times
    rebased with up to `rebase_jitter` s of jitter. [(time, incident)] in the order found."""
    rng = np.random.default_rng(5)
    seen, hb, cpu = [], 100.0, 1.0
    for i in range(1, n):
        now = round(100.0 + i * 0.1, 6)
        if i % 2 == 0 and now < starved_after:
            hb, cpu = now, cpu + 0.001
        t["heartbeat_mono"] = hb + rng.uniform(-rebase_jitter, rebase_jitter, len(t))
        t["cpu_s"] = cpu
        seen += [(now, inc) for inc in det.check(view(t, now, nodes=nodes))]
    return seen


def steady_mismatch_detector():
    from trainwatch.watchdog.detectors import default_detectors

    det = next(d for d in default_detectors() if d.name == "collective_mismatch")
    assert det.steady_s() == float("inf")  # not steady yet: stall_s as before
    det.steady_s = lambda: 1.5
    return det


def test_mismatch_ras_on_a_steady_job_compares_after_half_its_own_hang_threshold():
    """A steady job (the hang detector's threshold_steady in force, wired by
    default_detectors) has its parked ranks compared from half that threshold
    (0.75 s, not under 0.8 s), not the conservative stall_s: ranks that all wait in
    collectives yet disagree are evidence no slowness gives. Watched from 0.3 s,
    settled 0.5 s later and re-read by three samples of the rank's 0.2 s sampler."""
    det = steady_mismatch_detector()
    t = stalled_table(100.0)
    set_rows(t, [0, 1, 2, 3], step_s=0.1)  # steady 100 ms steps
    set_rows(t, 3, enqueued=811, completed=810)
    seen = sampled_ticks(det, t)
    assert seen and seen[0][1].culprit_ranks == [3]
    assert 100.8 <= seen[0][0] <= 101.0, seen[0][0]
    # A rank that publishes no CPU time: rounds are heartbeats 0.3 s apart, as before.
    t["cpu_s"] = np.nan
    seen = ras_ticks(steady_mismatch_detector(), t)
    assert seen and 101.2 <= seen[0][0] <= 101.7, seen[0][0]


def test_mismatch_ras_counts_a_sample_re_read_with_rebased_times_once():
    """A starved sampler (a rank's last sample, from before it moved on) re-read on
    every half-second summary with freshly rebased times is one sample: its CPU time
    does not move, so no later round confirms it and nothing is compared."""
    t = stalled_table(100.0)
    set_rows(t, [0, 1, 2, 3], step_s=0.1)
    set_rows(t, 3, enqueued=811, completed=810)
    nodes = ["a", "a", "b", "b"]
    assert sampled_ticks(steady_mismatch_detector(), t, 80, nodes=nodes, rebase_jitter=0.4, starved_after=100.35) == []
    # The same rows from samplers that keep sampling: the desync is found.
    assert sampled_ticks(steady_mismatch_detector(), t, 80, nodes=nodes, rebase_jitter=0.4)


def test_mismatch_ras_style_op_difference_names_minority():
    det = CollectiveMismatchDetector()
    t = stalled_table(100.0)
    set_rows(t, 2, last_op="broadcast")
    found = []
    for i in range(1, 50):
        v = view(t, 100.0 + i * 0.1)
        v.table["heartbeat_mono"] = v.now
        found += det.check(v)
    assert found
    assert found[0].culprit_ranks == [2]
    assert "rank 2 launched 'broadcast'" in found[0].summary
    assert "3 ranks launched 'allreduce'" in found[0].summary


def test_mismatch_a_rank_behind_whose_last_launch_its_peers_completed_is_a_hang():
    """FSDP's prefetch: a rank launches an all-gather, is then stuck in its own
    compute, and never waits on that op, so its flight recorder still counts it
    outstanding. Its peers completed that operation (a collective completes on
    every member) and wait in the next one: the rank behind is not in a
    collective, it hangs before its next launch (the hang detector's call).
    Where the peers have not completed it either, the rank may wait in it: compared."""
    t = stalled_table(100.0)
    set_rows(t, 3, enqueued=811, completed=810, phase="compute")
    assert ras_ticks(CollectiveMismatchDetector(), t) == []
    t = stalled_table(100.0)
    set_rows(t, [0, 1, 2], completed=810)
    set_rows(t, 3, enqueued=811, completed=810, phase="compute")
    seen = ras_ticks(CollectiveMismatchDetector(), t)
    assert seen and seen[0][1].culprit_ranks == [3]


def test_mismatch_ras_ignores_ranks_in_data_loading_and_long_steps():
    det = CollectiveMismatchDetector()
    t = stalled_table(100.0)
    set_rows(t, 3, enqueued=811, completed=811, phase="data")  # a dataloader hang, not a desync
    for i in range(1, 50):
        v = view(t, 100.0 + i * 0.1)
        v.table["heartbeat_mono"] = v.now
        assert det.check(v) == []
    for phase in ("compute", "forward", "optimizer"):  # still computing: a hang
        det = CollectiveMismatchDetector()
        t = stalled_table(100.0)
        set_rows(t, 3, enqueued=811, completed=811, phase=phase)
        for i in range(1, 50):
            v = view(t, 100.0 + i * 0.1)
            v.table["heartbeat_mono"] = v.now
            assert det.check(v) == [], phase
    det = CollectiveMismatchDetector()
    t = stalled_table(100.0)
    set_rows(t, [0, 1, 2, 3], step_s=4.0)  # 4 s steps: 5 s without one is normal
    set_rows(t, 3, enqueued=811, completed=810)
    for i in range(1, 50):
        v = view(t, 100.0 + i * 0.1)
        v.table["heartbeat_mono"] = v.now
        assert det.check(v) == []


def test_mismatch_ras_rank_computing_in_backward_is_not_parked():
    """The healthy-run false alarm: rank 0 still computes its backward under CPU
    load (nothing outstanding) while rank 1 already launched two more
    all-reduces. Rank 0 is slow, not desynchronised."""
    det = CollectiveMismatchDetector()
    t = make_table(2, now=100.0, step=30, phase="backward", enqueued=356)
    set_rows(t, 1, enqueued=358, completed=357)
    for i in range(1, 80):
        v = view(t, 100.0 + i * 0.1)
        v.table["heartbeat_mono"] = v.now
        assert det.check(v) == []


def test_mismatch_ras_parked_ranks_on_different_sequence_numbers():
    det = CollectiveMismatchDetector()
    t = make_table(2, now=100.0, step=30, phase="backward", enqueued=356)
    set_rows(t, 0, completed=355)  # waiting for 356 to complete
    set_rows(t, 1, enqueued=358, completed=357)
    found = ras_ticks(det, t, 80)
    assert found and found[0][1].culprit_ranks == [0]
    assert found[0][0] >= 104.0 - 1e-9


def validation_race(det, *, starve_s: float):
    """Two healthy ranks in a long validation pass (no step for seconds) meet
    in eval all-reduces. At 106.0 rank 0's sampler reads it parked in 357;
    rank 0 then finishes 357 and computes while its sampler thread is starved
    for `starve_s`; rank 1 waits in 358 meanwhile. Rank 0 then joins 358."""
    t = make_table(2, now=100.0, step=30, step_s=0.5, phase="collective", enqueued=300)
    found = []
    now = 100.0
    while now < 112.0:
        now = round(now + 0.1, 6)
        v = view(t, now)
        seq = 300 + int((now - 100.0) * 10)
        if now < 106.0:  # both move through the pass's collectives
            set_rows(t, [0, 1], enqueued=seq, completed=seq - 1, heartbeat_mono=now)
        elif now < 106.0 + starve_s:
            set_rows(t, 0, enqueued=357, completed=356)  # the starved sampler's last read
            set_rows(t, 1, enqueued=358, completed=357, heartbeat_mono=now)
            if now < 106.05:
                set_rows(t, 0, heartbeat_mono=now)
        else:
            set_rows(t, [0, 1], enqueued=358, completed=358, heartbeat_mono=now, phase="data")
        v = view(t, now)
        found += det.check(v)
    return found


def test_mismatch_ras_off_by_one_snapshot_of_a_starved_sampler_is_not_a_mismatch():
    """The healthy-run false restart ("1 rank have launched up to operation 358;
    rank 0 only up to 357"): rank 0's numbers were read once, before it moved on.
    One read is not evidence: a position is compared only once later sampler
    rounds of the same rank read it again."""
    assert validation_race(CollectiveMismatchDetector(), starve_s=1.9) == []
    # Without the re-read requirement the same snapshot was a mismatch.
    old = CollectiveMismatchDetector(CollectiveMismatchConfig(settle_s=1.0, settle_rounds=0))
    assert [i.culprit_ranks for i in validation_race(old, starve_s=1.9)][:1] == [[0]]


def test_mismatch_ras_off_by_one_closed_by_the_next_sample_is_never_a_mismatch():
    """Ranks read one apart at every other sample, each gap closed by the next."""
    det = CollectiveMismatchDetector()
    t = make_table(2, now=100.0, step=30, phase="collective", enqueued=500)
    for i in range(1, 120):
        now = 100.0 + i * 0.1
        seq = 500 + i // 2
        set_rows(t, 0, enqueued=seq, completed=seq - 1, heartbeat_mono=now)
        set_rows(t, 1, enqueued=seq + (i % 2), completed=seq - 1 + (i % 2), heartbeat_mono=now)
        assert det.check(view(t, now)) == []


def test_mismatch_ras_across_nodes_from_half_second_summaries():
    """On the multi-node aggregator a node's rows arrive twice a second with
    rebased times that jitter: the true desync is still found, with its node."""
    det = CollectiveMismatchDetector()
    t = stalled_table(100.0)
    set_rows(t, 3, enqueued=811, completed=810)
    nodes = ["a", "a", "b", "b"]
    rng = np.random.default_rng(3)
    found = []
    for i in range(1, 120):
        now = 100.0 + i * 0.1
        if i % 5 == 0:  # a summary: heartbeats as read, rebased with jitter
            t["heartbeat_mono"] = now + rng.uniform(-0.1, 0.1, 4)
        found += [(now, inc) for inc in det.check(view(t, now, nodes=nodes))]
    assert found
    when, inc = found[0]
    assert inc.culprit_ranks == [3] and inc.victims == [0, 1, 2]
    assert when < 106.0


def test_mismatch_ras_ranks_inside_a_skipped_collective_are_parked():
    """Seen on a real two-node run: rank 3 (node b) skipped an all-reduce and
    went on into its next step's backward, where it launched 28. Ranks 0-2 are
    inside the all-reduce it skipped, but their flight recorders' last
    snapshot reads 27 launched, 27 completed. They are parked all the same (in
    a blocking collective call): a mismatch naming rank 3, not a hang."""
    det = CollectiveMismatchDetector()
    t = make_table(4, now=100.0, step=14, phase="collective", enqueued=27)
    set_rows(t, [0, 1, 2], completed=27)
    set_rows(t, 3, step=15, phase="backward", enqueued=28, completed=27)
    found = []
    for i in range(1, 80):
        v = view(t, 100.0 + i * 0.1, nodes=["a", "a", "b", "b"])
        v.table["heartbeat_mono"] = v.now
        found += det.check(v)
    assert found and found[0].kind == "collective_mismatch" and found[0].culprit_ranks == [3], found[:1]
    assert found[0].victims == [0, 1, 2] and "rank 3 ran a step ahead" in found[0].summary


def test_mismatch_ras_settles_on_rows_whose_times_are_rebased_every_summary():
    """The job-wide aggregator rebases each node's monotonic times onto its own
    clock on every summary, so a stuck rank's `progress_mono` reads a little
    different each time. Its sequence numbers still settle: a new step or a new
    process restarts the clock, a rebased time does not."""
    det = CollectiveMismatchDetector()
    t = make_table(4, now=100.0, step=14, phase="collective", enqueued=27)
    set_rows(t, [0, 1, 2], completed=27)
    set_rows(t, 3, step=15, phase="backward", enqueued=28, completed=27)
    base = t["progress_mono"].copy()
    found = []
    for i in range(1, 60):
        v = view(t, 100.0 + i * 0.3, nodes=["a", "a", "b", "b"])
        v.table["progress_mono"] = base + (0.05 if i % 2 else -0.05)  # each summary's rebasing
        v.table["heartbeat_mono"] = v.now
        found += det.check(v)
        if found:
            break
    assert found and found[0].culprit_ranks == [3], found[:1]
    assert v.now - 100.0 < 5.0, v.now  # before the 5 s hang threshold


def test_mismatch_ras_abstains_while_a_rank_is_stuck_elsewhere():
    """Pipeline: rank 3 hangs in data loading; its stage peer rank 2 waits in a
    recv (no collective outstanding), so rank 0's data-parallel all-reduce with
    rank 2 waits at a later sequence number. A hang of rank 3, not a desync."""
    det = CollectiveMismatchDetector()
    t = make_table(4, now=100.0, step=12, phase="collective", enqueued=44)
    set_rows(t, 0, enqueued=45, completed=44)  # waits in the all-reduce with rank 2
    set_rows(t, 3, phase="data")
    for i in range(1, 80):
        v = view(t, 100.0 + i * 0.1)
        v.table["heartbeat_mono"] = v.now
        assert det.check(v) == []


def test_mismatch_counters_reset_when_a_rank_restarts():
    det = CollectiveMismatchDetector()
    t = make_table(2, now=50.0, step=7)
    assert det.check(view(t, 50.1)) == []
    # rank 1 restarted (new pid) and resumed at step 7 with a fresh counter
    set_rows(t, 1, pid=5000, py_collectives=0, step=0, progress_mono=60.0, start_mono=60.0)
    set_rows(t, 0, step=8, progress_mono=60.5, phase_mono=60.5, py_collectives=16)
    assert det.check(view(t, 60.6)) == []


# ---- straggler ------------------------------------------------------------------------


def straggler_run(det: StragglerDetector, steps: int, compute_of) -> list[Incident]:
    job = SyncJob(8)
    found = []
    for i in range(steps):
        compute = compute_of(i)
        found += det.check(job.step(dt=float(np.nanmax(compute, initial=0.5)) + 0.2, compute=compute))
    return found


def test_straggler_persistently_slow_rank():
    det = StragglerDetector()
    rng = np.random.default_rng(0)

    def compute(i):
        c = 0.5 * (1 + rng.normal(0, 0.02, 8))
        c[3] *= 2.0
        return c

    found = straggler_run(det, 30, compute)
    assert found
    inc = found[-1]
    assert inc.kind == "straggler"
    assert inc.culprit_ranks == [3]
    assert inc.severity == "medium"
    assert inc.runbook == "straggler"
    assert inc.evidence["slowdown_ratio"] == pytest.approx(2.0, rel=0.1)
    assert 3 not in inc.victims and set(inc.victims) == {0, 1, 2, 4, 5, 6, 7}
    assert "rank 3 computes 2.0x the group median" in inc.summary
    ratios = det.current_ratios()
    assert ratios[3] == pytest.approx(2.0, rel=0.1)
    assert ratios[0] == pytest.approx(1.0, rel=0.1)


def test_straggler_needs_persistence():
    slow = lambda i: np.where(np.arange(8) == 3, 1.0, 0.5)  # noqa: E731
    # min_steps (5) samples make the first evaluation; five in a row report it
    assert straggler_run(StragglerDetector(), 8, slow) == []
    found = straggler_run(StragglerDetector(), 9, slow)
    assert [i.culprit_ranks for i in found] == [[3]]


def test_straggler_small_absolute_excess_is_noise():
    # 1.6x of a 20 ms step is 12 ms: scheduler noise on a busy host, not a straggler
    slow = lambda i: np.where(np.arange(8) == 3, 0.032, 0.020)  # noqa: E731
    assert straggler_run(StragglerDetector(), 30, slow) == []


def test_straggler_transient_blip_is_ignored():
    det = StragglerDetector()

    def compute(i):
        c = np.full(8, 0.5)
        if i in (12, 13, 14):
            c[3] = 2.5  # three slow steps (a gc pause, a cold cache)
        return c

    assert straggler_run(det, 40, compute) == []


def test_straggler_nan_compute_is_ignored():
    det = StragglerDetector()

    def compute(i):
        c = np.full(8, 0.5)
        c[3] = np.nan
        return c

    assert straggler_run(det, 30, compute) == []
    assert 3 not in det.current_ratios()
    det = StragglerDetector()
    assert straggler_run(det, 30, lambda i: np.full(8, np.nan)) == []
    assert det.current_ratios() == {}


def test_straggler_still_evaluated_after_a_restart_from_an_earlier_step():
    det = StragglerDetector()
    job = SyncJob(4)
    slow = np.array([0.5, 0.5, 1.0, 0.5])
    for _ in range(30):
        det.check(job.step(compute=np.full(4, 0.5)))
    # the group restarts from a checkpoint at step 10 with new processes
    set_rows(job.table, [0, 1, 2, 3], pid=np.arange(4) + 7000, step=10)
    found = []
    for _ in range(15):
        found += det.check(job.step(compute=slow))
    assert found and found[-1].culprit_ranks == [2]


def test_straggler_two_rank_job():
    det = StragglerDetector()
    job = SyncJob(2)
    found = []
    for _ in range(20):
        found += det.check(job.step(dt=1.2, compute=np.array([0.5, 1.0])))
    assert found and found[-1].culprit_ranks == [1]


# ---- straggler under CPU contention ----------------------------------------------------
#
# Compute times (ms) of healthy ranks as the sidecar read them
# (benchmarks/stragglers.py --trace) on a 2-core machine with another job
# beside them: the scheduler slows the ranks by turns. The detector before the
# per-step, jitter-scaled comparison reported both as stragglers.

# 4 ranks of the tiny trainer, steps 2-35, beside a 2-rank job and a CPU hog:
# rank 0 spends 25 steps at 2-3x its peers' median (+40-60 ms); the old
# detector reported "rank 0 computes 3.0x the group median" at the 31st step.
CONTENTION_4_MS = np.array([
    [49, 24, 111, 70], [94, 105, 49, 55], [96, 93, 32, 41], [72, 91, 40, 24], [77, 83, 18, 19],
    [76, 68, 103, 25], [62, 56, 50, 46], [57, 49, 34, 34], [104, 27, 26, 41], [90, 27, 45, 46],
    [106, 30, 85, 25], [86, 32, 72, 39], [78, 17, 63, 44], [89, 32, 45, 62], [46, 41, 81, 39],
    [73, 28, 43, 31], [33, 53, 91, 27], [24, 39, 119, 31], [111, 33, 128, 26], [75, 33, 125, 24],
    [45, 40, 98, 43], [24, 22, 83, 32], [106, 76, 46, 16], [97, 59, 66, 31], [97, 31, 40, 21],
    [124, 41, 32, 22], [151, 25, 47, 43], [99, 18, 76, 22], [101, 41, 59, 33], [97, 17, 62, 24],
    [58, 35, 42, 47], [55, 12, 60, 110], [64, 22, 48, 86], [67, 22, 66, 70],
])
CONTENTION_4_STEP_S = [
    0.28, 0.28, 0.26, 0.21, 0.21, 0.26, 0.19, 0.21, 0.26, 0.24, 0.28, 0.24, 0.26, 0.19, 0.23, 0.23, 0.25,
    0.27, 0.29, 0.29, 0.25, 0.2, 0.24, 0.24, 0.2, 0.24, 0.28, 0.24, 0.23, 0.24, 0.2, 0.2, 0.23, 0.25,
]
# The 2-rank job beside it, 41 steps: rank 0 slow for a few steps, then rank 1
# for nine; the old detector reported "rank 1 computes 1.7x" at the 40th step.
CONTENTION_2_MS = np.array([
    [82, 111], [99, 163], [79, 73], [92, 12], [92, 27], [86, 119], [51, 63], [32, 98], [73, 113],
    [67, 75], [94, 117], [182, 175], [113, 62], [63, 38], [58, 58], [72, 36], [81, 52], [86, 73],
    [309, 34], [234, 25], [253, 79], [131, 99], [54, 123], [61, 115], [84, 122], [96, 66], [102, 107],
    [278, 92], [131, 175], [90, 77], [77, 146], [129, 193], [100, 204], [87, 155], [130, 151],
    [97, 217], [54, 131], [84, 75], [23, 63], [40, 74], [106, 107],
])
CONTENTION_2_STEP_S = [
    0.38, 0.31, 1.35, 0.34, 0.31, 0.32, 0.26, 0.26, 0.26, 0.24, 0.23, 0.27, 1.27, 0.3, 0.2, 0.26, 0.37,
    0.32, 0.44, 0.36, 0.44, 0.33, 0.34, 0.38, 0.32, 0.31, 0.4, 0.46, 0.38, 0.2, 0.29, 0.4, 0.36, 0.35,
    0.37, 0.35, 0.28, 0.33, 0.36, 0.33, 0.39,
]


def replay_steps(det: StragglerDetector, compute_s, step_s) -> list[tuple[int, Incident]]:
    """(step, incident) for every incident while the rows of `compute_s` complete one step each."""
    job = SyncJob(compute_s.shape[1])
    found = []
    for i, (compute, dt) in enumerate(zip(compute_s, step_s)):
        found += [(i + 1, inc) for inc in det.check(job.step(dt=float(dt), compute=compute))]
    return found


@pytest.mark.parametrize("table, step_s", [(CONTENTION_4_MS, CONTENTION_4_STEP_S),
                                           (CONTENTION_2_MS, CONTENTION_2_STEP_S)], ids=["4-ranks", "2-ranks"])
def test_straggler_ranks_slowed_by_turns_under_cpu_contention_are_no_straggler(table, step_s):
    det = StragglerDetector()
    assert replay_steps(det, table / 1000.0, step_s) == []
    # the gauge still reads every rank, the scheduler's favourite of the moment included
    ratios = det.current_ratios()
    assert sorted(ratios) == list(range(table.shape[1]))
    assert all(0.2 < r < 3.5 for r in ratios.values())


def test_straggler_under_cpu_contention_is_still_found():
    # the injected straggler of the benchmark (`--inject straggler:delay=0.3`) on
    # the contended 4-rank job: found at the same step as on a quiet node
    # (min_steps + persist - 1 = 9 evaluations, as before)
    compute = CONTENTION_4_MS / 1000.0
    compute[:, 2] += 0.3
    found = replay_steps(StragglerDetector(), compute, np.array(CONTENTION_4_STEP_S) + 0.3)
    step, inc = found[0]
    assert step == 9 and inc.culprit_ranks == [2]
    assert inc.evidence["slowdown_ratio"] > 4 and inc.evidence["z"][2] >= 3
    assert inc.evidence["slow_for_s"] >= 2.0
    assert set(inc.victims) == {0, 1, 3}
    # a rank three times slower in compute under the same load, later but found
    compute = CONTENTION_4_MS / 1000.0
    compute[:, 2] *= 3
    found = replay_steps(StragglerDetector(), compute, np.array(CONTENTION_4_STEP_S) + 0.1)
    assert found and found[0][1].culprit_ranks == [2] and found[0][0] <= 25


def test_straggler_margin_scales_with_the_jitter():
    # the same +60 ms (1.6x) on one rank: a straggler on a quiet node (2% jitter),
    # not on a contended one where every rank's compute jitters by +-40%
    rng = np.random.default_rng(7)
    quiet = 0.1 * (1 + rng.normal(0, 0.02, (30, 4)))
    noisy = 0.1 * (1 + rng.normal(0, 0.4, (30, 4))).clip(0.2)
    for base in (quiet, noisy):
        base[:, 1] += 0.06
    found = replay_steps(StragglerDetector(), quiet, [0.5] * 30)
    assert found and found[0][0] == 9 and found[0][1].culprit_ranks == [1]
    assert replay_steps(StragglerDetector(), noisy, [0.5] * 30) == []


def test_straggler_must_persist_in_wall_clock_time_on_fast_steps():
    # 0.25 s steps: five evaluations span 1 s, shorter than a scheduler
    # imbalance lasts; the slow rank is reported once slow for persist_s (2 s)
    compute = np.tile([0.05, 0.05, 0.05, 0.15], (30, 1))
    found = replay_steps(StragglerDetector(), compute, [0.25] * 30)
    # first slow evaluation at step 5 (1.25 s), 2 s later is step 13
    assert found[0][0] == 13 and found[0][1].culprit_ranks == [3]
    assert replay_steps(StragglerDetector(StragglerConfig(persist_s=0.0)), compute, [0.25] * 30)[0][0] == 9


def test_straggler_node_wide_slowdown_moves_every_rank_together():
    # the whole node slowed 1x..4x, step by step, every rank alike: nobody is a straggler
    factor = 1 + 3 * np.abs(np.sin(np.arange(40) / 3.0))
    compute = 0.05 * factor[:, None] * np.array([1.0, 1.02, 0.98, 1.01])
    det = StragglerDetector()
    assert replay_steps(det, compute, 0.2 * factor + 0.05) == []
    assert all(r == pytest.approx(1.0, abs=0.05) for r in det.current_ratios().values())


def test_straggler_in_a_big_job_jitter_from_a_sample_of_ranks():
    rng = np.random.default_rng(5)
    compute = 0.5 * (1 + rng.normal(0, 0.05, (12, 600)))
    compute[:, 417] *= 2
    det = StragglerDetector()
    found = replay_steps(det, compute, [1.2] * 12)
    assert found[0][0] == 9 and found[0][1].culprit_ranks == [417]
    ratios = det.current_ratios()
    assert len(ratios) == 600 and ratios[417] == pytest.approx(2.0, rel=0.1)


def test_straggler_peer_median_is_the_median_of_the_other_ranks_at_the_same_step():
    rng = np.random.default_rng(3)
    for _ in range(200):
        m = rng.normal(size=(int(rng.integers(1, 7)), int(rng.integers(1, 5))))
        m[rng.random(m.shape) < 0.3] = np.nan
        got = peer_median(m)
        for i, j in np.ndindex(m.shape):
            others = [m[q, j] for q in range(len(m)) if q != i and np.isfinite(m[q, j])]
            want = np.median(others) if np.isfinite(m[i, j]) and others else np.nan
            assert got[i, j] == pytest.approx(want, nan_ok=True)


# ---- loss health ---------------------------------------------------------------------


def loss_job(det: LossHealthDetector, steps: int = 30, n: int = 4) -> SyncJob:
    job = SyncJob(n)
    rng = np.random.default_rng(2)
    for _ in range(steps):
        assert det.check(job.step(loss=2.0 + rng.normal(0, 0.02, n), grad_norm=1.0 + rng.normal(0, 0.1, n))) == []
    return job


def test_loss_nan_on_one_rank():
    det = LossHealthDetector()
    job = loss_job(det)
    loss = np.array([2.0, np.nan, 2.0, 2.0])
    grad = np.full(4, np.nan)  # the all-reduce spreads the NaN into every rank's grads
    [inc] = det.check(job.step(loss=loss, grad_norm=grad))
    assert inc.kind == "loss_nan"
    assert inc.severity == "critical"
    assert inc.runbook == "loss-nan"
    assert inc.culprit_ranks == [1]
    assert inc.victims == [0, 2, 3]
    assert "rank 1 reported loss nan at step 31" in inc.summary
    json.dumps(inc.to_json(), allow_nan=False)
    # still NaN on the next tick: the same condition is reported (the engine dedups)
    assert [i.kind for i in det.check(job.at(job.now + 0.5))] == ["loss_nan"]
    # finite again: gone
    assert det.check(job.step(loss=np.full(4, 2.0), grad_norm=np.ones(4))) == []


def test_loss_nan_in_grad_norm_only_blames_all_ranks_with_it():
    det = LossHealthDetector()
    job = loss_job(det)
    grad = np.array([1.0, np.inf, np.inf, 1.0])
    [inc] = det.check(job.step(loss=np.full(4, 2.0), grad_norm=grad))
    assert inc.kind == "loss_nan"
    assert inc.culprit_ranks == [1, 2]
    assert "grad norm inf" in inc.summary


def test_loss_never_reported_is_not_nan():
    det = LossHealthDetector()
    job = SyncJob(2)
    for _ in range(5):
        assert det.check(job.step()) == []  # loss and grad norm stay NaN = unknown


def test_loss_spike():
    det = LossHealthDetector()
    job = loss_job(det, steps=40)
    loss = np.full(4, 2.0)
    loss[2] = 6.0
    [inc] = det.check(job.step(loss=loss, grad_norm=np.ones(4)))
    assert inc.kind == "loss_spike"
    assert inc.culprit_ranks == [2]
    assert inc.runbook == "loss-spike"
    assert inc.evidence["spikes"][2]["ratio"] == pytest.approx(3.0, rel=0.05)
    assert "rank 2 loss 6 at step 41" in inc.summary
    # the spike does not poison the baseline; the next normal step is clean
    assert det.check(job.step(loss=np.full(4, 2.0), grad_norm=np.ones(4))) == []


def test_loss_small_spike_is_noise():
    det = LossHealthDetector()
    job = loss_job(det, steps=40)
    assert det.check(job.step(loss=np.array([2.0, 2.4, 2.0, 2.0]), grad_norm=np.ones(4))) == []


def test_loss_spike_needs_min_steps():
    det = LossHealthDetector()
    job = loss_job(det, steps=10)
    assert det.check(job.step(loss=np.array([2.0, 20.0, 2.0, 2.0]), grad_norm=np.ones(4))) == []


def test_grad_explosion():
    det = LossHealthDetector()
    job = loss_job(det)
    grad = np.array([1.0, 1.0, 1.0, 500.0])
    [inc] = det.check(job.step(loss=np.full(4, 2.0), grad_norm=grad))
    assert inc.kind == "grad_explosion"
    assert inc.culprit_ranks == [3]
    assert inc.severity == "high"
    assert inc.runbook == "grad-explosion"
    assert inc.evidence["grad_norms"][3]["grad_norm"] == 500.0
    # 50 is 50x the median but under the absolute floor of 100
    assert det.check(job.step(loss=np.full(4, 2.0), grad_norm=np.array([1.0, 50.0, 1.0, 1.0]))) == []


def test_loss_healthy_noisy_decreasing_curve_reports_nothing():
    det = LossHealthDetector()
    job = SyncJob(8)
    rng = np.random.default_rng(3)
    for i in range(600):
        trend = 1.5 + 4.0 * math.exp(-i / 120)
        loss = trend * (1 + rng.normal(0, 0.04, 8))
        if i % 37 == 0:
            loss[i % 8] *= 1.18  # the normal 10-20% bumps
        grad = np.exp(rng.normal(0, 0.4, 8)) * (3.0 if i < 20 else 1.0)
        assert det.check(job.step(loss=loss, grad_norm=grad)) == [], f"step {i}"


def test_loss_evaluates_each_step_once():
    det = LossHealthDetector()
    job = loss_job(det, steps=40)
    loss = np.full(4, 2.0)
    loss[0] = 7.0
    assert [i.kind for i in det.check(job.step(loss=loss, grad_norm=np.ones(4)))] == ["loss_spike"]
    # ticks without a new step repeat the held verdict; they add no samples
    for k in range(20):
        assert [i.kind for i in det.check(job.at(job.now + 0.01 * (k + 1)))] == ["loss_spike"]
    assert det._loss.counts(np.array([0]))[0] == 41


# ---- exits ----------------------------------------------------------------------------


def exit_view(now: float, exits) -> TickView:
    return view(make_table(4, now=now), now, exits=exits)


def test_exit_by_signal_is_a_crash():
    det = ExitDetector()
    [inc] = det.check(exit_view(10.0, [rank_exit(1, -11, pid=4242, node="node-a")]))
    assert inc.kind == "crash"
    assert inc.culprit_ranks == [1]
    assert inc.severity == "critical"
    assert inc.category == "child_failed"
    assert inc.runbook == "crash"
    assert inc.summary == "crash: rank 1 (pid 4242 on node-a) was killed by SIGSEGV"
    assert inc.evidence["exits"] == [
        {"rank": 1, "local_rank": 1, "node": "node-a", "pid": 4242, "exitcode": -11, "signal": "SIGSEGV"}
    ]


def test_exit_code_is_a_crash():
    det = ExitDetector()
    [inc] = det.check(exit_view(10.0, [rank_exit(2, 1, pid=77)]))
    assert inc.summary == "crash: rank 2 (pid 77 on node0) exited with code 1"
    assert inc.evidence["exits"][0]["exitcode"] == 1


def test_ranks_that_fail_alike_at_once_are_one_crash():
    """Every rank raising the same error before its first step: one fault, one
    incident naming them all; ranks that fail in different ways stay apart."""
    [inc] = ExitDetector().check(exit_view(10.0, [rank_exit(0, 1, pid=70), rank_exit(1, 1, pid=71)]))
    assert inc.culprit_ranks == [0, 1] and inc.victims == []
    assert inc.summary == "crash: ranks 0,1 (pids 70,71 on node0) exited with code 1"
    incs = ExitDetector().check(exit_view(10.0, [rank_exit(0, 1, pid=70), rank_exit(1, -11, pid=71)]))
    assert sorted(i.culprit_ranks for i in incs) == [[0], [1]]


def test_exit_code_zero_is_not_a_crash():
    det = ExitDetector()
    assert det.check(exit_view(10.0, [rank_exit(r, 0) for r in range(4)])) == []


def test_exit_teardown_of_survivors_is_collateral():
    det = ExitDetector()
    exits = [rank_exit(1, -11)] + [rank_exit(r, -15) for r in (0, 2, 3)]
    [inc] = det.check(exit_view(10.0, exits))
    assert inc.culprit_ranks == [1]
    assert inc.victims == [0, 2, 3]
    assert "ranks 0,2,3 stopped as a consequence" in inc.summary
    # the launcher's SIGKILL a little later is still part of the same failure
    assert det.check(exit_view(15.0, [rank_exit(0, -9)])) == []
    # a lone SIGKILL much later (the OOM killer) is a fault of its own
    [oom] = det.check(exit_view(100.0, [rank_exit(2, -9, pid=99)]))
    assert oom.culprit_ranks == [2] and "SIGKILL" in oom.summary


def test_rank_exit_from_exitcode_names_the_signal():
    e = RankExit.from_exitcode(rank=0, local_rank=0, pid=1, exitcode=-9)
    assert e.signal_name == "SIGKILL" and e.failed
    assert RankExit.from_exitcode(rank=0, local_rank=0, pid=1, exitcode=0).failed is False


# ---- incident, view, registry ----------------------------------------------------------


def test_incident_json_is_strict_and_keyed():
    inc = Incident(
        kind="loss_nan",
        culprit_ranks=[np.int32(3), 1],
        victims=[1, 2],
        severity="critical",
        evidence={"loss": {np.int64(3): float("nan")}, "step": np.int64(5), "ratio": np.float64(1.5)},
    )
    assert inc.key == "loss_nan:1,3"
    assert inc.victims == [2]  # a culprit is never also a victim
    data = inc.to_json(wall_time=0.0)
    assert data["time"].startswith("1970-01-01T00:00:00")
    text = json.dumps(data, allow_nan=False)
    back = Incident.from_json(json.loads(text))
    assert back.culprit_ranks == [1, 3] and back.evidence["loss"] == {"3": "nan"}
    with pytest.raises(ValueError, match="severity"):
        Incident(kind="hang", culprit_ranks=[], severity="urgent")


def test_describe_ranks_is_compact():
    assert describe_ranks([3]) == "rank 3"
    assert describe_ranks([0, 2, 3]) == "ranks 0,2,3"
    assert format_ranks(range(4096)) == "0-4095"
    assert format_ranks([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7,8"
    assert "(40 ranks)" in format_ranks(range(0, 80, 2))


def test_tick_view_keeps_live_rows_and_their_nodes():
    t = make_table(4)
    t["pid"][2] = 0
    v = TickView.from_table(5.0, t, ["a", "b", "c", "d"])
    assert v.table["rank"].tolist() == [0, 1, 3]
    assert v.nodes == ["a", "b", "d"]
    with pytest.raises(ValueError, match="nodes"):
        TickView.from_table(5.0, t, ["a"])


def test_registry_builds_every_detector_once():
    dets = default_detectors()
    names = [d.name for d in dets]
    assert names == list(REGISTRY) and len(set(names)) == len(names)
    assert [d.name for d in default_detectors(DetectorsConfig(disabled=("straggler",)))] == [
        n for n in REGISTRY if n != "straggler"
    ]
    with pytest.raises(ValueError, match="unknown detector"):
        default_detectors(DetectorsConfig(disabled=("nope",)))
    custom = default_detectors(DetectorsConfig(hang=HangConfig(floor_s=9.0)))
    assert next(d for d in custom if d.name == "hang").config.floor_s == 9.0


def test_loss_nan_waits_for_the_source_rank_to_publish():
    """DDP spreads one rank's NaN into everyone's grad norm; a tick that sees the
    victims' step before the source's must not blame the victims."""
    det = LossHealthDetector()
    t = make_table(4, now=10.0, step=29)
    for s in range(1, 30):
        set_rows(t, [0, 1, 2, 3], step=s, loss=5.0, grad_norm=1.0)
        det.check(view(t, 10.0 + s * 0.1))
    set_rows(t, [0, 1, 3], step=30, grad_norm=float("nan"))  # rank 2 still at 29
    assert det.check(view(t, 13.1)) == []
    set_rows(t, 2, step=30, loss=float("nan"), grad_norm=float("nan"))
    [inc] = det.check(view(t, 13.2))
    assert inc.culprit_ranks == [2] and inc.victims == [0, 1, 3]


def test_exit_seen_first_by_the_launcher_is_the_culprit():
    """Peers that fail on their own right after (gloo errors, exit code 1) are
    consequences of the rank the launcher saw die first."""
    det = ExitDetector()
    exits = [
        RankExit(rank=2, local_rank=2, pid=12, exitcode=-9, signal_name="SIGKILL", node="n", first=True),
        RankExit(rank=0, local_rank=0, pid=10, exitcode=1, node="n"),
        RankExit(rank=1, local_rank=1, pid=11, exitcode=1, node="n"),
        RankExit(rank=3, local_rank=3, pid=13, exitcode=-15, signal_name="SIGTERM", node="n"),
    ]
    [inc] = det.check(TickView.from_table(5.0, make_table(4), exits=exits))
    assert inc.culprit_ranks == [2] and inc.victims == [0, 1, 3]


def test_spike_between_two_reads_is_not_lost():
    """Steps faster than the sidecar's reads: the spike at step 30 was already
    overwritten by step 31's normal loss, but the rank kept it as its peak."""
    det = LossHealthDetector()
    t = make_table(4, now=10.0, step=1)
    for s in range(1, 30):
        set_rows(t, [0, 1, 2, 3], step=s, loss=5.0 - 0.01 * s, grad_norm=1.0)
        det.check(view(t, 10.0 + s * 0.1))
    set_rows(t, [0, 1, 2, 3], step=31, loss=4.7)
    t["peak_loss"][2], t["peak_loss_step"][2] = 235.0, 30
    found = det.check(view(t, 13.2))
    [inc] = [i for i in found if i.kind == "loss_spike"]
    assert inc.culprit_ranks == [2]
    assert inc.evidence["spikes"][2]["step"] == 30


def test_nan_source_is_the_rank_that_went_bad_first():
    det = LossHealthDetector()
    t = make_table(4, now=10.0, step=1)
    for s in range(1, 30):
        set_rows(t, [0, 1, 2, 3], step=s, loss=5.0, grad_norm=1.0)
        det.check(view(t, 10.0 + s * 0.1))
    # read after NaN reached everyone: rank 2's came at step 30, the others' at 31
    nan = float("nan")
    set_rows(t, [0, 1, 2, 3], step=31, loss=nan, grad_norm=nan)
    t["peak_loss"][:] = nan
    t["peak_loss_step"][:] = [31, 31, 30, 31]
    [inc] = [i for i in det.check(view(t, 13.2)) if i.kind == "loss_nan"]
    assert inc.culprit_ranks == [2] and inc.victims == [0, 1, 3]


# ---- hang: honest pauses (evaluation, busy ranks, working slow phases, stopped) ----------


def test_hang_eval_batches_are_progress():
    """A validation pass: no optimizer step for far longer than the threshold,
    but every batch (and finished no_grad forward) is progress."""
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 2, 3], phase="eval", phase_mono=t0 + 0.1)
    for k in range(1, 300):  # 30 s of 0.1 s eval batches
        set_rows(job.table, [0, 1, 2, 3], active_mono=t0 + k * 0.1)
        assert det.check(job.at(t0 + k * 0.1 + 0.05)) == []


def test_hang_after_eval_stops_progressing_says_for_how_long():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 2, 3], active_mono=t0 + 3.0)
    set_rows(job.table, 2, phase="data", phase_mono=t0 + 3.0)
    set_rows(job.table, [0, 1, 3], phase="collective", phase_mono=t0 + 3.5)
    [inc] = det.check(job.at(t0 + 9.0))
    assert inc.culprit_ranks == [2]
    assert "no progress for 6.0 s" in inc.summary  # measured from its last batch, not "0.0 s"


def other_work_step(det, job, seconds, *, phase="eval", fetch=True) -> list[Incident]:
    """One step that contains `seconds` of other work: an evaluation pass (eval
    phase, batches fetched) or, with phase="compute" and fetch=False, an RL
    rollout (finished no_grad blocks only), ticked every 0.1 s."""
    out = []
    t0 = job.now
    ranks = list(job.table["rank"])
    set_rows(job.table, ranks, phase=phase, phase_mono=t0 + 0.05)
    for k in range(1, int(seconds / 0.1)):
        set_rows(job.table, ranks, active_mono=t0 + k * 0.1)
        if fetch:
            job.table["batches"] += 1
        out += det.check(job.at(t0 + k * 0.1 + 0.05))
    return out + det.check(job.step(dt=seconds))


@pytest.mark.parametrize("phase,fetch", [("eval", True), ("compute", False)], ids=["validation", "rollout"])
def test_hang_steps_with_other_work_stay_out_of_the_training_threshold(phase, fetch):
    """A validation pass (or an RL rollout) every 20 steps makes those steps 10 s
    long: in the step history they would set the threshold to 5 x 10 s. They go
    to their own history; a compute hang is still named at the steady job's
    threshold (1.5 s here), and at the floor with that threshold off."""
    for steady_floor_s, quiet_s, named_s in ((1.5, 1.2, 2.0), (0.0, 4.0, 5.5)):
        det = HangDetector(HangConfig(steady_floor_s=steady_floor_s))
        job = SyncJob(2, step_s=0.2)
        found = []
        for _ in range(3):
            found += run_steps(det, job, 20)
            found += other_work_step(det, job, 10.0, phase=phase, fetch=fetch)
        found += run_steps(det, job, 20)
        assert found == []
        set_rows(job.table, 1, phase="forward")
        set_rows(job.table, 0, phase="collective")
        assert det.check(job.at(job.now + quiet_s)) == []
        [inc] = det.check(job.at(job.now + named_s))
        assert inc.culprit_ranks == [1]
        assert inc.evidence["culprits"][1]["threshold_steady"] is (steady_floor_s > 0)


def test_hang_a_rollout_the_job_never_showed_gets_the_slow_phase_allowance():
    """Forward-only work late in a step marks the step as other work at once: a
    long single no_grad block with nobody waiting is not hung at the floor."""
    det = HangDetector()
    job = SyncJob(2, step_s=0.2)
    run_steps(det, job, 30)
    t0 = job.now
    set_rows(job.table, [0, 1], phase="compute", active_mono=t0 + 1.5)
    assert det.check(job.at(t0 + 1.6)) == []
    assert det.check(job.at(t0 + 20.0)) == []  # one no_grad generate() of 18 s
    assert len(det.check(job.at(t0 + 62.0))) == 1


def test_hang_slow_batch_fetches_are_training_work_not_other_work():
    """A data stall (batches fetched late in the step) stays in the step history."""
    det = HangDetector()
    job = SyncJob(2, step_s=0.2)
    run_steps(det, job, 10)
    other = []
    for _ in range(5):
        t0 = job.now
        set_rows(job.table, [0, 1], phase="data", active_mono=t0 + 2.0)
        job.table["batches"] += 1
        det.check(job.at(t0 + 2.05))
        det.check(job.step(dt=2.1))
        other.append(bool(det.other.kind.size) and det._other_s.counts(np.array([0]))[0] > 0)
    assert not any(other)


def busy(job, ranks, t0, seconds, *, cpu=1.0, io=0.0):
    """Heartbeats every 0.2 s with CPU time (and I/O) advancing at these rates."""
    out = []
    for k in range(1, int(seconds / 0.2) + 1):
        now = t0 + k * 0.2
        set_rows(job.table, ranks, cpu_s=k * 0.2 * cpu, io_bytes=int(k * 0.2 * io))
        out.append(job.at(now))
    return out


def test_hang_busy_rank_nobody_waits_for_is_not_hung():
    """One rank computes a long metric in plain Python (no phase marker, no
    batches): its CPU time advances and nobody waits, so it is not a hang."""
    det, job = hung_job(n=2)
    t0 = job.now
    set_rows(job.table, [0, 1], phase="compute", phase_mono=t0 + 0.1)
    for v in busy(job, [0, 1], t0, 60.0):
        assert det.check(v) == []


def test_hang_busy_rank_with_peers_waiting_is_the_culprit():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 3], phase="backward", phase_mono=t0 + 0.3)
    set_rows(job.table, 2, phase="compute", phase_mono=t0 + 0.1)
    found = []
    for v in busy(job, [2], t0, 10.0):
        found += [(v.now, inc) for inc in det.check(v)]
    assert found
    when, inc = found[0]
    assert when - t0 < 6.0
    assert inc.culprit_ranks == [2] and inc.victims == [0, 1, 3]


def test_hang_checkpoint_being_written_keeps_its_allowance_while_peers_wait():
    """Rank 0 writes a large checkpoint (I/O moving) while the others already
    wait in the next step's all-reduce: slow, not hung, for up to slow_phase_s."""
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, 0, phase="checkpoint", phase_mono=t0 + 0.1)
    set_rows(job.table, [1, 2, 3], phase="backward", phase_mono=t0 + 0.3)
    views = busy(job, [0], t0, 50.0, cpu=0.05, io=50e6)
    assert all(det.check(v) == [] for v in views)


def test_hang_checkpoint_write_blocked_with_peers_waiting_fires_at_normal_threshold():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, 0, phase="checkpoint", phase_mono=t0 + 0.1)
    set_rows(job.table, [1, 2, 3], phase="backward", phase_mono=t0 + 0.3)
    found = []
    for v in busy(job, [0], t0, 10.0, cpu=0.0, io=0.0):
        found += [(v.now, inc) for inc in det.check(v)]
    assert found and found[0][0] - t0 < 6.0
    assert found[0][1].culprit_ranks == [0] and found[0][1].category == "checkpoint_io"


def test_hang_ranks_waiting_for_a_working_rank_are_not_hung():
    """Rank 0 evaluates alone (batches keep coming); the others wait at a
    barrier for 40 s. Nobody is hung."""
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [1, 2, 3], phase="collective", phase_mono=t0 + 0.1)
    set_rows(job.table, 0, phase="eval", phase_mono=t0 + 0.1)
    for k in range(1, 400):
        set_rows(job.table, 0, active_mono=t0 + k * 0.1)
        assert det.check(job.at(t0 + k * 0.1 + 0.05)) == []


def test_hang_stopped_rank_is_named_stopped():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 3], phase="backward", phase_mono=t0 + 0.3)
    v = job.at(t0 + 6.0)
    set_rows(v.table, 2, heartbeat_mono=t0 + 0.2, pid=4242)
    v.proc_state = lambda pid: "stopped" if pid == 4242 else "sleeping"
    [inc] = det.check(v)
    assert inc.culprit_ranks == [2]
    assert inc.category == "stopped" and inc.runbook == "stopped"
    assert inc.evidence["pattern"] == "stopped"
    assert "is stopped (process state T" in inc.summary


def test_hang_gil_holder_that_is_not_stopped_holds_the_gil():
    det, job = hung_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 3], phase="backward", phase_mono=t0 + 0.3)
    v = job.at(t0 + 6.0)
    set_rows(v.table, 2, heartbeat_mono=t0 + 0.2, phase="compute")
    v.proc_state = lambda pid: "running"
    [inc] = det.check(v)
    assert inc.category == "gc_collect" and "holds the GIL (no heartbeat" in inc.summary


def test_hang_first_collective_gets_the_warmup_allowance():
    """Before the first step (DDP's warm-up pass, first NCCL/gloo connections)
    every rank may sit in a collective for a while: that is start-up."""
    det = HangDetector()
    job = SyncJob(4)
    set_rows(job.table, [0, 1, 2, 3], phase="backward", phase_mono=1.0)
    set_rows(job.table, [2, 3], enqueued=6)
    for k in range(1, 100):
        assert det.check(job.at(1.0 + k * 0.5)) == []


# ---- which loss is judged (--loss-health) ----------------------------------------------


def zero_code(job: SyncJob) -> SyncJob:
    """Steps counted by the zero-code hooks: the loss is whatever backward() ran on."""
    job.table["step_source"] = slots.STEP_COUNTED
    return job


def test_loss_health_auto_judges_an_unmodified_scripts_loss_for_nan_only():
    """An RL value loss rises as returns grow, and jumps: an unmodified script's
    loss is not judged by the spike rule; a NaN still is, and says which loss."""
    from trainwatch.watchdog.detectors.loss import LossHealthConfig

    det = LossHealthDetector()
    job = zero_code(SyncJob(2))
    rng = np.random.default_rng(2)
    for _ in range(40):
        assert det.check(job.step(loss=2.0 + rng.normal(0, 0.02, 2), grad_norm=np.ones(2))) == []
    assert det.check(job.step(loss=np.array([2.0, 9.0]), grad_norm=np.array([1.0, 800.0]))) == []
    [inc] = det.check(job.step(loss=np.array([2.0, np.nan]), grad_norm=np.full(2, np.nan)))
    assert inc.kind == "loss_nan" and inc.culprit_ranks == [1]
    assert inc.evidence["loss_watched"] == "the loss backward() ran on (unmodified script)"
    # --loss-health full: the same spike is a spike
    det = LossHealthDetector(LossHealthConfig(health="full"))
    job = zero_code(SyncJob(2))
    for _ in range(40):
        det.check(job.step(loss=2.0 + rng.normal(0, 0.02, 2), grad_norm=np.ones(2)))
    kinds = [i.kind for i in det.check(job.step(loss=np.array([2.0, 9.0]), grad_norm=np.ones(2)))]
    assert kinds == ["loss_spike"]
    # --loss-health off: not even a NaN
    det = LossHealthDetector(LossHealthConfig(health="off"))
    job = zero_code(SyncJob(2))
    for _ in range(5):
        det.check(job.step(loss=np.full(2, 2.0), grad_norm=np.ones(2)))
    assert det.check(job.step(loss=np.array([2.0, np.nan]), grad_norm=np.ones(2))) == []


def test_loss_health_declared_loss_gets_every_rule_and_says_so():
    det = LossHealthDetector()
    job = loss_job(det, steps=40)  # tw.step(loss=...) (STEP_REPORTED)
    [inc] = det.check(job.step(loss=np.array([2.0, 2.0, 6.0, 2.0]), grad_norm=np.ones(4)))
    assert inc.kind == "loss_spike"
    assert inc.evidence["loss_watched"] == "the loss passed to tw.step() (declared)"


def test_loss_health_mode_is_validated():
    from trainwatch.watchdog.detectors.loss import LossHealthConfig

    with pytest.raises(ValueError, match="--loss-health must be one of auto, off, nan-only, full"):
        LossHealthConfig(health="some")


def test_a_rank_that_lost_its_peer_is_a_victim_never_a_culprit():
    """Rank 2 was killed; ranks 0 and 1 failed on their own a moment later with
    gloo's "Connection closed by peer" (recorded in the errors file), and the
    launcher happened to see rank 0 first: rank 2 is the culprit all the same."""
    det = ExitDetector()
    exits = [
        RankExit(rank=0, local_rank=0, pid=10, exitcode=1, node="n", first=True, peer_lost=True),
        RankExit(rank=2, local_rank=2, pid=12, exitcode=-9, signal_name="SIGKILL", node="n", first=True),
        RankExit(rank=1, local_rank=1, pid=11, exitcode=1, node="n", peer_lost=True),
    ]
    [inc] = det.check(TickView.from_table(5.0, make_table(4), exits=exits))
    assert inc.culprit_ranks == [2] and inc.victims == [0, 1] and "lost contact with it" in inc.summary


def test_ranks_that_lost_a_peer_on_another_node_name_no_culprit_here():
    """A node died: this node's ranks fail with a lost peer. The fault is not
    here (the aggregator's node_lost names it): no survivor is a culprit."""
    det = ExitDetector()
    exits = [RankExit(rank=r, local_rank=r, pid=10 + r, exitcode=1, node="n0", first=True, peer_lost=True)
             for r in (0, 1)]
    [inc] = det.check(TickView.from_table(5.0, make_table(2), exits=exits))
    assert inc.kind == "crash" and inc.culprit_ranks == [] and inc.victims == [0, 1]
    assert "lost contact with a peer" in inc.summary and inc.evidence["peer_lost"] is True
    # the launcher's teardown of whatever is left is part of it
    assert det.check(TickView.from_table(6.0, make_table(2), exits=[rank_exit(1, -15)])) == []


def test_the_teardown_after_a_lost_peer_is_part_of_the_lost_contact():
    """Rank 1 lost its peer on another node; the launcher then stopped rank 0
    with SIGTERM: no rank of this node is a culprit."""
    det = ExitDetector()
    exits = [RankExit(rank=1, local_rank=1, pid=11, exitcode=1, node="n0", first=True, peer_lost=True),
             RankExit(rank=0, local_rank=0, pid=10, exitcode=-15, signal_name="SIGTERM", node="n0")]
    [inc] = det.check(TickView.from_table(5.0, make_table(2), exits=exits))
    assert inc.culprit_ranks == [] and inc.victims == [0, 1]
    # A rank killed here first (the OOM killer) is still a culprit, with the lost contact its victim.
    det = ExitDetector()
    exits = [RankExit(rank=0, local_rank=0, pid=10, exitcode=-9, signal_name="SIGKILL", node="n0", first=True),
             RankExit(rank=1, local_rank=1, pid=11, exitcode=1, node="n0", peer_lost=True)]
    [inc] = det.check(TickView.from_table(5.0, make_table(2), exits=exits))
    assert inc.culprit_ranks == [0] and inc.victims == [1]


def test_ranks_stopped_by_the_nan_policy_are_its_action_not_a_crash():
    """--nan-policy fail: every rank raises NonFiniteLoss and exits 1 on
    purpose. The loss_nan incident tells that story; no crash names rank 0
    (the first to exit) as a culprit. A real crash beside them still is one."""
    det = ExitDetector()
    t = make_table(4, now=100.0)
    stops = [RankExit(rank=r, local_rank=r, pid=10 + r, exitcode=1, first=r == 0, policy_stop=True) for r in range(4)]
    assert det.check(view(t, 100.0, exits=stops)) == []
    det = ExitDetector()
    crash = RankExit(rank=3, local_rank=3, pid=13, exitcode=-9, signal_name="SIGKILL", first=True)
    found = det.check(view(t, 100.0, exits=stops[:3] + [crash]))
    assert [(i.kind, i.culprit_ranks) for i in found] == [("crash", [3])]


@pytest.mark.parametrize("working", [None, "cpu", "io"], ids=["idle", "computing", "writing"])
def test_hang_called_by_the_steady_threshold_alone_is_provisional_until_past_honest_work(working):
    """On a steady job a rank idle outside collectives is named within 2 s, as an
    alert (`provisional`): a save, an upload or an evaluation on one rank looks
    the same at first. The same hang is reported again, `firm`, once the rank is
    past the floor while idle, or the busy grace (15 s) while it computes. A
    rank whose I/O moves is never held to the steady threshold."""
    det = HangDetector()
    job = SyncJob(2, step_s=0.2)
    assert run_steps(det, job, 30) == []
    t0 = job.now
    set_rows(job.table, 1, phase="forward")
    set_rows(job.table, 0, phase="collective")
    found = []
    for k in range(1, 400):  # 0.2 s ticks, 80 s
        now = t0 + 0.2 * k
        if working == "cpu":
            set_rows(job.table, 1, cpu_s=now - t0)  # a whole core
        elif working == "io":
            set_rows(job.table, 1, io_bytes=int((now - t0) * 50e6))  # a checkpoint written at 50 MB/s
        found += [(round(now - t0, 1), inc) for inc in det.check(job.at(now))]
    if working == "io":  # a rank writing is never held to the steady threshold: one report, at the floor's rules
        [(called_s, inc)] = found
        assert inc.culprit_ranks == [1] and inc.evidence["provisional"] is False and called_s > 2.0, called_s
        return
    (first_s, first), (firm_s, firm) = found
    assert first.culprit_ranks == firm.culprit_ranks == [1] and first_s <= 2.0
    assert first.evidence["provisional"] is True and first.evidence["culprits"][1]["threshold_steady"]
    assert firm.evidence["firm"] is True and firm.evidence["provisional"] is False
    expected = {None: 5.0, "cpu": 15.0}[working]
    assert expected - 0.2 <= firm_s <= expected + 0.6, (first_s, firm_s)
