"""Evidence revises the story: a collective mismatch read from counters alone,
whose captured stacks put the rank behind in its own work (data loading, a
checkpoint write), becomes one hang incident with the right runbook; its
restart waits for the hang rule."""

from __future__ import annotations

import dataclasses
import io
import types

import pytest
from slot_tables import make_table, set_rows, view
from util import scripted_detector

from trainwatch import records, slots
from trainwatch.diagnostics import verdict
from trainwatch.diagnostics.revise import past_threshold, revision
from trainwatch.diagnostics.stack_groups import StackGroup
from trainwatch.rankrow import RankRow
from trainwatch.watchdog.engine import DetectorEngine
from trainwatch.watchdog.incident import Incident
from trainwatch.watchdog.responder import describe
from trainwatch.watchdog.revisions import Revisions

LOADER = "_try_get_data (torch/utils/data/dataloader.py:1133)"


def mismatch(**kw) -> Incident:
    return Incident(kind="collective_mismatch", culprit_ranks=[1], victims=[0, 2, 3], severity="critical",
                    summary="rank 1 is 1 all_reduce behind; all of them waiting in a collective",
                    runbook="collective-mismatch", **kw)


def groups(category: str, evidence: str = LOADER, pattern: str | None = None) -> list[StackGroup]:
    return [StackGroup((1,), (evidence,), category, pattern, "MainThread", evidence=evidence),
            StackGroup((0, 2, 3), ("wait (torch/distributed/distributed_c10d.py:2800)",), "collective_wait", None,
                       "MainThread", op="all_reduce")]


def test_a_mismatch_whose_rank_behind_is_in_its_data_loader_becomes_a_hang():
    r = revision(mismatch(), groups("dataloader"), now=5.0)
    assert (r.kind, r.from_kind, r.category, r.runbook, r.time) == ("hang", "collective_mismatch", "dataloader",
                                                                   "dataloader-stall", 5.0)
    assert "rank 1 waits in data loading" in r.summary and "not in a collective" in r.summary
    assert "first read as a collective mismatch" in r.summary and LOADER in r.why
    ck = revision(mismatch(), groups("checkpoint_io", "save (torch/serialization.py:650)"))
    assert (ck.category, ck.runbook) == ("checkpoint_io", "checkpoint-io")


@pytest.mark.parametrize("case", ["in_a_collective", "not_sampled", "no_stack", "not_a_mismatch", "one_of_two"])
def test_stacks_that_agree_or_say_nothing_revise_nothing(case):
    incident, found = mismatch(), groups("dataloader")
    if case == "in_a_collective":
        found = groups("collective_wait", "wait (torch/distributed/distributed_c10d.py:2800)")
    elif case == "not_sampled":
        found[0] = dataclasses.replace(found[0], error="py-spy: permission denied")
    elif case == "no_stack":
        found = found[1:]
    elif case == "not_a_mismatch":
        incident.kind = "hang"
    else:
        incident.culprit_ranks = [1, 2]  # rank 2 is in the collective: a real mismatch may be on it
    assert revision(incident, found) is None


def test_the_restart_waits_until_the_rank_is_past_its_hang_threshold():
    rows = [RankRow(r, step=100, phase="data", last_progress_s=a, step_s=0.1, heartbeat_age_s=0.1)
            for r, a in enumerate([0.05, 1.2, 0.05, 0.05])]
    learnt = {"hang": {"floor_s": 5.0, "k": 5.0, "ranks": {"1": 3.0}}}
    assert not past_threshold(rows, [1], learnt)
    rows[1] = dataclasses.replace(rows[1], last_progress_s=3.5)
    assert past_threshold(rows, [1], learnt) and not past_threshold(rows, [1, 2], learnt)
    assert not past_threshold(rows, [7], learnt) and not past_threshold(rows, [], learnt)


def test_events_tell_the_revised_story_as_one_incident():
    """What events.jsonl holds after a revision reads back as one hang incident
    with its revision kept: diagnose, the report and the exporter say hang."""
    first = mismatch(id="n-1-1").to_json()
    r = revision(records.Incident.from_json(first), groups("dataloader"), now=7.0)
    events = [first, {"kind": "action", "incident": "n-1-1", "capture": {"dir": "/x", "ranks": 4},
                      "revised": records.codec.encode(r)}]
    [incident] = records.read_events(events)
    assert (incident.kind, incident.category, incident.runbook, incident.key) == ("hang", "dataloader",
                                                                                 "dataloader-stall", "hang:1")
    assert [x.from_kind for x in incident.revisions] == ["collective_mismatch"]
    assert incident.view()["revisions"][0]["why"] == r.why and incident.status == "open"
    rows = [RankRow(k, step=100, phase="data", last_progress_s=0.1, step_s=0.1, heartbeat_age_s=0.1,
                    groups=(slots.CollectiveGroup(0, 10, 10, "allreduce"),)) for k in range(4)]
    v = verdict.decide(rows, incidents=[incident])
    assert v.category != "collective_mismatch" and v.runbook == "dataloader-stall"
    line = describe({"revised": records.codec.encode(r)})
    assert line.startswith("revised to hang (dataloader): the stacks captured for it show rank 1 in data loading")


def test_the_engine_keeps_one_incident_and_asks_for_the_held_restart_once():
    scripted = scripted_detector()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    now = 100.0

    def tick(*found):
        nonlocal now
        now += 1.0
        scripted.next = [f() for f in found]
        return engine.tick(view(t, now))

    hang = lambda: Incident(kind="hang", culprit_ranks=[1], summary="stuck", severity="high",  # noqa: E731
                            detected_mono=now + 1)
    [opened] = tick(mismatch)
    sidecar = types.SimpleNamespace(open={opened.id or "i": opened}, _open_keys={opened.key: opened.id or "i"},
                                    engine=engine, out=io.StringIO(), last_table=None, responder=None,
                                    gate=types.SimpleNamespace(decide=lambda record, step, gen: (True, None)),
                                    recovery=types.SimpleNamespace(note_fault=lambda record, table: None))
    revisions = Revisions(sidecar)
    revisions.add(opened.id or "i", revision(opened, groups("dataloader")), True)
    revisions.apply()
    assert opened.kind == "hang" and sidecar._open_keys == {"hang:1": opened.id or "i"}
    assert "REVISED collective_mismatch" in sidecar.out.getvalue()
    assert tick(mismatch) == [] and tick(mismatch) == []  # the mismatch detector still sees it: the same incident
    assert engine.take_confirmed() == []
    assert tick(mismatch, hang) == []  # the hang detector calls it past its threshold: no second incident...
    assert engine.take_confirmed() == [opened] and tick(hang) == [] and engine.take_confirmed() == []  # ...once
    set_rows(t, 1, step=11)
    assert tick() == []
    [done] = engine.take_resolved()
    assert done.incident is opened and done.reason == "its ranks made progress"


def test_a_revision_that_held_nothing_back_confirms_nothing():
    scripted = scripted_detector()
    engine = DetectorEngine([scripted])
    t = make_table(4, step=10)
    scripted.next = [mismatch()]
    [opened] = engine.tick(view(t, 101.0))
    old = opened.key
    opened.revise(revision(opened, groups("dataloader")))
    engine.revised(old, opened, "collective_mismatch", waits=False)
    scripted.next = [Incident(kind="hang", culprit_ranks=[1], summary="stuck", detected_mono=102.0)]
    assert engine.tick(view(t, 102.0)) == [] and engine.take_confirmed() == []


def test_a_provisional_hang_is_an_alert_and_the_gate_decides_the_rest():
    from trainwatch.watchdog.config import SidecarConfig

    asked = []
    sidecar = types.SimpleNamespace(config=SidecarConfig(), gate=types.SimpleNamespace(
        decide=lambda record, step, gen: asked.append(record["kind"]) or (True, None)))
    gate = Revisions(sidecar).gate
    hang = Incident(kind="hang", culprit_ranks=[0], summary="stuck", id="n-1-1", evidence={"provisional": True})
    restart, why = gate(hang, hang.to_json(), None, 0)
    assert not restart and "an alert for now" in why and asked == []
    hang.evidence = {"provisional": False, "firm": True}
    assert gate(hang, hang.to_json(), None, 0) == (True, None) and asked == ["hang"]
    hang.evidence, hang.scope = {"provisional": True}, "job"  # a job incident: the aggregator's fast call stands
    assert gate(hang, hang.to_json(), None, 0) == (True, None) and asked == ["hang", "hang"]
