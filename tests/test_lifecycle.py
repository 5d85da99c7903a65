"""One fault, one incident: the lifecycle of an incident (open, counted while it
persists, resolved when its condition is over), the one table of incident
kinds, the records that carry it through events.jsonl, the exporter's open
gauge and the verdict that reads it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from slot_tables import make_table, set_rows, view
from util import scripted_detector

from trainwatch import kinds, records, slots
from trainwatch.rankrow import RankRow
from trainwatch.diagnostics import verdict
from trainwatch.watchdog import engine as engine_mod
from trainwatch.watchdog.engine import DetectorEngine, EngineConfig
from trainwatch.watchdog.exporter import INCIDENT_KINDS, _open_incidents
from trainwatch.watchdog.incident import Incident


def run(engine, scripted, t, reports, *, start=100.0, dt=1.0):
    """Tick once per entry of `reports` (an incident or None); returns (opened, resolved)."""
    opened, resolved, now = [], [], start
    for report in reports:
        now += dt
        scripted.next = [report()] if report else []
        opened += engine.tick(view(t, now))
        resolved += engine.take_resolved()
    return opened, resolved


def straggler():
    return Incident(kind="straggler", culprit_ranks=[2], summary="rank 2 is slow", severity="medium")


def test_a_persistent_straggler_with_dips_is_one_incident_resolved_once():
    """Its rank keeps stepping (which once re-armed the key at every dip) and the
    detector's verdict flickers; still one incident, counted, then resolved
    after it was gone for the hold time."""
    scripted = scripted_detector()
    engine = DetectorEngine([scripted], config=EngineConfig(rearm_s=60.0))
    t = make_table(4, step=10)
    opened, resolved, now = [], [], 100.0
    for i in range(20 * 60):  # 20 minutes, one tick a second
        now += 1.0
        t["step"] += 1  # every rank trains on
        dip = i % 40 in (10, 11, 12) or 300 <= i < 330  # short dips and a 30 s one
        scripted.next = [] if dip else [straggler()]
        opened += engine.tick(view(t, now))
        resolved += engine.take_resolved()
    assert len(opened) == 1 and resolved == []
    assert [i.kind for i in engine.open_incidents()] == ["straggler"]
    for _ in range(61):  # it went away: resolved after the hold time, once
        now += 1.0
        opened += engine.tick(view(t, now))
        resolved += engine.take_resolved()
    assert len(opened) == 1 and len(resolved) == 1
    done = resolved[0]
    assert done.incident is opened[0] and done.count > 1000 and done.duration_s == pytest.approx(1199, abs=1)
    assert "not seen" in done.reason and engine.open_incidents() == []


def test_a_nan_streak_is_one_incident():
    scripted = scripted_detector()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    nan = lambda: Incident(kind="loss_nan", culprit_ranks=[1], summary="NaN", severity="critical")  # noqa: E731
    opened, resolved = [], []
    for k in range(30):
        set_rows(t, [0, 1, 2, 3], step=11 + k)
        o, r = run(engine, scripted, t, [nan], start=100.0 + k)
        opened += o
        resolved += r
    assert len(opened) == 1 and resolved == []


def test_a_hang_resolves_when_its_rank_trains_again_and_a_new_stall_is_a_new_incident():
    scripted = scripted_detector()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    hang = lambda: Incident(kind="hang", culprit_ranks=[1], summary="stuck", severity="high")  # noqa: E731
    opened, resolved = run(engine, scripted, t, [hang, hang, hang, None])
    assert len(opened) == 1 and resolved == []  # quiet, but no progress yet: still open
    set_rows(t, 1, step=11)
    opened2, resolved = run(engine, scripted, t, [None], start=110.0)
    assert opened2 == [] and [r.reason for r in resolved] == ["its ranks made progress"]
    opened3, _ = run(engine, scripted, t, [hang], start=120.0)
    assert len(opened3) == 1 and opened3[0] is not opened[0]


def test_a_hang_reported_once_lasts_until_its_ranks_train_again():
    """A hang is reported once, then its ranks are restarted or get going: its
    duration runs to training again, not to its one report (once 0.0 s)."""
    scripted = scripted_detector()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    hang = lambda: Incident(kind="hang", culprit_ranks=[1], summary="stuck", severity="high",  # noqa: E731
                            detected_mono=101.0)
    opened, resolved = run(engine, scripted, t, [hang, None, None])
    assert len(opened) == 1 and resolved == []
    set_rows(t, 1, step=11)
    _, [done] = run(engine, scripted, t, [None], start=111.0)  # trains again at 112
    assert done.reason == "its ranks made progress" and done.duration_s == pytest.approx(11.0)
    opened, _ = run(engine, scripted, t, [lambda: dataclasses.replace(hang(), detected_mono=201.0)], start=200.0)
    set_rows(t, 1, pid=9999, step=3)  # a new process of rank 1: the restart
    _, [done] = run(engine, scripted, t, [None], start=224.0)
    assert done.reason == "its ranks restarted" and done.duration_s == pytest.approx(24.0)


def test_a_hang_reported_once_stays_open_while_its_rank_stays_stuck():
    """Not seen again for minutes while its rank has not stepped: still open (it
    once resolved 'after 0.0s (not seen for 60s)' with the rank still stuck)."""
    scripted = scripted_detector()
    engine = DetectorEngine([scripted], config=EngineConfig(rearm_s=60.0))
    t = make_table(4, step=10)
    hang = lambda: Incident(kind="hang", culprit_ranks=[1], summary="stuck", severity="high")  # noqa: E731
    opened, resolved = run(engine, scripted, t, [hang] + [None] * 180)
    assert len(opened) == 1 and resolved == [] and [i.kind for i in engine.open_incidents()] == ["hang"]
    set_rows(t, [0, 2, 3], pid=0)  # its peers gone, rank 1 still there and stuck: still open
    assert run(engine, scripted, t, [None] * 70, start=300.0) == ([], [])


def test_a_restarted_culprit_ends_the_old_incident():
    scripted = scripted_detector()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    opened, _ = run(engine, scripted, t, [straggler, straggler])
    set_rows(t, 2, pid=9999, step=3)  # a new process of rank 2
    opened2, resolved = run(engine, scripted, t, [straggler], start=200.0)
    assert len(opened) == 1 and len(opened2) == 1 and [r.reason for r in resolved] == ["its ranks restarted"]


def test_hardware_events_share_the_lifecycle():
    engine = DetectorEngine([])
    t = make_table(4, step=10)
    xid = Incident(kind="xid", culprit_ranks=[3], summary="Xid 79", severity="critical", key="xid:3:79")
    assert engine.tick(view(t, 100.0), extra=[xid]) == [xid]
    assert engine.tick(view(t, 101.0)) == [] and engine.take_resolved() == []
    set_rows(t, 3, step=12)
    engine.tick(view(t, 102.0))
    [done] = engine.take_resolved()
    assert done.incident is xid


def test_kinds_are_declared_once_and_everything_derives_from_them():
    assert set(INCIDENT_KINDS) == set(kinds.KINDS)
    assert engine_mod.MUTES == kinds.MUTES
    assert set(verdict.ALERT_ONLY_KINDS) == {k for k, s in kinds.KINDS.items() if s.response is kinds.Response.ALERT}
    for name, spec in kinds.KINDS.items():
        assert spec.severity in ("info", "low", "medium", "high", "critical"), name
        from trainwatch.diagnostics.runbooks import get_runbook

        assert get_runbook(spec.runbook), (name, spec.runbook)


def test_events_merge_into_one_record_per_incident():
    events = [
        {"kind": "hang", "id": "a", "summary": "rank 1 stuck", "culprit_ranks": [1], "runbook": "hang"},
        {"kind": "action", "incident": "a", "verdict": {"category": "dataloader", "runbook": "dataloader-stall"}},
        {"kind": "straggler", "id": "b", "culprit_ranks": [2]},
        {"kind": "resolved", "incident": "a", "time": 5.0, "duration_s": 7.5, "count": 12, "reason": "its ranks restarted"},
        {"kind": "restart", "id": "r1", "incident": "a", "summary": "restart 1"},
    ]
    a, b, r = records.read_events(events)
    assert (a.status, a.resolution.duration_s, a.resolution.count, a.runbook) == ("resolved", 7.5, 12,
                                                                                  "dataloader-stall")
    assert a.verdict.category == "dataloader" and a.view()["resolution"] == "its ranks restarted"
    assert b.status == "open" and r.status == "" and r.incident == "a" and "status" not in r.view()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["kind", "id", "incident", "duration_s", "count", "reason", "verdict",
                                                 "culprit_ranks", "status"]),
                                st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=5),
                                          st.lists(st.integers(), max_size=3),
                                          st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))),
                max_size=12))
def test_hostile_events_merge_without_a_traceback(events):
    for incident in records.read_events(events):
        assert isinstance(incident, records.Incident) and isinstance(incident.kind, str)
        assert incident.status in ("", "open", "resolved")


class OpenSource:
    job, node = "j", "n"

    def __init__(self, opened):
        self.opened = opened

    def open_incidents(self):
        return self.opened


def test_open_gauge_counts_open_incidents_from_zero():
    import time

    source = OpenSource([Incident("straggler", [], severity="medium", opened_time=time.time() - 42),
                         Incident("hang", [], severity="high", opened_time=time.time() - 3)])
    text = "\n".join(f"{m.name} {s.labels} {s.value}" for m in _open_incidents("j", source) for s in m.samples)
    assert "trainwatch_incident_open {'trainwatch_job': 'j', 'node': 'n', 'kind': 'straggler', 'severity': 'medium'} 1.0" in text
    assert "trainwatch_incident_open {'trainwatch_job': 'j', 'node': 'n', 'kind': 'loss_nan', 'severity': 'critical'} 0.0" in text
    ages = {s.labels["kind"]: s.value for m in _open_incidents("j", source) for s in m.samples
            if m.name == "trainwatch_incident_open_age_seconds"}
    assert ages["straggler"] == pytest.approx(42, abs=1) and ages["hang"] == pytest.approx(3, abs=1)


# ---- one judge -------------------------------------------------------------------------


def rows(ages, step_s=0.1, **kw):
    return [RankRow(r, step=100, phase="data", last_progress_s=a, step_s=step_s, heartbeat_age_s=0.1,
                    groups=(slots.CollectiveGroup(0, 10, 10, "allreduce"),), **kw) for r, a in enumerate(ages)]


def test_a_rank_idle_short_of_the_threshold_is_suspect_not_healthy():
    thresholds = {"hang": {"floor_s": 5.0, "k": 5.0, "ranks": {"0": 5.0, "1": 5.0}}}
    v = verdict.decide(rows([0.05, 4.6]), thresholds=thresholds)
    assert v.category == "suspect" and v.culprit_ranks == [1] and "5.0s" in v.summary
    assert verdict.decide(rows([0.05, 0.08]), thresholds=thresholds).category == "healthy"


def test_the_thresholds_in_force_decide_when_a_rank_is_hung():
    """--hang-floor-s 2: a rank idle 2.5 s is past the watchdog's threshold, so
    diagnose does not call it healthy (its own 5 s floor once did)."""
    thresholds = {"hang": {"floor_s": 2.0, "k": 5.0, "ranks": {"0": 2.0, "1": 2.0}}}
    v = verdict.decide(rows([0.05, 2.5]), thresholds=thresholds)
    assert v.category not in ("healthy", "suspect") and v.culprit_ranks == [1]


def resolved(incident: Incident) -> Incident:
    """The same incident once a `resolved` record names it."""
    return dataclasses.replace(incident, resolution=records.Resolution(reason="its ranks made progress"))


def test_never_healthy_while_an_incident_is_open():
    fault = Incident("hang", [1], id="n-1-1", summary="rank 1 stuck", runbook="hang", category="dataloader")
    v = verdict.decide(rows([0.05, 0.05]), incidents=[fault])
    assert (v.category, v.culprit_ranks, v.runbook) == ("dataloader", [1], "hang") and "n-1-1" in v.summary
    slow = Incident("straggler", [2], id="n-1-2", summary="rank 2 slow", runbook="straggler")
    v = verdict.decide(rows([0.05, 0.05]), incidents=[slow])
    assert (v.category, v.culprit_ranks) == ("straggler", [2])
    v = verdict.decide(rows([0.05, 0.05]), incidents=[resolved(fault), resolved(slow)])
    assert v.category == "healthy"


def test_a_fault_still_open_across_its_restart_is_not_healthy():
    """The restarted ranks step before the sidecar's next round closes the hang:
    diagnose says recovering, not healthy, until the incident is resolved."""
    fault = Incident("hang", [1], id="n-1-1", summary="rank 1 stuck", runbook="hang", category="dataloader")
    restart = Incident("restart", [], incident="n-1-1")
    v = verdict.decide(rows([0.05, 0.05]), incidents=[fault, restart])
    assert (v.category, v.culprit_ranks, v.runbook) == ("dataloader", [1], "hang")
    assert v.summary.startswith("recovering after") and "n-1-1" in v.summary
    assert verdict.decide(rows([0.05, 0.05]), incidents=[resolved(fault), restart]).category == "healthy"
    # An alert that was open before the restart is not carried: the new run has its own.
    slow = Incident("straggler", [1], id="n-1-2", summary="rank 1 slow")
    assert verdict.decide(rows([0.05, 0.05]), incidents=[slow, restart]).category == "healthy"


def test_ranks_torn_down_for_a_restart_are_not_a_new_failure():
    """Between the watchdog stopping the ranks and the agent marking the job
    restarting, every pid is gone: the verdict is the open fault, not
    `child_failed` of every rank."""
    fault = Incident("hang", [1], id="n-1-1", summary="rank 1 stuck", runbook="hang", category="dataloader",
                     restart=records.RestartDecision(requested=True))
    gone = [dataclasses.replace(r, pid=100 + r.rank, state="gone") for r in rows([0.05, 0.05])]
    v = verdict.decide(gone, incidents=[fault])
    assert (v.category, v.culprit_ranks) == ("dataloader", [1]) and v.summary.startswith("restarting after")
    assert verdict.decide(gone).category == "child_failed"


def test_a_rank_idle_many_of_its_steps_is_suspect_within_a_second():
    """Steps of 0.1 s: a rank idle 0.8 s is no longer healthy, whatever its 5 s
    threshold, and its peers waiting in a collective are not the suspects; a
    checkpoint's pause is judged against the threshold in force."""
    thresholds = {"hang": {"floor_s": 5.0, "k": 5.0, "ranks": {str(r): 5.0 for r in range(3)}}}
    ranks = rows([0.8, 0.8, 0.8])
    ranks[0] = dataclasses.replace(ranks[0], phase="collective")
    ranks[2] = dataclasses.replace(ranks[2], phase="collective")
    v = verdict.decide(ranks, thresholds=thresholds)
    assert v.category == "suspect" and v.culprit_ranks == [1], v
    assert verdict.decide(rows([0.3, 0.3, 0.3]), thresholds=thresholds).category == "healthy"
    saving = rows([0.05, 1.5, 0.05])
    saving[1] = dataclasses.replace(saving[1], phase="checkpoint")
    assert verdict.decide(saving, thresholds=thresholds).category == "healthy"


def test_a_collapsed_loss_scale_is_one_incident_not_also_vanishing_gradients():
    """Every step skipped while the fp16 scale halves reads as zero gradients:
    while the collapse is open, vanishing_grad on it is the same fault."""
    engine = DetectorEngine([])
    t = make_table(4, now=100.0, step=150)
    collapse = Incident(kind="loss_scale_collapse", culprit_ranks=[2], severity="medium")
    vanish = Incident(kind="vanishing_grad", culprit_ranks=[2], severity="medium")
    assert engine.tick(view(t, 100.0), extra=[collapse, vanish]) == [collapse]
    set_rows(t, [0, 1, 2, 3], step=160)
    assert engine.tick(view(t, 101.0), extra=[collapse, vanish]) == []
    alone = DetectorEngine([])
    assert alone.tick(view(t, 101.0), extra=[vanish]) == [vanish]
