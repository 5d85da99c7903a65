"""In-process recovery (trainwatch.rank.inprocess, trainwatch.watchdog.inprocess):
real gloo ranks whose blocked collectives are broken, a process group formed
again on the same store, the newest step every rank staged agreed; the
sidecar's request and its reasons not to ask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainwatch import slots
from trainwatch.watchdog.inprocess import answer, request_in_process

SCRIPT = Path(__file__).resolve().parent / "scripts" / "inprocess_gloo.py"


def test_blocked_collectives_break_and_the_group_forms_again(tmp_path, free_tcp_port):
    seg = str(tmp_path / "ip.slots")
    slots.create_segment(seg, 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINWATCH_", "MASTER_", "RANK", "WORLD_"))}
    env["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(r), str(free_tcp_port), seg], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    logs = "\n".join(f"--- rank {r}: rc {p.returncode}\n{err[-2500:]}" for r, (p, (_, err)) in enumerate(zip(procs, results)))
    assert all(p.returncode == 0 for p in procs), logs
    outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    for o in outs:
        # what a dead peer looks like (which one depends on who cut first): handled alike
        assert o["error"] and any(w in o["error"].lower() for w in ("closed", "reset", "broken pipe")), o
        assert o["broke_s"] < 10, o  # gloo's own timeout is 30 min
        assert o["step"] == 11 and o["restored"] == [11], o  # the newest step both staged
        assert o["sum"] == [3.0, 3.0], o  # the new group works
        assert o["done"] == [7, 11] and o["wanted"] is False, o
        # No NCCL communicator to abort in a gloo job; a step that ends between the request
        # and the recovery is one the trainer must neither stage nor count.
        assert o["nccl_aborted"] == 0 and o["breaking"] == [False, True, False], o


def _live(seg_path, n, *, ready=True, heartbeat_age=0.0):
    from trainwatch.rank.slotwriter import SlotWriter

    segment = slots.Segment(seg_path)
    writers = []
    for i in range(n):
        w = SlotWriter(segment, i, pid=os.getpid(), rank=i, world_size=n, restart=0)
        w.write_step(5, 1.0, 1.0, 0.1, 0.1, 1.0, 0.5, slots.PHASE_CODES["collective"], 1.0, 0)
        w.write_sampler(time.monotonic() - heartbeat_age, False, 5, [], 0.0, 0)
        w.set_recover_ready(ready)
        writers.append(w)
    return segment, writers


def test_the_sidecar_asks_only_a_job_that_can_recover_in_its_processes(tmp_path):
    alive = lambda pid: "sleeping"  # noqa: E731
    for name, kwargs, state, why in (
            ("not-ready", {"ready": False}, alive, "not every rank"),
            ("stale", {"heartbeat_age": 5.0}, alive, "heartbeat stopped"),
            ("stopped", {}, lambda pid: "stopped", "stopped or gone")):
        seg = str(tmp_path / f"{name}.slots")
        slots.create_segment(seg, 2)
        segment, _ = _live(seg, 2, **kwargs)
        res = request_in_process(segment, 1.0, proc_state=state)  # refused before any wait
        assert res["ok"] is False and why in res["skipped"], res
        assert answer(segment, 0)[0] == 0  # nothing asked


def test_the_sidecar_waits_for_every_rank_and_names_those_that_did_not_answer(tmp_path):
    seg = str(tmp_path / "w.slots")
    slots.create_segment(seg, 3)
    segment, writers = _live(seg, 3)
    stop = threading.Event()

    def ranks_0_and_2():  # they answer each request they see; rank 1 never does
        while not stop.wait(0.005):
            for i in (0, 2):
                req, done, _, _ = answer(segment, i)
                if req and done != req:
                    writers[i].write_recover_done(req, 41)

    helper = threading.Thread(target=ranks_0_and_2, daemon=True)
    helper.start()
    try:
        res = request_in_process(segment, 1.0, proc_state=lambda pid: "sleeping", poll_s=0.01)
        assert res["ok"] is False and res["pending"] == [1] and res["ranks"] == [0, 1, 2], res
        assert [answer(segment, i)[1] for i in (0, 2)] == [answer(segment, 0)[0]] * 2
    finally:
        stop.set()
        helper.join(5)


def test_recovery_serves_the_request_its_sampler_has_not_seen_yet(tmp_path):
    """A peer cut first: this rank's collective failed before its own sampler
    round recorded the request; recover() must still form the group under that
    request's prefix (the one its peers use), never under another."""
    import pytest

    from trainwatch.rank.inprocess import InProcessRecovery, RecoveryFailed
    from trainwatch.rank.slotwriter import SlotWriter
    from trainwatch.watchdog.inprocess import ask

    seg = str(tmp_path / "r.slots")
    slots.create_segment(seg, 1)
    segment = slots.Segment(seg)
    recovery = InProcessRecovery(SlotWriter(segment, 0, pid=0, rank=0, world_size=1, restart=0),
                                 store_ports=set(), rank=0)
    with pytest.raises(RecoveryFailed, match="no in-process recovery was asked for"):
        recovery.recover(lambda prefix: None, lambda: [3], lambda step: None)
    ask(segment, 0, 7)
    prefixes = []

    def reform(prefix):
        prefixes.append(prefix)
        raise RuntimeError("the test stops here")

    with pytest.raises(RecoveryFailed, match="the test stops here"):
        recovery.recover(reform, lambda: [3], lambda step: None)
    assert prefixes == ["trainwatch/in-process/7"]


def test_the_sampler_sees_a_request_between_its_rounds(tmp_path, monkeypatch):
    """A rank that offers in-process recovery looks at its request word every POLL_S while it
    waits for its next sampler round, so a request is served within that, not within a round."""
    from trainwatch.rank import inprocess
    from trainwatch.rank.slotwriter import SlotWriter
    from trainwatch.watchdog.inprocess import ask

    monkeypatch.setattr(inprocess, "break_collectives", lambda keep: 0)  # nothing of this process to break
    seg = str(tmp_path / "r.slots")
    slots.create_segment(seg, 1)
    segment = slots.Segment(seg)
    recovery = inprocess.InProcessRecovery(SlotWriter(segment, 0, pid=0, rank=0, world_size=1, restart=0),
                                           store_ports=set(), rank=0)
    stop = threading.Event()
    waiter = threading.Thread(target=recovery.wait_round, args=(stop, 60.0))
    waiter.start()
    try:
        ask(segment, 0, 7)
        deadline = time.monotonic() + 10.0
        while not recovery.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        assert recovery.pending == 7  # within the round's 60 s wait
    finally:
        stop.set()
        waiter.join(5)
    assert not waiter.is_alive()
