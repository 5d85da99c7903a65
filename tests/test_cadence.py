"""The sidecar's cadence: a round every tick while something develops, every
few ticks while the job is healthy, with a glance in between that brings the
round forward for an exit, a restart or a stopped rank, and keeps the samples
the straggler needs. Real slot segments, real processes for the process
states; time is injected."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from slot_tables import make_table
from trainwatch import procctl, slots, state
from trainwatch.watchdog.cadence import Cadence, between, glance
from trainwatch.watchdog.config import SidecarConfig
from trainwatch.watchdog.detectors.straggler import StragglerDetector
from trainwatch.watchdog.detectors.base import TickView
from trainwatch.watchdog.sidecar import Sidecar

from util import Clock, wait_for


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(30)


@pytest.fixture
def sidecar(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    state.JobDir("cad").create()
    path = str(tmp_path / "seg")
    slots.create_segment(path, 4)
    clock = Clock(1000.0)
    sc = Sidecar("cad", path, node="n0", clock=clock, out=io.StringIO())
    yield sc, path, clock
    sc.close()
    sc.segment.close()


def fill(path: str, table: np.ndarray) -> None:
    seg = slots.Segment(path)
    np.frombuffer(seg.buf, dtype=slots.slot_dtype(), count=len(table), offset=slots.HEADER_SIZE)[:] = table
    seg.close()


def test_busy_rounds_every_tick_quiet_rounds_every_few_with_a_glance_between():
    c = Cadence(0.15, 4)
    assert c.due(lambda: pytest.fail("no glance while busy")) and c.interval() == 0.15
    c.busy = False
    assert c.interval() == pytest.approx(0.3)  # half of 4 ticks: the glance, then the round
    glances = []
    assert not c.due(lambda: glances.append(1) or False)
    assert c.due(lambda: pytest.fail("the round after a glance does not glance"))
    assert not c.due(lambda: False) and glances == [1]
    assert c.due(lambda: False)
    assert c.due(lambda: True)  # a glance that saw something: the round now
    assert Cadence(0.15, 1).interval() == 0.15 and Cadence(0.15, 1).due(lambda: False)


def test_fast_until_every_rank_was_seen_stepping():
    c = Cadence(0.15, 4)
    assert c.fast(make_table(0))  # nobody attached yet
    t = make_table(4, step=0)
    assert c.fast(t)  # not stepped yet
    t["step"] = 5
    assert c.fast(t)  # first seen stepping: their start's floors and baselines come from these rounds
    t["step"] = 9
    assert not c.fast(t)
    bigger = make_table(5, step=9)
    assert c.fast(bigger)  # a rank joined


def test_glance_sees_an_exit_record_a_restart_and_a_stopped_rank(sidecar, sleeper):
    sc, path, clock = sidecar
    t = make_table(4, now=clock.t, step=3)
    t["pid"] = sleeper.pid
    fill(path, t)
    sc.tick()
    assert not glance(sc)
    os.kill(sleeper.pid, signal.SIGSTOP)
    wait_for(lambda: procctl.process_state(sleeper.pid) == "stopped", 10, what="the rank stopped")
    assert glance(sc)
    os.kill(sleeper.pid, signal.SIGCONT)
    wait_for(lambda: procctl.process_state(sleeper.pid) != "stopped", 10, what="the rank running again")
    assert not glance(sc)
    with open(sc.dir.exits_file, "a") as f:
        f.write('{"rank": 1}\n')
    assert glance(sc)
    sc.tick()  # the round reads it
    assert not glance(sc)
    sc.dir.restarting_file.parent.mkdir(parents=True, exist_ok=True)
    sc.dir.restarting_file.touch()
    assert glance(sc)


def test_between_rounds_the_straggler_keeps_every_steps_compute(sidecar):
    """Rounds see every third step only; the glances between them sample the
    rest, so the straggler's window is as full as with a round every step."""
    sc, path, clock = sidecar
    det = sc.engine.detector("straggler")
    t = make_table(4, now=clock.t, step=1, compute_s=0.3)
    for step in range(1, 31):
        clock.t += 0.1
        t["step"] = t["sampled_step"] = step
        t["progress_mono"] = clock.t
        fill(path, t)
        if step % 3 == 0:
            sc.tick()
        else:
            assert not between(sc)
    window = det._compute.matrix(np.arange(4), np.arange(21, 31))
    assert np.isfinite(window).all()


def test_straggler_sampling_leaves_the_verdict_of_a_round_every_step_unchanged():
    dense, sparse = StragglerDetector(), StragglerDetector()
    t = make_table(4, step=1, compute_s=0.2)
    found = {"dense": [], "sparse": []}
    for step in range(1, 80):
        now = 100.0 + step * 0.5
        t["step"] = step
        t["compute_s"] = [0.2, 0.2, 0.2 if step < 20 else 0.5, 0.2]
        t["progress_mono"] = now
        v = TickView(now=now, table=t.copy())
        found["dense"] += [i.culprit_ranks for i in dense.check(v)]
        if step % 3:
            sparse.sample(v)
        else:
            found["sparse"] += [i.culprit_ranks for i in sparse.check(v)]
    assert [2] in found["dense"] and [2] in found["sparse"]


def test_process_states_reader_follows_a_process_through_its_states(sleeper):
    states = procctl.ProcessStates()
    try:
        assert states(sleeper.pid) in ("running", "sleeping")
        os.kill(sleeper.pid, signal.SIGSTOP)
        assert wait_for(lambda: states(sleeper.pid) == "stopped", 10, what="stopped")
        os.kill(sleeper.pid, signal.SIGCONT)
        os.kill(sleeper.pid, signal.SIGKILL)
        assert wait_for(lambda: states(sleeper.pid) == "zombie", 10, what="a zombie until reaped")
        sleeper.wait(10)
        assert states(sleeper.pid) is None  # gone: its file no longer reads
        assert states(2**22 + 12345) is None
    finally:
        states.close()


def test_a_healthy_job_gets_fewer_rounds_than_ticks_and_a_stalled_one_every_tick(sidecar):
    """The loop on a real clock: ranks that keep stepping are quiet (a round every
    4 ticks) once the baselines are learnt; once a rank's progress is older than
    half its hang threshold the hang detector is busy and every tick is a round."""
    sc, path, _clock = sidecar

    sc.clock = time.monotonic
    sc.config = SidecarConfig(tick_s=0.01, quiet_ticks=4)
    t = make_table(4, now=time.monotonic(), step=5, step_s=0.05)
    t["pid"] = os.getpid()
    fill(path, t)
    rounds, stop = [], threading.Event()
    sc.tick_started = rounds.append
    loop = threading.Thread(target=sc.run, args=(stop,))
    loop.start()
    try:
        steps, deadline, quiet = 5, time.monotonic() + 60, None
        while time.monotonic() < deadline:  # the ranks step every 10 ms; the baselines fill
            steps += 1
            t["step"] = t["sampled_step"] = steps
            t["progress_mono"] = t["heartbeat_mono"] = time.monotonic()
            fill(path, t)
            time.sleep(0.01)
            if len(rounds) > 20 and np.median(np.diff(rounds[-10:])) >= 0.03:
                quiet = np.diff(rounds[-10:])
                break
        assert quiet is not None, "the cadence never went quiet"
        fill_stalled = t.copy()
        fill_stalled["progress_mono"] = time.monotonic() - 10.0  # past half of any threshold
        fill(path, fill_stalled)
        n = len(rounds)
        wait_for(lambda: len(rounds) >= n + 30, 30, what="rounds of a stalled job")
        busy = np.diff(rounds[-20:])
    finally:
        stop.set()
        loop.join(30)
    assert np.median(quiet) >= 0.03  # every 4 ticks of 10 ms
    assert np.median(busy) <= 0.02  # every tick
