"""Emergency checkpoint requests wait for nothing that cannot come: ranks
without state are never asked, ranks that are gone, die or are stopped while
waited on are waited on no longer, and the timeout bounds only ranks that can
still answer. A real slot segment, real processes standing for the ranks (the
test answers for them through the rank side of the slot), a virtual clock."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from trainwatch import slots, state
from trainwatch.rank.slotwriter import SlotWriter
from trainwatch.watchdog.checkpointing import (
    EXITED,
    STOPPED,
    request_emergency_checkpoint,
)

TIMEOUT_S = 10.0
"""The request's bound, in virtual seconds: reaching it means the test waited for nothing."""


class VirtualClock:
    """Each reading advances 0.01 s; `at` runs an action once the clock reaches a time."""

    def __init__(self) -> None:
        self.t = 0.0
        self.actions: list[tuple[float, object]] = []

    def at(self, when: float, action) -> None:
        self.actions.append((when, action))

    def __call__(self) -> float:
        self.t += 0.01
        for item in [a for a in self.actions if a[0] <= self.t]:
            self.actions.remove(item)
            item[1]()
        return self.t


@pytest.fixture
def procs():
    """Real processes standing for ranks; every one is killed and reaped at the end."""
    started: list[subprocess.Popen] = []

    def spawn(*argv: str) -> subprocess.Popen:
        p = subprocess.Popen(list(argv or ("sleep", "600")))
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def segment(tmp_path, pids: list[int], ready: list[bool]) -> tuple[slots.Segment, list[SlotWriter]]:
    path = str(tmp_path / f"seg-{uuid.uuid4().hex[:8]}")
    slots.create_segment(path, len(pids))
    seg = slots.Segment(path)
    writers = []
    for i, (pid, has_state) in enumerate(zip(pids, ready)):
        w = SlotWriter(seg, i, pid=pid, rank=i, world_size=len(pids), restart=0)
        w.write_step(7, 1.0, 1.0, 0.1, 0.1, 1.0, 0.5, 0, 1.0, 0)
        if has_state:
            w.set_checkpoint_ready()
        writers.append(w)
    return seg, writers


def answer(seg: slots.Segment, writer: SlotWriter, index: int, step: int) -> None:
    """What the rank's background thread does once asked: write, then say so."""
    request, _done, _status, _step = seg.read_control(index)
    assert request, "the rank was not asked"
    writer.write_checkpoint_status(request, slots.CKPT_OK, step)


def wait_until(cond, timeout_s: float = 10.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return raw[raw.rindex(b")") + 2: raw.rindex(b")") + 3].decode()


def test_only_ranks_with_state_are_asked_and_the_others_are_named(tmp_path, procs):
    a, b = procs(), procs()
    seg, ws = segment(tmp_path, [a.pid, b.pid], [True, False])
    clock = VirtualClock()
    clock.at(0.05, lambda: answer(seg, ws[0], 0, 7))
    result = request_emergency_checkpoint(seg, TIMEOUT_S, clock=clock, poll_s=0.001)
    assert result["requested"] == [0] and result["no_state"] == [1]
    assert result["written"] == {"0": 7} and result["failed"] == {} and result["step"] == 7
    assert seg.read_control(1)[0] == 0  # never asked
    assert result["seconds"] < 1.0


def test_a_rank_already_gone_is_not_waited_for(tmp_path, procs):
    gone = procs("true")
    gone.wait(timeout=10)  # exited and reaped: its pid names no process
    seg, _ = segment(tmp_path, [gone.pid], [True])
    result = request_emergency_checkpoint(seg, TIMEOUT_S, clock=VirtualClock(), poll_s=0.001)
    assert result["failed"] == {"0": EXITED} and result["written"] == {}
    assert result["seconds"] < 1.0


def test_a_rank_that_dies_while_waited_on_stops_being_waited_for(tmp_path, procs):
    """Rank 1 is killed mid-wait and left a zombie (no one reaped it yet, as
    when its parent is slow): dead all the same. Rank 0 still gets its time."""
    a, b = procs(), procs()
    seg, ws = segment(tmp_path, [a.pid, b.pid], [True, True])
    clock = VirtualClock()

    def kill_rank_1() -> None:
        b.kill()
        wait_until(lambda: proc_state(b.pid) == "Z", what="rank 1 to be a zombie")

    clock.at(0.5, kill_rank_1)
    clock.at(1.0, lambda: answer(seg, ws[0], 0, 7))
    result = request_emergency_checkpoint(seg, TIMEOUT_S, clock=clock, poll_s=0.001)
    assert result["written"] == {"0": 7} and result["failed"] == {"1": EXITED}
    assert result["seconds"] < 2.0  # back once rank 0 answered: nothing left to wait for


def test_a_stopped_rank_is_not_waited_for(tmp_path, procs):
    stopped = procs()
    os.kill(stopped.pid, signal.SIGSTOP)
    wait_until(lambda: proc_state(stopped.pid) == "T", what="the rank to be stopped")
    seg, _ = segment(tmp_path, [stopped.pid], [True])
    result = request_emergency_checkpoint(seg, TIMEOUT_S, clock=VirtualClock(), poll_s=0.001)
    assert result["failed"] == {"0": STOPPED}
    assert result["seconds"] < 1.0


def test_the_timeout_bounds_a_rank_with_state_that_never_answers(tmp_path, procs):
    a, b = procs(), procs()
    seg, ws = segment(tmp_path, [a.pid, b.pid], [True, True])
    clock = VirtualClock()
    clock.at(0.2, lambda: answer(seg, ws[1], 1, 7))
    result = request_emergency_checkpoint(seg, TIMEOUT_S, clock=clock, poll_s=0.001)
    assert result["written"] == {"1": 7}
    assert result["failed"] == {"0": "did not answer (GIL held, stopped or dead)"}
    assert TIMEOUT_S <= result["seconds"] < TIMEOUT_S + 0.1


def test_agent_survivors_ask_only_ranks_with_state_and_say_what_was_written(tmp_path, procs):
    """The agent's early checkpoint when a rank died: local rank 0 exited, 1
    registered state and answers, 2 registered none and is neither asked nor
    waited for; the console says what the survivors wrote."""
    from torch.distributed.elastic.multiprocessing import subprocess_handler

    from trainwatch.launcher.agent import TrainwatchAgent

    handlers = {
        0: subprocess_handler.SubprocessHandler("sh", ("-c", "exit 3"), {}, None, None, 0, None),
        1: subprocess_handler.SubprocessHandler("sleep", ("600",), {}, None, None, 1, None),
        2: subprocess_handler.SubprocessHandler("sleep", ("600",), {}, None, None, 2, None),
    }
    try:
        wait_until(lambda: handlers[0].proc.poll() is not None, what="local rank 0 to exit")
        seg, ws = segment(tmp_path, [h.proc.pid for h in handlers.values()], [False, True, False])
        events: list = []
        job = state.JobDir("early", root=tmp_path).create()
        workers = [SimpleNamespace(local_rank=i, global_rank=10 + i) for i in range(3)]
        agent = SimpleNamespace(_survivors_saved=-1, restart_count=0, _first_failed=set(), segment=seg,
                                _pcontext=SimpleNamespace(subprocess_handlers=handlers), emergency_timeout_s=600.0,
                                _on_event=lambda kind, data: events.append((kind, data)), dir=job, node="n0",
                                run_id="r1", _worker_group=SimpleNamespace(workers=workers), _reported_early=set(),
                                _early_exits=set(), _finished=lambda lr: True)

        def exits_so_far():
            return [json.loads(line) for line in job.exits_file.read_text().splitlines()]

        def ask_after_the_exit_is_said():
            # The dead rank's exit is written before any survivor is asked to checkpoint.
            wait_until(lambda: seg.read_control(1)[0], 60, what="local rank 1 to be asked")
            said.extend(exits_so_far())
            answer(seg, ws[1], 1, 7)

        said: list = []
        rank = threading.Thread(target=ask_after_the_exit_is_said)
        rank.start()
        out = io.StringIO()
        with redirect_stdout(out):
            TrainwatchAgent._checkpoint_survivors(agent)
        rank.join(60)
        [(kind, result)] = events
        assert kind == "survivors_checkpointed" and agent._first_failed == {0}
        assert result["requested"] == [1] and result["no_state"] == [2] and result["written"] == {"1": 7}
        assert seg.read_control(2)[0] == 0
        assert "[trainwatch] survivors: emergency checkpoint of step 7 by 1 of 1 rank(s)" in out.getvalue()
        assert "rank(s) 2 registered no state, not asked" in out.getvalue()
        assert [(e["rank"], e["local_rank"], e["exitcode"], e["first"], e["run"]) for e in said] == [
            (10, 0, 3, True, "r1")]
        assert agent._reported_early == {handlers[0].proc.pid}
    finally:
        for h in handlers.values():
            if h.proc.poll() is None:
                h.proc.kill()
            h.proc.wait(timeout=10)


def test_agent_a_clean_exit_seen_with_its_peers_failure_is_the_early_leaver(tmp_path):
    """Local rank 1 left with exit 0 before finishing (os._exit(0)) and local
    rank 0 failed for want of it, both seen in the same poll: rank 1 is the one
    that left early (the culprit), rank 0's failure is not the first."""
    from torch.distributed.elastic.multiprocessing import subprocess_handler

    from trainwatch.launcher.agent import TrainwatchAgent

    handlers = {
        0: subprocess_handler.SubprocessHandler("sh", ("-c", "exit 1"), {}, None, None, 0, None),
        1: subprocess_handler.SubprocessHandler("sh", ("-c", "exit 0"), {}, None, None, 1, None),
    }
    wait_until(lambda: all(h.proc.poll() is not None for h in handlers.values()), what="both ranks to exit")
    job = state.JobDir("early-both", root=tmp_path).create()
    workers = [SimpleNamespace(local_rank=i, global_rank=10 + i) for i in range(2)]
    agent = SimpleNamespace(_survivors_saved=-1, restart_count=0, _first_failed=set(), segment=None,
                            _pcontext=SimpleNamespace(subprocess_handlers=handlers), emergency_timeout_s=600.0,
                            _on_event=lambda kind, data: None, dir=job, node="n0", run_id="r1",
                            _worker_group=SimpleNamespace(workers=workers), _reported_early=set(),
                            _early_exits=set(), _finished=lambda lr: False)
    TrainwatchAgent._checkpoint_survivors(agent)
    said = [json.loads(line) for line in job.exits_file.read_text().splitlines()]
    assert [(e["rank"], e["exitcode"], e["first"], e["early"]) for e in said] == [
        (11, 0, True, True), (10, 1, False, False)], said
