"""Stopped and zombie ranks are reported from their process state within a
second, as the same incidents the hang and exit detectors would raise later."""

from __future__ import annotations

import signal
import subprocess
import sys

from slot_tables import make_table, set_rows, view
from util import wait_for

from trainwatch import procctl, slots
from trainwatch.watchdog.detectors import ExitDetector, HangDetector, ProcessStateDetector
from trainwatch.watchdog.detectors.base import TickView
from trainwatch.watchdog.engine import DetectorEngine


def probed(table, now, states: dict[int, str]) -> TickView:
    v = view(table, now)
    v.proc_state = lambda pid: states.get(pid, "sleeping")
    return v


def test_a_stopped_rank_is_a_hang_after_the_confirm_time_once():
    det = ProcessStateDetector()
    t = make_table(4, now=100.0)
    stopped = {1002: "stopped"}
    assert det.check(probed(t, 100.0, stopped)) == []
    assert det.check(probed(t, 100.15, stopped)) == []
    [inc] = det.check(probed(t, 100.3, stopped))
    assert inc.kind == "hang" and inc.culprit_ranks == [2] and inc.victims == [0, 1, 3]
    assert inc.key == "hang:2" and inc.category == "stopped" and inc.runbook == "stopped"
    assert "pid 1002" in inc.summary and "stopped" in inc.summary
    assert inc.evidence["culprits"][2]["for_s"] == 0.3
    assert det.check(probed(t, 100.45, stopped)) == []  # reported once
    # continued, then stopped again: a new report
    assert det.check(probed(t, 101.0, {})) == []
    det.check(probed(t, 102.0, stopped))
    assert [i.kind for i in det.check(probed(t, 102.3, stopped))] == ["hang"]


def test_a_zombie_is_a_crash_with_the_exit_detectors_key():
    det = ProcessStateDetector()
    t = make_table(2, now=50.0)
    det.check(probed(t, 50.0, {1001: "zombie"}))
    [inc] = det.check(probed(t, 50.3, {1001: "zombie"}))
    assert inc.kind == "crash" and inc.culprit_ranks == [1] and inc.key == "crash:1@1001"
    assert inc.evidence["exits"][0]["state"] == "zombie"


def test_finished_ranks_a_short_zombie_and_no_probe_are_no_fault():
    det = ProcessStateDetector()
    t = set_rows(make_table(2, now=50.0), [1], phase="done")
    for now in (50.0, 50.5, 51.0):
        assert det.check(probed(t, now, {1001: "zombie"})) == []  # a worker that ended, not yet reaped
    t = make_table(2, now=50.0)
    assert det.check(probed(t, 60.0, {1001: "zombie"})) == []
    assert det.check(probed(t, 60.1, {})) == []  # reaped within the confirm time
    assert det.check(view(t, 70.0)) == [] and det.check(view(t, 71.0)) == []  # no probe: another node's pids


def test_the_hang_detectors_later_report_is_the_same_incident():
    engine = DetectorEngine([ExitDetector(), ProcessStateDetector(), HangDetector()])
    t = make_table(4, now=100.0, step=10, step_s=0.1)
    for k in range(1, 20):  # a healthy history
        t["step"] += 1
        t["progress_mono"] = t["phase_mono"] = t["heartbeat_mono"] = 100.0 + k * 0.1
        assert engine.tick(probed(t, 100.0 + k * 0.1, {})) == []
    stopped_at = 101.9
    opened = []
    for k in range(1, 80):  # rank 2 stopped; the others wait in backward with a live heartbeat
        now = stopped_at + k * 0.1
        t["phase"][[0, 1, 3]] = slots.PHASE_CODES["backward"]
        t["heartbeat_mono"][[0, 1, 3]] = now
        opened += [(round(now - stopped_at, 2), i.kind, i.key) for i in engine.tick(probed(t, now, {1002: "stopped"}))]
    assert opened == [(0.4, "hang", "hang:2")]  # within a second, and once (not again at the 5 s floor)


def test_a_real_stopped_process_reads_as_stopped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: procctl.process_state(proc.pid) == "stopped", 10, what="state T")
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: procctl.process_state(proc.pid) == "sleeping", 10, what="running again")
    finally:
        proc.kill()
        proc.wait()
    assert procctl.process_state(proc.pid) is None
