"""Goodput accounting: a scripted timeline on an injected clock adds up to the
wall time exactly, each second in the bucket of its cause."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from util import events, trainwatch

from trainwatch.diagnostics.goodput import CAUSES, GoodputLedger, line_of


def scripted() -> GoodputLedger:
    g = GoodputLedger(started=1000.0)
    g.stepped(1010.0)  # 10 s of start-up
    g.stepped(1050.0)  # only the first counts
    # A hang: fault at 100 s, detected 5 s later, 2 s of stacks and checkpoint,
    # back to training at 115 s, 3 lost steps of 1 s re-run after it.
    g.opened("h1", "hang", detected=1105.0, fault=1100.0, restarting=True)
    g.requested("h1", 1107.0)
    g.resolved("h1", 1112.0)  # its new processes started: the restart goes on to their first step
    g.recovered("h1", 1115.0, recovery_s=15.0, recompute_s=3.0)
    g.resolved("h1", 1116.0)  # resolved by the progress after the restart: nothing more
    # A hang that passed by itself (a stall): 5 s to detect, 5 s hung.
    g.opened("h2", "hang", detected=1205.0, fault=1200.0)
    g.resolved("h2", 1210.0)
    # A crash of a script that numbers no steps: re-computation unknown.
    g.opened("c1", "crash", detected=1300.5, fault=1300.0, restarting=True)
    g.requested("c1", 1300.5)
    g.recovered("c1", 1306.0, recovery_s=6.0, recompute_s=None)
    # Alerts cost no time: the job trains through them.
    g.opened("s1", "straggler", detected=1350.0, fault=1340.0)
    return g


def test_a_scripted_timeline_adds_up_to_the_wall_time_exactly():
    gp = scripted().account(1400.0)
    assert gp.wall_s == 400.0
    assert gp.badput_s == {"startup": 10.0, "detection": 10.5, "capture_checkpoint": 2.0, "restart": 13.5,
                           "recompute": 3.0, "hung": 5.0}
    assert gp.productive_s == 356.0
    assert gp.productive_s + sum(gp.badput_s.values()) == gp.wall_s
    assert gp.ratio == 356.0 / 400.0
    assert gp.restarts == 2 and gp.recompute_unknown == 1
    # detection, capture and hung seconds per kind; restarts are their own bucket
    assert gp.by_kind == {"hang": (17.0, 2), "crash": (0.5, 1)}


def test_the_console_line_names_the_causes():
    line = scripted().account(1400.0).line()
    assert line.startswith("goodput 89.0% of 400 s: lost 17 s to 2 hangs, 0 s to 1 crash")
    assert "14 s to restarts" in line and "3 s of recomputed steps" in line and "10 s to start-up" in line
    assert "recomputed steps unknown after 1 restart" in line


def test_an_open_hang_costs_until_now_and_before_the_first_step_is_start_up():
    g = GoodputLedger(started=0.0)
    assert g.account(8.0).badput_s["startup"] == 8.0
    g.stepped(8.0)
    g.opened("h", "hang", detected=20.0, fault=15.0)
    gp = g.account(30.0)
    assert gp.badput_s["detection"] == 5.0 and gp.badput_s["hung"] == 10.0 and gp.productive_s == 7.0


def test_recompute_never_exceeds_the_productive_time_after_the_restart():
    g = GoodputLedger(started=0.0)
    g.stepped(0.0)
    g.opened("h", "hang", detected=10.0, fault=9.0)
    g.recovered("h", 12.0, recompute_s=100.0)
    gp = g.account(14.0)
    assert gp.badput_s["recompute"] == 2.0 and gp.productive_s == 0.0 + 9.0


def test_a_restart_of_an_incident_never_seen_counts_its_recovery_time():
    g = GoodputLedger(started=0.0)
    g.stepped(1.0)
    g.recovered("elsewhere", 50.0, recovery_s=4.0, recompute_s=0.0)
    assert g.account(60.0).badput_s["restart"] == 4.0


def test_live_counters_never_go_back():
    # An incident restarted: capture until the request, restart until the first
    # new step; each second stays in the bucket it was first counted in.
    g = GoodputLedger(started=0.0)
    g.stepped(2.0)
    seen = []
    for t, event in ((10.0, lambda: g.opened("h", "hang", detected=10.0, fault=6.0, restarting=True)),
                     (12.0, lambda: g.requested("h", 12.0)), (14.0, lambda: g.resolved("h", 14.0)),
                     (15.0, lambda: g.recovered("h", 15.0, recovery_s=9.0, recompute_s=1.0))):
        for now in (t - 0.5, t):
            seen.append(g.account(now).badput_s)
        event()
        seen.append(g.account(t).badput_s)
    seen.append(g.account(20.0).badput_s)
    for before, after in zip(seen, seen[1:]):
        assert all(after[c] >= before[c] for c in CAUSES), (before, after)
    assert seen[-1] == {"startup": 2.0, "detection": 4.0, "capture_checkpoint": 2.0, "restart": 3.0,
                        "recompute": 1.0, "hung": 0.0}


def test_a_record_read_from_a_file_of_the_wrong_shape_is_unknown():
    assert line_of({}) == "goodput unknown"
    assert line_of({"ratio": 1.0, "wall_s": 3, "by_kind": "x", "badput_s": [1]}) == "goodput 100.0% of 3 s"


_times = st.floats(min_value=0, max_value=1000, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["step", "open", "request", "resolve", "recover"]), _times, _times,
                          st.sampled_from(["hang", "crash", "straggler", "node_lost"]), st.integers(0, 3)),
                max_size=12), _times)
def test_any_sequence_of_events_adds_up_to_the_wall_time(events, now):
    g = GoodputLedger(started=0.0)
    for what, t1, t2, kind, n in events:
        if what == "step":
            g.stepped(t1)
        elif what == "open":
            g.opened(str(n), kind, detected=max(t1, t2), fault=min(t1, t2), restarting=n % 2 == 1)
        elif what == "request":
            g.requested(str(n), t1)
        elif what == "resolve":
            g.resolved(str(n), t1)
        else:
            g.recovered(str(n), t1, recovery_s=t2 / 10, recompute_s=None if n == 0 else t2)
    gp = g.account(now)
    assert set(gp.badput_s) == set(CAUSES)
    assert all(v >= 0 for v in gp.badput_s.values())
    assert gp.productive_s >= -1e-6
    assert math.isclose(gp.productive_s + sum(gp.badput_s.values()), gp.wall_s, abs_tol=1e-6)


@pytest.mark.slow
def test_a_real_job_with_one_hang_reports_badput_in_the_right_buckets(tmp_path):
    """2 gloo ranks of the integrated trainer, rank 1 hangs once at step 30 and
    the job restarts: the hang's seconds go to detection, capture and
    checkpoint and restart, each as long as the restart record's breakdown says;
    the console, telemetry.json and `diagnose` tell the same figure."""
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", "gp", "--inject",
                   "hang:where=compute,rank=1,step=30", "-m", "trainwatch.trainer", "--model-size", "tiny",
                   "--max-steps", "60", "--log-interval", "100", "--ckpt-interval", "25",
                   "--ckpt-dir", str(tmp_path / "ckpt"), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recorded = events(tmp_path, "gp")
    [hang] = [e for e in recorded if e.kind == "hang"]
    [restart] = [e for e in recorded if e.kind == "restart"]
    ev = restart.evidence
    gp = json.loads((tmp_path / "jobs" / "gp" / "telemetry.json").read_text())["goodput"]
    bad = gp["badput_s"]
    assert gp["productive_s"] + sum(bad.values()) == pytest.approx(gp["wall_s"], abs=0.01)
    assert bad["detection"] == pytest.approx(ev["breakdown"]["detect_s"], abs=0.05)
    # no progress for the threshold in force before it is called: the steady job's (1.5 s) at step 30
    assert bad["detection"] >= 1.4 and hang.evidence["threshold_s"] <= bad["detection"] + 0.2
    assert bad["capture_checkpoint"] == pytest.approx(
        ev["breakdown"]["capture_s"] + ev["breakdown"]["checkpoint_s"], abs=0.1)
    # fault to first new step: detection + capture and checkpoint + restart (the sidecar
    # sees the first new step at its next read, a tick after it happened)
    assert bad["detection"] + bad["capture_checkpoint"] + bad["restart"] == pytest.approx(ev["recovery_s"], abs=0.5)
    assert bad["hung"] == 0.0 and bad["startup"] > 0
    assert bad["recompute"] <= 1.0  # at most a step or two of a tiny model lost since the emergency checkpoint
    assert gp["by_kind"]["hang"]["incidents"] == 1 and gp["restarts"] == 1
    line = [x for x in r.stdout.splitlines() if "] goodput " in x]
    assert line and "to 1 hang" in line[-1] and "to restarts" in line[-1], r.stdout[-2000:]
    d = trainwatch(tmp_path, "diagnose", "gp", "--json")
    assert d.returncode == 0 and json.loads(d.stdout)["goodput"]["ratio"] == gp["ratio"]
    assert hang.culprit_ranks == [1]
