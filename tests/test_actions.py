"""What the sidecar does about an incident: restart decisions, told in words."""

from __future__ import annotations

import numpy as np
from slot_tables import make_table, set_rows

from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.watchdog.checkpointing import request_emergency_checkpoint
from trainwatch.watchdog.exporter import StepHistogram
from trainwatch.watchdog.responder import ActionPolicy, RestartGate


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def hang(culprits=(2,), step=40):
    return {"kind": "hang", "culprit_ranks": list(culprits), "evidence": {"step": step}, "summary": "hang"}


def test_first_incident_restarts():
    actions = RestartGate(ActionPolicy(), clock=Clock())
    assert actions.decide(hang(), 40, 0) == (True, None)


def test_an_incident_during_a_restart_is_said_not_silently_dropped():
    clock = Clock(100.0)
    actions = RestartGate(ActionPolicy(), clock=clock)
    assert actions.decide(hang(), 40, 0)[0]
    clock.t += 12.5
    restart, why = actions.decide(hang(culprits=(1,)), 40, 0)
    assert not restart and "requested 12.5 s ago is under way" in why
    clock.t += 30
    assert actions.decide(hang(culprits=(1,)), 40, 0)[0]


def test_the_same_incident_at_the_same_step_after_a_restart_only_alerts():
    actions = RestartGate(ActionPolicy(), clock=Clock())
    assert actions.decide(hang(), 40, 0)[0]  # the request went out; the new generation came up within seconds
    restart, why = actions.decide(hang(), 40, 1)
    assert not restart
    assert "came back after restart 1" in why and "only alerts" in why
    # a different step, or a different culprit, is a new fault and restarts
    assert actions.decide(hang(step=55), 55, 1)[0]
    assert actions.decide(hang(culprits=(3,), step=55), 55, 2)[0]


def test_alert_only_mode_never_restarts():
    actions = RestartGate(ActionPolicy(restart=False), clock=Clock())
    assert actions.decide(hang(), 40, 0) == (False, None)


def test_low_severity_hardware_incident_only_alerts():
    actions = RestartGate(ActionPolicy(), clock=Clock())
    assert actions.decide({"kind": "xid", "severity": "medium"}, None, 0) == (False, None)
    assert actions.decide({"kind": "xid", "severity": "critical"}, None, 0) == (True, None)


def test_emergency_checkpoint_asks_only_ranks_with_state(tmp_path):
    from trainwatch import slots

    path = str(tmp_path / "seg")
    slots.create_segment(path, 2)
    seg = slots.Segment(path)
    for i in range(2):
        SlotWriter(seg, i, pid=1000 + i, rank=i, world_size=2, restart=0).write_step(
            3, 1.0, 1.0, 0.1, 0.1, 1.0, 0.5, 0, 1.0, 0)
    clock = Clock()
    result = request_emergency_checkpoint(seg, 10.0, clock=clock)
    assert result["requested"] == [] and "no rank registered state" in result["skipped"]
    assert clock.t == 0.0  # answered at once, no waiting for the timeout


def test_step_histogram_counts_every_step_once():
    hist = StepHistogram()
    t = make_table(2, now=10.0, step=1, step_s=0.1)
    hist.observe(t)
    set_rows(t, [0, 1], step=6, progress_mono=10.5)  # five steps between two reads
    hist.observe(t)
    set_rows(t, [0, 1], step=7, progress_mono=10.6, step_s=0.1)
    hist.observe(t)
    hist.observe(t)  # nothing new
    series = {rank: (cum, total) for rank, cum, total in hist.series()}
    assert set(series) == {0, 1}
    cumulative, total = series[0]
    assert cumulative[-1] == 6  # steps 2..7
    assert np.isclose(total, 0.6)
    set_rows(t, 0, pid=999, step=1, progress_mono=20.0)  # a restarted process starts over
    hist.observe(t)
    set_rows(t, 0, step=2, progress_mono=20.2, step_s=0.2)
    hist.observe(t)
    assert dict((r, c[-1]) for r, c, _ in hist.series())[0] == 7
