"""The detector engine: isolation of failing detectors, de-duplication,
crash muting and the 4096-rank tick cost."""

from __future__ import annotations

import logging

import numpy as np
from slot_tables import SyncJob, make_table, rank_exit, set_rows, view

from trainwatch.watchdog.detectors import ExitDetector, HangDetector, default_detectors
from trainwatch.watchdog.detectors.base import Detector, TickView
from trainwatch.watchdog.engine import DetectorEngine, EngineConfig
from trainwatch.watchdog.incident import Incident


class Broken(Detector):
    name = "broken"

    def check(self, view: TickView) -> list[Incident]:
        raise ZeroDivisionError("bad round")


class Scripted(Detector):
    """Reports whatever the test put in `next` for the coming tick."""

    name = "scripted"

    def __init__(self) -> None:
        self.next: list[Incident] = []

    def check(self, view: TickView) -> list[Incident]:
        out, self.next = self.next, []
        return out


def incident(kind: str = "straggler", culprits=(1,)) -> Incident:
    return Incident(kind=kind, culprit_ranks=list(culprits), summary=f"{kind} on {list(culprits)}")


def test_failing_detector_is_logged_and_the_others_still_run(caplog):
    scripted = Scripted()
    engine = DetectorEngine([Broken(), scripted], log=logging.getLogger("test.engine"))
    scripted.next = [incident()]
    with caplog.at_level(logging.ERROR, logger="test.engine"):
        out = engine.tick(view(make_table(4), 100.0))
    assert [i.kind for i in out] == ["straggler"]
    assert "detector broken failed" in caplog.text
    assert "ZeroDivisionError" in caplog.text
    assert engine.failures == {"broken": 1}
    assert out[0].detected_mono == 100.0


def test_same_fault_is_one_incident_until_rearmed():
    scripted = Scripted()
    engine = DetectorEngine([scripted], config=EngineConfig(rearm_s=30.0))
    t = make_table(4, step=10)
    now = 100.0

    def tick(report: bool, dt: float = 1.0):
        nonlocal now
        now += dt
        scripted.next = [incident()] if report else []
        return engine.tick(view(t, now))

    assert len(tick(True)) == 1
    assert all(tick(True) == [] for _ in range(50))  # keeps firing: muted
    assert tick(False) == []
    assert tick(True) == []  # back after 1 s, no progress: the same fault
    tick(False)
    assert tick(False, dt=31.0) == []
    assert len(tick(True)) == 1  # absent for 30 s: re-armed


def test_rearm_when_culprit_steps_advanced():
    scripted = Scripted()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    scripted.next = [incident("hang")]
    assert len(engine.tick(view(t, 100.0))) == 1
    assert engine.tick(view(t, 101.0)) == []
    set_rows(t, 1, step=12)  # the culprit made progress: the episode is over
    scripted.next = [incident("hang")]
    assert len(engine.tick(view(t, 102.0))) == 1


def test_rearm_when_culprit_restarted_at_an_earlier_step():
    scripted = Scripted()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    scripted.next = [incident("loss_nan")]
    assert len(engine.tick(view(t, 100.0))) == 1
    assert engine.tick(view(t, 101.0)) == []
    set_rows(t, 1, pid=4321, step=5)  # resumed from an older checkpoint in a new process
    scripted.next = [incident("loss_nan")]
    assert len(engine.tick(view(t, 102.0))) == 1


def test_duplicate_keys_in_one_tick_collapse():
    a, b = Scripted(), Scripted()
    engine = DetectorEngine([a, b])
    a.next = [incident("collective_mismatch", (5,))]
    b.next = [incident("collective_mismatch", (5,)), incident("collective_mismatch", (6,))]
    out = engine.tick(view(make_table(8), 1.0))
    assert [i.culprit_ranks for i in out] == [[5], [6]]


def test_crash_mutes_the_hang_it_causes_until_training_progresses():
    engine = DetectorEngine([ExitDetector(), HangDetector()])
    job = SyncJob(4)
    for _ in range(20):
        assert engine.tick(job.step()) == []
    t0 = job.now
    set_rows(job.table, [0, 2, 3], phase="backward")
    set_rows(job.table, 1, phase="forward")
    [crash] = engine.tick(job.at(t0 + 0.5, exits=[rank_exit(1, -11)]))
    assert crash.kind == "crash" and crash.culprit_ranks == [1]
    # the survivors stall in their collective: a consequence, not a new fault
    for k in range(1, 100):
        assert engine.tick(job.at(t0 + 0.5 + 0.1 * k)) == []
    # restarted group: new pids, progress again; hangs are reported again
    set_rows(job.table, [0, 1, 2, 3], pid=np.arange(4) + 9000, step=15, start_mono=job.now + 10)
    job.now += 12
    job.table["progress_mono"] = job.now
    for _ in range(10):
        assert engine.tick(job.step()) == []
    # the same rank hangs again within rearm_s: a new fault of the new processes
    set_rows(job.table, 1, phase="data")
    set_rows(job.table, [0, 2, 3], phase="backward")
    hangs = [i for k in range(1, 80) for i in engine.tick(job.at(job.now + 0.1 * k))]
    assert [(i.kind, i.culprit_ranks) for i in hangs] == [("hang", [1])]


def test_crash_and_hang_in_the_same_tick_reports_the_crash_only():
    engine = DetectorEngine([HangDetector(), ExitDetector()])
    job = SyncJob(4)
    for _ in range(20):
        engine.tick(job.step())
    set_rows(job.table, [0, 2, 3], phase="backward")
    out = engine.tick(job.at(job.now + 8.0, exits=[rank_exit(1, 1)]))
    assert [i.kind for i in out] == ["crash"]


def test_default_engine_on_a_healthy_job_reports_nothing():
    engine = DetectorEngine(default_detectors())
    job = SyncJob(16)
    rng = np.random.default_rng(5)
    for i in range(200):
        loss = 3.0 * np.exp(-i / 150) + 1.0 + rng.normal(0, 0.03, 16)
        grad = np.abs(rng.normal(1.0, 0.2, 16))
        compute = 0.6 * (1 + rng.normal(0, 0.03, 16))
        assert engine.tick(job.step(loss=loss, grad_norm=grad, compute=compute)) == []
        assert engine.tick(job.at(job.now + 0.5)) == []



def test_same_detection_handed_back_after_a_gap_is_not_a_new_incident():
    from trainwatch.watchdog.detectors.base import Detector
    from trainwatch.watchdog.engine import DetectorEngine
    from trainwatch.watchdog.incident import Incident

    held = Incident(kind="loss_spike", culprit_ranks=[2], summary="spike", detected_mono=5.0)

    class Flicker(Detector):
        name = "flicker"

        def __init__(self):
            self.calls = 0

        def check(self, view):
            self.calls += 1
            return [] if self.calls == 2 else [held]

    engine = DetectorEngine([Flicker()])
    emitted = []
    for i in range(4):
        table = make_table(4)
        table["step"] = 10 + i * 5  # steps advance, which would otherwise re-arm the key
        emitted += engine.tick(TickView.from_table(100.0 + i, table))
    assert emitted == [held]


def test_mismatch_mutes_the_hang_it_causes():
    from trainwatch.watchdog.incident import Incident

    class Fixed:
        name = "fixed"

        def __init__(self, kinds):
            self.kinds = kinds

        def check(self, view):
            return [Incident(kind=k, culprit_ranks=[1], summary=k, severity="high") for k in self.kinds]

    engine = DetectorEngine([Fixed(["hang", "collective_mismatch"])])
    t = make_table(2, now=10.0, step=5)
    got = engine.tick(view(t, 11.0))
    assert [i.kind for i in got] == ["collective_mismatch"]
    engine.detectors = [Fixed(["hang"])]
    assert engine.tick(view(t, 12.0)) == []  # still the same stall
    set_rows(t, [0, 1], step=6, progress_mono=13.0)  # training moved on
    assert [i.kind for i in engine.tick(view(t, 13.5))] == ["hang"]


def test_a_cause_known_from_outside_mutes_what_it_explains_and_nothing_else():
    """`causes` (a restart under way, another node's open crash) mute the kinds
    they name for the round: never opened, so the same finding once the cause
    is gone is a new incident; other kinds still open."""
    scripted = Scripted()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    scripted.next = [incident("hang", (2,)), incident("loss_nan", (1,))]
    out = engine.tick(view(t, 100.0), causes={"a restart under way": frozenset({"hang"})})
    assert [i.kind for i in out] == ["loss_nan"]
    assert [i.kind for i in engine.open_incidents()] == ["loss_nan"]
    scripted.next = [incident("hang", (2,))]
    assert [i.kind for i in engine.tick(view(t, 101.0))] == ["hang"]
