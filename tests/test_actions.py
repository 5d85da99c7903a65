"""What the sidecar does about an incident: restart decisions, told in words."""

from __future__ import annotations

import numpy as np
from slot_tables import make_table, set_rows

from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.records import Incident
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


def test_alert_only_mode_never_restarts_and_says_what_it_leaves():
    actions = RestartGate(ActionPolicy(restart=False), clock=Clock(), launcher_pid=4242)
    restart, why = actions.decide(hang(), 40, 0)
    assert not restart
    assert why == ("not restarting (--no-restart): the job stays as it is until stopped; stop it with Ctrl-C in the "
                   "launcher's terminal or `kill -TERM 4242` (the launcher)")
    assert actions.decide({"kind": "straggler", "culprit_ranks": [1]}, 40, 0) == (False, None)  # alert-only anyway


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


# ---- the response: the incident first, each action's result as it is done ------------------


def test_incident_is_said_first_and_each_action_result_as_it_is_done(tmp_path, monkeypatch):
    """The hang is printed and recorded at detection; the capture's verdict is
    recorded and said before the emergency checkpoint starts waiting, and the
    checkpoint's result before the restart is requested. Real segment, real
    processes as ranks (py-spy refuses them: not of this job), the real capture."""
    import io
    import subprocess
    import time
    import uuid

    from trainwatch import slots, state
    from trainwatch.watchdog.sidecar import Sidecar

    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    job = f"order-{uuid.uuid4().hex[:8]}"
    jd = state.JobDir(job).create()
    path = str(tmp_path / "seg")
    slots.create_segment(path, 2)
    seg = slots.Segment(path)
    ranks = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    out = io.StringIO()
    sc = Sidecar(job, path, node="n0", out=out, respond=True)
    sc.config.actions.emergency_timeout_s = 120.0  # rank 1 answers when the test says so
    try:
        ws = [SlotWriter(seg, i, pid=p.pid, rank=i, world_size=2, restart=0) for i, p in enumerate(ranks)]
        for w in ws:
            w.write_step(28, 1.0, 1.0, 0.1, 0.1, 1.0, 0.5, slots.PHASE_CODES["data"], 1.0, 0)
        ws[1].set_checkpoint_ready()
        record = sc.emit(Incident("hang", [0], summary="rank 0 made no progress", evidence={"step": 28},
                                  severity="high"))
        deadline = time.monotonic() + 60
        while not seg.read_control(1)[0]:  # the checkpoint request reached rank 1
            assert time.monotonic() < deadline, "rank 1 was never asked"
            time.sleep(0.01)
        lines = state.read_jsonl(jd.events_file)
        assert [(e["kind"], sorted(set(e) & {"capture", "verdict", "checkpoint", "restart"})) for e in lines] == [
            ("hang", ["restart"]),  # the incident, with the restart decision, at detection
            ("action", ["capture", "verdict"]),  # the capture's result, before the checkpoint waits
        ]
        said = out.getvalue()
        assert said.index("[trainwatch] INCIDENT hang") < said.index(f"hang {record['id']}: stacks of 2 rank(s)")
        assert "emergency checkpoint" not in said and "restart requested" not in said
        assert not jd.restart_request_file.exists()
        request = seg.read_control(1)[0]
        ws[1].write_checkpoint_status(request, slots.CKPT_OK, 28)
        assert sc.responder.drain(60)
        lines = state.read_jsonl(jd.events_file)
        assert [sorted(set(e) & {"capture", "checkpoint", "restart"}) for e in lines[2:]] == [["checkpoint"],
                                                                                              ["restart"]]
        assert lines[2]["checkpoint"]["written"] == {"1": 28} and lines[2]["checkpoint"]["no_state"] == [0]
        said = out.getvalue()
        assert said.index("emergency checkpoint of step 28 by 1 of 1 rank(s)") < said.index("restart requested")
        assert jd.restart_request_file.exists()
        [incident] = jd.incidents()
        assert incident.verdict and incident.checkpoint.step == 28 and incident.restart.requested
    finally:
        sc.responder.close()
        for p in ranks:
            p.kill()
            p.wait(timeout=10)


# ---- recovery accounting: the step a restarted script resumed from, or "unknown" ------------


def _generation(seg, restart: int):
    """Two ranks of one worker generation: real Telemetry handles on fresh slots."""
    from trainwatch.rank.telemetry import Telemetry

    tws = []
    for i in range(2):
        seg.clear(i)
        tws.append(Telemetry(seg, i, rank=i, world_size=2, restart=restart, attached=True))
    return tws


def _restart_after(tmp_path, monkeypatch, before, after) -> dict:
    """Gen 0 runs 149 steps with `before(tw, n)`, gen 1 one step with `after(tw)`;
    the restart incident the tracker says."""
    import time
    import uuid

    from trainwatch import slots, state
    from trainwatch.watchdog.recovery import RestartTracker

    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    jd = state.JobDir(f"acct-{uuid.uuid4().hex[:8]}").create()
    path = str(tmp_path / "seg")
    slots.create_segment(path, 2)
    seg = slots.Segment(path)
    tracker = RestartTracker(jd, time.monotonic)

    def live():
        table = seg.read_table()
        return table[table["pid"] > 0]

    for tw in _generation(seg, 0):
        for n in range(1, 150):
            before(tw, n)
    assert tracker.observe(live()) is None
    for tw in _generation(seg, 1):
        after(tw)
    incident = tracker.observe(live())
    assert incident is not None
    return incident.to_json()


def test_a_script_numbering_its_steps_says_where_it_resumed(tmp_path, monkeypatch):
    inc = _restart_after(tmp_path, monkeypatch, lambda tw, n: tw.step(loss=1.0, step=n),
                         lambda tw: tw.step(loss=1.0, step=141))
    assert inc["evidence"]["resumed_from_step"] == 140 and inc["evidence"]["steps_lost"] == 9
    assert "resumed from step 140 (lost 9 steps)" in inc["summary"]


def test_tw_step_without_numbers_claims_no_steps_lost(tmp_path, monkeypatch):
    """tw.step() with no step= counts from 1 in every process: after a restart
    that looked like "resumed from step 0 (lost 149 steps)" even when the script
    had loaded its own checkpoint of step 140."""
    inc = _restart_after(tmp_path, monkeypatch, lambda tw, n: tw.step(loss=1.0), lambda tw: tw.step(loss=1.0))
    assert inc["evidence"]["resumed_from_step"] is None and inc["evidence"]["steps_lost"] is None
    assert "steps lost unknown" in inc["summary"] and "lost 149" not in inc["summary"]


def test_zero_code_steps_claim_no_steps_lost(tmp_path, monkeypatch):
    """An unmodified script: the optimizer-step hook counts (as install_zero_code does)."""
    inc = _restart_after(tmp_path, monkeypatch, lambda tw, n: tw._record(1.0, None, None, None),
                         lambda tw: tw._record(1.0, None, None, None))
    assert inc["evidence"]["resumed_from_step"] is None and inc["evidence"]["steps_lost"] is None
    assert inc["evidence"]["last_step_before"] == 149
    assert "resumed; steps lost unknown: the script reports no step numbers" in inc["summary"]
    assert "restarted from its own checkpoint" in inc["summary"]
