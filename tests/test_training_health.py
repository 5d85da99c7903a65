"""Training health detectors: dead and vanishing gradients, a stuck learning
rate, a collapsing loss scale, loss trends and step time spikes. Each fires on
its fault with the right ranks and stays quiet on honest training patterns."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slot_tables import HEALTH_FIELDS, SyncJob, make_table, set_rows, view
from trainwatch import slots
from trainwatch.watchdog.detectors import DetectorsConfig, default_detectors
from trainwatch.watchdog.detectors.steptime import StepTimeConfig, StepTimeDetector
from trainwatch.watchdog.detectors.training import TrainingHealthConfig, TrainingHealthDetector
from trainwatch.watchdog.detectors.trend import LossTrendConfig, LossTrendDetector
from trainwatch.watchdog.engine import DetectorEngine, _SyntheticJob
from trainwatch.watchdog.config import RESTART_KINDS

NEW_KINDS = ("dead_grad", "vanishing_grad", "lr_stuck", "loss_scale_collapse", "loss_trend", "step_time_spike")


def run(det, job: SyncJob, steps: int, **fields) -> list:
    """Advance `steps` steps with `fields` set (a value, an array per rank, or a
    function of the step number); return every incident seen, in order."""
    found = []
    for _ in range(steps):
        step = int(job.table["step"][0]) + 1
        for name, value in fields.items():
            job.table[name] = value(step) if callable(value) else value
        found += det.check(job.step())
    return found


def kinds(incidents) -> list[str]:
    return sorted({i.kind for i in incidents})


# ---- dead and vanishing gradients --------------------------------------------------------


def test_dead_grad_after_n_zero_steps_on_the_rank_that_had_gradients():
    det = TrainingHealthDetector()
    job = SyncJob(4)
    assert run(det, job, 20, grad_norm=1.0) == []
    grad = np.ones(4)
    grad[1] = 0.0
    found = run(det, job, 4, grad_norm=grad)
    assert found == []  # 4 steps in a row: not yet
    [inc] = run(det, job, 1, grad_norm=grad)
    assert inc.kind == "dead_grad" and inc.culprit_ranks == [1]
    assert inc.severity == "high" and inc.runbook == "dead-grad"
    assert inc.evidence["steps_in_a_row"] == 5 and "rank 1" in inc.summary
    # held while it lasts, gone with the next real gradient
    assert kinds(run(det, job, 3, grad_norm=grad)) == ["dead_grad"]
    assert run(det, job, 1, grad_norm=1.0) == []


def test_zero_grad_norm_from_the_start_is_not_reported_but_all_zero_elements_are():
    det = TrainingHealthDetector()
    job = SyncJob(2)
    assert run(det, job, 30, grad_norm=0.0) == []  # never had a gradient: nothing to lose
    [inc] = run(det, job, 5, grad_norm=np.nan, zero_grad_frac=np.array([0.01, 1.0]))[-1:]
    assert inc.kind == "dead_grad" and inc.culprit_ranks == [1]
    assert "every gradient element is zero" in inc.summary


def test_dead_grad_uses_the_peak_since_the_last_read():
    det = TrainingHealthDetector()
    job = SyncJob(2)
    run(det, job, 10, grad_norm=1.0)
    # The last step's norm is 0 but a step between the reads had a gradient.
    found = run(det, job, 10, grad_norm=0.0, peak_grad=np.array([0.5, 0.0]),
                peak_grad_step=lambda s: s - 1)
    assert {tuple(i.culprit_ranks) for i in found} == {(1,)}


def test_vanishing_grad_needs_a_persistent_majority_of_zeros():
    det = TrainingHealthDetector(TrainingHealthConfig(vanishing_steps=50))
    job = SyncJob(4)
    frac = np.array([0.02, 0.7, 0.3, 1.0])
    found = run(det, job, 49, grad_norm=1.0, zero_grad_frac=frac)
    assert kinds(found) == ["dead_grad"]  # rank 3: every element zero is dead, not vanishing
    found = run(det, job, 1, grad_norm=1.0, zero_grad_frac=frac)
    [inc] = [i for i in found if i.kind == "vanishing_grad"]
    assert inc.culprit_ranks == [1] and inc.severity == "medium" and inc.runbook == "vanishing-grad"
    assert "70%" in inc.summary
    # one dip under the threshold starts the count again
    frac[1] = 0.4
    assert [i for i in run(det, job, 1, zero_grad_frac=frac) if i.kind == "vanishing_grad"] == []


# ---- learning rate -------------------------------------------------------------------------


def test_lr_stuck_at_zero_past_the_grace_steps():
    det = TrainingHealthDetector()
    job = SyncJob(2)
    assert run(det, job, 29, lr=0.0, grad_norm=1.0) == []
    [inc] = run(det, job, 1, lr=0.0)
    assert inc.kind == "lr_stuck" and inc.culprit_ranks == [0, 1]
    assert inc.severity == "medium" and inc.runbook == "lr-stuck" and inc.key == "lr_stuck:zero"
    assert "exactly 0" in inc.summary
    assert run(det, job, 1, lr=1e-4) == []


def warmup_cosine(warmup: int, total: int, peak: float = 1e-3):
    def lr(step: int) -> float:
        if step <= warmup:
            return peak * (step - 1) / warmup  # starts at exactly 0
        return 0.5 * peak * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))
    return lr


@pytest.mark.parametrize("schedule", [
    warmup_cosine(100, 3000),  # warmup from 0, then cosine decay (to exactly 0 at the end)
    lambda step: 3e-4,  # constant, no warmup
    lambda step: 1e-3 * min(1.0, step / 50) * 0.999 ** max(0, step - 50),  # warmup, exponential decay
])
def test_honest_schedules_are_not_stuck(schedule):
    det = TrainingHealthDetector()
    job = SyncJob(2)
    assert run(det, job, 3000, lr=schedule, grad_norm=1.0) == []


def test_lr_stuck_at_its_peak_long_after_the_warmup():
    det = TrainingHealthDetector()
    job = SyncJob(2)
    peak = 1e-3

    def schedule(step):
        return peak * min(1.0, step / 50)

    # Peak reached at step 50: stuck once held max(10 x 49, 1000) steps.
    assert run(det, job, 1049, lr=schedule, grad_norm=1.0) == []
    found = run(det, job, 5, lr=schedule)
    assert found and all(i.kind == "lr_stuck" and i.key == "lr_stuck:max" for i in found)
    assert found[0].severity == "low" and found[0].evidence["warmup_steps"] == 49
    assert "constant or warmup-stable-decay" in found[0].summary
    off = TrainingHealthDetector(TrainingHealthConfig(lr_max_ratio=0))
    assert run(off, SyncJob(2), 1100, lr=schedule, grad_norm=1.0) == []


# ---- loss scale ----------------------------------------------------------------------------


def grad_scaler(overflow_steps: set[int], *, init: float = 65536.0, growth_interval: int = 2000):
    """GradScaler's scale over steps: halved at each overflow, doubled after growth_interval clean steps."""
    state = {"scale": init, "clean": 0, "step": 0}

    def scale(step: int) -> float:
        while state["step"] < step:
            state["step"] += 1
            if state["step"] in overflow_steps:
                state["scale"] /= 2
                state["clean"] = 0
            else:
                state["clean"] += 1
                if state["clean"] >= growth_interval:
                    state["scale"] *= 2
                    state["clean"] = 0
        return state["scale"]

    return scale


def test_grad_scaler_calibration_and_occasional_overflows_are_healthy():
    det = TrainingHealthDetector()
    job = SyncJob(2)
    overflows = set(range(1, 6)) | {300, 900, 1500, 2600, 2601}  # calibrates 65536 -> 2048, then rare overflows
    assert run(det, job, 3000, loss_scale=grad_scaler(overflows, growth_interval=500), grad_norm=1.0) == []


def test_loss_scale_collapse_while_it_stays_down():
    det = TrainingHealthDetector()
    job = SyncJob(4)
    healthy = grad_scaler(set(range(1, 4)))
    run(det, job, 300, loss_scale=healthy, grad_norm=1.0)
    collapsing = grad_scaler(set(range(1, 4)) | set(range(301, 307)))
    scale = np.full(4, healthy(300))
    found = []
    for _ in range(10):
        step = int(job.table["step"][0]) + 1
        scale[2] = collapsing(step)
        job.table["loss_scale"] = scale
        found += det.check(job.step())
    [kind] = kinds(found)
    inc = found[0]
    assert kind == "loss_scale_collapse" and inc.culprit_ranks == [2] and inc.severity == "medium"
    assert inc.runbook == "loss-scale-collapse" and inc.evidence["reference"] == 8192.0
    assert inc.evidence["loss_scale"] == 128.0
    # Still down long after the window: the same episode, reported on every tick.
    assert kinds(run(det, job, 400, loss_scale=scale)) == ["loss_scale_collapse"]
    scale[2] = 8192.0
    assert run(det, job, 1, loss_scale=scale) == []


def test_loss_scale_below_the_floor_is_high():
    det = TrainingHealthDetector()
    job = SyncJob(2)
    run(det, job, 5, loss_scale=4.0, grad_norm=1.0)
    [inc] = run(det, job, 1, loss_scale=np.array([4.0, 0.5]))
    assert inc.culprit_ranks == [1] and inc.severity == "high"


def test_bf16_without_a_scaler_reports_nothing():
    det = TrainingHealthDetector()
    assert run(det, SyncJob(2), 400, grad_norm=1.0, lr=1e-4) == []  # loss_scale stays NaN


# ---- loss trend ----------------------------------------------------------------------------


def trend_run(det, steps: int, loss_fn, n: int = 4, seed: int = 0) -> list:
    job = SyncJob(n)
    rng = np.random.default_rng(seed)
    found = []
    for i in range(steps):
        loss = loss_fn(i) * (1 + rng.normal(0, 0.05, n))
        found += det.check(job.step(loss=loss))
    return found


def test_rising_loss_is_a_trend_on_the_rank_it_rises_on():
    det = LossTrendDetector()

    def loss(i):
        base = np.full(4, 2.0 + 2.0 * math.exp(-i / 100))
        if i > 400:
            base[2] *= 1 + 0.002 * (i - 400)  # +100% over 500 steps
        return base

    found = trend_run(det, 1000, loss)
    assert found and {tuple(i.culprit_ranks) for i in found} == {(2,)}
    inc = found[0]
    assert inc.kind == "loss_trend" and inc.key == "loss_trend:rising" and inc.severity == "medium"
    assert inc.runbook == "loss-trend" and inc.evidence["relative_change"] >= 0.2
    assert det.current_slopes()[2] > 0 > det.current_slopes()[0]


@pytest.mark.parametrize("spikes", [1, 3])
def test_spikes_in_a_falling_loss_are_no_trend(spikes):
    det = LossTrendDetector()

    def loss(i):
        base = np.full(4, 1.5 + 4.0 * math.exp(-i / 300))
        if 600 <= i < 600 + spikes:
            base[1] *= 5.0
        return base

    assert trend_run(det, 1500, loss) == []


def test_noisy_falling_then_flattening_loss_is_healthy():
    det = LossTrendDetector()
    # Like the integrated trainer: fast descent, then a slow one, noisy steps.
    assert trend_run(det, 3000, lambda i: np.full(8, 1.5 + 4.0 * math.exp(-i / 600)), n=8) == []
    short = LossTrendDetector()
    assert trend_run(short, 200, lambda i: np.full(4, 2.0 + 3.0 * math.exp(-i / 40))) == []


def test_plateau_needs_its_long_window_and_is_low():
    det = LossTrendDetector()
    found = trend_run(det, 1400, lambda i: np.full(4, 2.0))
    assert found == []  # not yet most of a plateau window
    found = trend_run(det, 2600, lambda i: np.full(4, 2.0))
    assert found and found[-1].key == "loss_trend:plateau" and found[-1].severity == "low"
    assert found[-1].culprit_ranks == [0, 1, 2, 3]
    off = LossTrendDetector(LossTrendConfig(plateau_window_steps=0))
    assert trend_run(off, 2600, lambda i: np.full(4, 2.0)) == []


def test_negative_losses_are_not_judged():
    det = LossTrendDetector()
    assert trend_run(det, 1200, lambda i: np.full(4, -5.0 + 0.004 * i)) == []


def test_trend_fits_take_turns_over_many_ranks():
    det = LossTrendDetector(LossTrendConfig(window_steps=40, points=8, max_ranks_per_tick=30))
    found = trend_run(det, 200, lambda i: np.full(300, math.exp(0.01 * i)), n=300)
    assert found and len(found[-1].culprit_ranks) == 300


# ---- step time spikes ----------------------------------------------------------------------

USUAL = {"data_s": 0.02, "backward_s": 0.1, "optimizer_s": 0.03}


def step_job(n: int = 4, steps: int = 25, det=None):
    det = det or StepTimeDetector()
    job = SyncJob(n, step_s=0.2)
    for _ in range(steps):
        for name, v in USUAL.items():
            job.table[name] = v
        assert det.check(job.step(dt=0.2)) == []
    return det, job


def slow_step(det, job, total, **phases) -> list:
    """One step of `total` seconds per rank, with the given per-phase times (arrays per rank)."""
    for name, v in USUAL.items():
        job.table[name] = phases.get(name, v)
    return det.check(_step_with(job, total))


def _step_with(job, total):
    tick = job.step(dt=float(np.max(total)))
    tick.table["step_s"] = total
    return tick


def test_a_slow_data_step_names_the_culprit_and_the_ranks_that_waited():
    det, job = step_job()
    data = np.full(4, 0.02)
    data[2] = 1.52
    backward = np.full(4, 1.6)
    backward[2] = 0.1
    [inc] = slow_step(det, job, np.full(4, 1.7), data_s=data, backward_s=backward)
    assert inc.kind == "step_time_spike" and inc.culprit_ranks == [2]
    assert inc.severity == "medium" and inc.runbook == "step-time-spike"
    assert inc.evidence["culprits"][2]["phase"] == "data"
    assert "data loading" in inc.summary and "rank 2" in inc.summary
    assert inc.victims == [0, 1, 3] and "ranks 0,1,3 waited for it" in inc.summary
    assert inc.evidence["victims"][0]["phase"] == "backward"
    later = det.check(job.at(job.now + 0.5))
    assert later[0].key == inc.key and later[0].detected_mono == inc.detected_mono  # the same episode


def test_the_slowest_step_between_two_reads_is_not_missed():
    det, job = step_job()
    t = job.table
    t["peak_step_s"] = np.array([0.2, 2.0, 0.2, 0.2])
    t["peak_step_s_step"] = int(t["step"][0]) + 1
    t["peak_data_s"], t["peak_backward_s"] = 0.02, 0.1
    t["peak_optimizer_s"] = np.array([0.03, 1.8, 0.03, 0.03])
    [inc] = det.check(job.step(dt=0.2))  # the last step itself was normal
    assert inc.culprit_ranks == [1] and inc.evidence["culprits"][1]["phase"] == "optimizer"


@pytest.mark.parametrize("pause", ["checkpoint", "eval"])
def test_checkpoint_and_eval_steps_are_honest(pause):
    det, job = step_job()
    now = job.now
    set_rows(job.table, 0, phase=pause, phase_mono=now + 0.05)
    for k in range(1, 11):  # the sidecar sees rank 0 in its pause for 1.5 s
        assert det.check(job.at(now + 0.15 * k)) == []
    set_rows(job.table, 0, phase="data", phase_mono=now + 1.55)
    backward = np.full(4, 1.6)
    backward[0] = 0.1
    assert slow_step(det, job, np.full(4, 1.7), backward_s=backward) == []
    assert det.check(job.at(job.now + 5.0)) == []  # nor a stall afterwards


def test_a_whole_node_slowing_is_one_node_observation_not_a_rank_alert():
    """Every rank of the node slow in data at the same step (a busy host): no rank
    is behind its peers; one node-level observation, no incident."""
    det, job = step_job(n=2)
    assert slow_step(det, job, np.full(2, 1.7), data_s=np.full(2, 1.52)) == []
    assert det.check(job.at(job.now + 2.0)) == []
    [obs] = det.node_slowdowns
    assert obs["ranks"] == [0, 1] and obs["excess_s"] >= 1.4
    # one rank of the two: a rank alert as before
    det, job = step_job(n=2)
    [inc] = slow_step(det, job, np.full(2, 1.7), data_s=np.array([1.52, 0.02]), backward_s=np.array([0.1, 1.6]))
    assert inc.culprit_ranks == [0] and det.node_slowdowns == []


@pytest.mark.parametrize("phase,fetch", [("eval", True), ("compute", False)], ids=["validation", "rollout"])
def test_a_step_that_contained_a_validation_pass_or_a_rollout_is_no_spike(phase, fetch):
    """The validation pass re-enters the eval phase at every batch (its phase start
    moves), and a rollout shows only finished no_grad blocks: neither step is a spike."""
    det, job = step_job()
    t0 = job.now
    set_rows(job.table, [0, 1, 2, 3], phase=phase, phase_mono=t0 + 0.05)
    for k in range(1, 60):  # 6 s of batches 0.1 s apart
        now = t0 + 0.1 * k
        set_rows(job.table, [0, 1, 2, 3], active_mono=now, **({"phase_mono": now} if phase == "eval" else {}))
        if fetch:
            job.table["batches"] += 1
        assert det.check(job.at(now + 0.02)) == []
    set_rows(job.table, [0, 1, 2, 3], phase="data")
    assert slow_step(det, job, np.full(4, 6.2)) == []
    assert det.check(job.at(job.now + 5.0)) == []
    assert all(det.check(job.step(dt=0.2)) == [] for _ in range(5))  # nor the baseline moved


def test_all_ranks_waiting_is_a_low_communication_stall_after_the_grace():
    det, job = step_job()
    assert slow_step(det, job, np.full(4, 6.2), backward_s=np.full(4, 6.1)) == []
    assert det.check(job.at(job.now + 1.0)) == []  # held back: a culprit may still explain it
    [inc] = det.check(job.at(job.now + 3.5))
    assert inc.culprit_ranks == [] and inc.victims == [0, 1, 2, 3] and inc.severity == "low"
    assert "communication stall" in inc.summary
    quiet, job = step_job(det=StepTimeDetector(StepTimeConfig(stall_alerts=False)))
    slow_step(quiet, job, np.full(4, 6.2), backward_s=np.full(4, 6.1))
    assert quiet.check(job.at(job.now + 3.5)) == []
    # A shorter wait with no culprit is routine on a busy host.
    det, job = step_job()
    slow_step(det, job, np.full(4, 1.7), backward_s=np.full(4, 1.6))
    assert det.check(job.at(job.now + 3.5)) == []


def test_peers_waiting_in_a_collective_for_a_slow_optimizer_are_victims():
    det, job = step_job()
    now = job.now
    for r in (0, 2, 3):
        set_rows(job.table, r, phase="collective", phase_mono=now + 0.1)
    for k in range(1, 11):
        det.check(job.at(now + 0.15 * k))
    opt = np.full(4, 0.03)
    opt[1] = 1.53
    [inc] = slow_step(det, job, np.full(4, 1.7), optimizer_s=opt)
    assert inc.culprit_ranks == [1] and inc.victims == [0, 2, 3]
    assert inc.evidence["victims"][0]["phase"] == "collective"


def test_small_or_early_or_unexplained_slow_steps_are_not_spikes():
    det, job = step_job(steps=10)  # too few samples yet
    assert slow_step(det, job, np.full(4, 3.0), data_s=np.full(4, 2.9)) == []
    det, job = step_job()
    assert slow_step(det, job, np.full(4, 0.9), data_s=np.full(4, 0.72)) == []  # 4.5x but only +0.7 s
    det, job = step_job()
    for name in USUAL:
        job.table[name] = np.nan  # no breakdown published: not judged
    assert det.check(_step_with(job, np.full(4, 5.0))) == []


def test_recurring_spikes_are_one_incident():
    engine = DetectorEngine([StepTimeDetector()])
    det = engine.detectors[0]
    _, job = step_job(det=det)
    emitted = []
    for _ in range(3):
        data, backward = np.full(4, 0.02), np.full(4, 1.5)
        data[3], backward[3] = 1.5, 0.1
        slow_step(det, job, np.full(4, 1.6), data_s=data, backward_s=backward)
        job.table["data_s"] = 0.02
        for _ in range(30):
            emitted += engine.tick(job.step(dt=0.2))
    assert [i.culprit_ranks for i in emitted] == [[3]]


# ---- all of them ---------------------------------------------------------------------------


def test_new_kinds_only_alert():
    assert not set(NEW_KINDS) & RESTART_KINDS


def test_one_incident_per_episode_through_the_engine():
    engine = DetectorEngine(default_detectors())
    job = SyncJob(4)
    emitted = []
    for i in range(80):
        job.table["lr"] = 0.0
        emitted += engine.tick(job.step(loss=np.full(4, 2.0), grad_norm=np.ones(4)))
    assert [i.kind for i in emitted] == ["lr_stuck"]


def test_not_reported_fields_never_fire():
    engine = DetectorEngine(default_detectors())
    job = SyncJob(8)
    rng = np.random.default_rng(1)
    for i in range(700):
        out = engine.tick(job.step(loss=2.0 + rng.normal(0, 0.1, 8), grad_norm=np.ones(8)))
        assert out == [], out


_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(0.0), st.just(1.0),
                    st.just(-1.0), st.just(1e308), st.just(np.nan))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(*[_VALUES] * (len(HEALTH_FIELDS) + 2), st.integers(-5, 10**12)), min_size=1, max_size=30))
def test_arbitrary_values_never_raise(rows):
    dets = [TrainingHealthDetector(), LossTrendDetector(LossTrendConfig(window_steps=8, points=4)),
            StepTimeDetector(StepTimeConfig(min_samples=1))]
    table = make_table(3, step=0)
    now = 10.0
    with np.errstate(all="ignore"):
        for k, values in enumerate(rows):
            *health, loss, step_s, peak_at = values
            for name, v in zip(HEALTH_FIELDS, health):
                table[name][k % 3] = v
            table["loss"][k % 3] = loss
            table["step_s"][k % 3] = step_s
            table["peak_step_s_step"][k % 3] = peak_at
            table["peak_grad_step"][k % 3] = peak_at
            table["step"][k % 3] += 1 + (k % 4)
            table["phase"][k % 3] = k % len(slots.PHASES)
            table["phase_mono"][k % 3] = now - (health[0] if math.isfinite(health[0]) else 0.0)
            now += 0.15
            for det in dets:
                for inc in det.check(view(table, now)):
                    assert inc.kind in NEW_KINDS and inc.summary


def test_4096_ranks_smoke():
    engine = DetectorEngine(default_detectors(DetectorsConfig()))
    job = _SyntheticJob(4096)
    for _ in range(70):
        engine.tick(job.advance())
    assert engine.failures == {}


# ---- metrics -------------------------------------------------------------------------------


class _Source:
    """What the exporter reads, from a slot table and an engine running the loss trend detector."""

    job, node = "j", "n0"

    def __init__(self, table, engine):
        from trainwatch.watchdog.exporter import StepHistogram

        self.table, self.engine = table, engine
        self.last_table = table
        self.step_hist = StepHistogram()
        self.incident_counts = {"lr_stuck": 1}

    def clock(self):
        return 0.0

    def rows(self):
        from trainwatch import rankrow

        return rankrow.decode(self.table, 0.0, "n0")

    def straggler_ratios(self):
        return {}

    def restarts(self):
        return 0

    def hardware_metrics(self):
        return iter(())


def test_exporter_publishes_the_training_health_series():
    from prometheus_client import CollectorRegistry, generate_latest

    from trainwatch.watchdog.exporter import INCIDENT_KINDS, TrainwatchCollector

    det = LossTrendDetector(LossTrendConfig(window_steps=40, points=8))
    engine = DetectorEngine([det])
    job = SyncJob(2)
    for i in range(80):
        job.table["lr"], job.table["loss_scale"] = 3e-4, 1024.0
        job.table["zero_grad_frac"] = np.array([0.01, np.nan])
        job.table["data_s"], job.table["backward_s"] = 0.25, 0.5
        engine.tick(job.step(loss=np.full(2, 4.0 - 0.01 * i)))
    registry = CollectorRegistry()
    registry.register(TrainwatchCollector(_Source(job.table, engine)))
    text = generate_latest(registry).decode()
    # Node and job aggregates (not a series per rank): every statistic, the worst rank's number.
    assert 'trainwatch_node_learning_rate{node="n0",stat="max",trainwatch_job="j"} 0.0003' in text
    assert 'trainwatch_node_loss_scale{node="n0",stat="min",trainwatch_job="j"} 1024.0' in text
    assert 'trainwatch_node_zero_grad_fraction{node="n0",stat="median",trainwatch_job="j"} 0.01' in text
    assert 'trainwatch_job_loss_scale{stat="p99",trainwatch_job="j"} 1024.0' in text
    assert 'trainwatch_learning_rate{' not in text and 'trainwatch_zero_grad_fraction{' not in text
    assert 'trainwatch_node_worst_rank{node="n0",signal="zero_grad_fraction",trainwatch_job="j"} 0.0' in text
    slope = float(text.split('trainwatch_node_loss_trend_slope{node="n0",stat="max",trainwatch_job="j"} ')[1]
                  .split()[0])
    assert slope == pytest.approx(-0.01, rel=0.05)
    for kind in NEW_KINDS:
        assert kind in INCIDENT_KINDS
        assert f'trainwatch_incidents_total{{kind="{kind}",node="n0",trainwatch_job="j"}}' in text


def test_gradient_overflow_under_a_loss_scaler_is_not_a_nan_incident():
    from trainwatch.watchdog.detectors.loss import LossHealthDetector

    det = LossHealthDetector()
    job = SyncJob(2)
    for _ in range(5):
        job.table["loss_scale"] = 65536.0
        assert det.check(job.step(loss=np.full(2, 2.0), grad_norm=np.ones(2))) == []
    # GradScaler skips the overflow step and halves its scale: routine, not NaN.
    job.table["loss_scale"] = np.array([32768.0, 65536.0])
    assert det.check(job.step(loss=np.full(2, 2.0), grad_norm=np.array([np.inf, 1.0]))) == []
    # Without a scaler an infinite gradient norm is still fatal, and so is a NaN loss with one.
    job.table["loss_scale"] = np.array([np.nan, 65536.0])
    [inc] = det.check(job.step(loss=np.array([2.0, np.nan]), grad_norm=np.array([np.inf, 1.0])))
    assert inc.kind == "loss_nan" and inc.culprit_ranks == [1] and inc.victims == [0]


def test_a_rising_loss_of_an_unmodified_script_is_no_trend_unless_asked():
    """PPO's value loss rises as returns grow: in an unmodified script (steps
    counted by the zero-code hooks) the falling-loss rule is off by default."""
    def rising(i):
        return np.full(4, 2.0 * (1 + 0.002 * i))

    def zero_code_run(det):
        job = SyncJob(4)
        job.table["step_source"] = slots.STEP_COUNTED
        rng = np.random.default_rng(0)
        return [inc for i in range(1000) for inc in det.check(job.step(loss=rising(i) * (1 + rng.normal(0, 0.05, 4))))]

    assert zero_code_run(LossTrendDetector()) == []
    found = zero_code_run(LossTrendDetector(loss_health="full"))
    assert found and found[0].evidence["loss_watched"] == "the loss backward() ran on (unmodified script)"
