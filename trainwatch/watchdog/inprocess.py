"""The sidecar's side of in-process recovery (trainwatch.rank.inprocess): ask
every rank, through its slot, to break its collectives, re-form the process
group and restore its staged state from memory; wait for every rank to say
it did; say why not when the job cannot.

It is tried before a process restart for the faults that leave every rank
process alive and responsive (kinds.KindSpec.in_process: a collective
mismatch), on a single-node job whose every rank offered it (the integrated
trainer on gloo does), with every heartbeat fresh and no process stopped.
When it does not finish within the timeout, the incident's next action is
the process restart, as without it.
"""

from __future__ import annotations

import struct
import time
from typing import Callable

from trainwatch import slots
from trainwatch.diagnostics.culprit import HEARTBEAT_STALE_S


def ask(segment: slots.Segment, index: int, request_id: int) -> None:
    """Write a recovery request into a rank's slot."""
    struct.pack_into("<Q", segment.buf, segment.offset(index) + slots.R_OFF, request_id)


def answer(segment: slots.Segment, index: int) -> tuple[int, int, int, bool]:
    """(request id, done id, step restored, ready) of a rank's recovery channel."""
    req, done, step, ready = slots.RECOVERY.unpack_from(segment.buf, segment.offset(index) + slots.R_OFF)
    return req, done, step, ready == 1


def request_in_process(segment: slots.Segment, timeout_s: float, *, proc_state: Callable[[int], str | None],
                       clock: Callable[[], float] = time.monotonic, poll_s: float = 0.02) -> dict:
    """Ask every live rank to recover in its own process; wait up to timeout_s.

    Returns (recorded as the incident's `in_process` action):
      ok:      every rank re-formed its group and restored the same step;
      step:    the step restored (None unless ok);
      ranks:   global ranks asked;
      pending: ranks that had not answered (on timeout);
      seconds: how long it took;
      skipped: only when nobody was asked, why (then the restart follows at once)."""
    start = clock()
    table = segment.read_table()
    live = [int(i) for i in range(segment.nslots) if table["pid"][i] > 0]
    ranks = sorted(int(table["rank"][i]) for i in live)
    why = None
    now = time.monotonic()
    if not live:
        why = "no live rank"
    elif not all(answer(segment, i)[3] for i in live):
        why = "not every rank can recover in its own process (the integrated trainer on gloo can)"
    elif any(table["phase"][i] == slots.PHASE_CODES["done"] for i in live):
        why = "a rank already finished"
    elif any(not (now - table["heartbeat_mono"][i] <= HEARTBEAT_STALE_S) for i in live):
        why = "a rank's heartbeat stopped: it holds the GIL or is stopped"
    elif any(proc_state(int(table["pid"][i])) in ("stopped", "tracing-stop", "zombie", None) for i in live):
        why = "a rank process is stopped or gone"
    if why is not None:
        return {"ok": False, "step": None, "ranks": ranks, "seconds": round(clock() - start, 3), "skipped": why}
    request = int(time.time() * 1000)
    pids = {i: int(table["pid"][i]) for i in live}
    for i in live:
        ask(segment, i, request)
    pending = set(live)
    steps: set[int] = set()
    deadline = start + timeout_s
    while pending and clock() < deadline:
        time.sleep(poll_s)
        table = segment.read_table()
        for i in list(pending):
            if int(table["pid"][i]) != pids[i]:
                deadline = -1.0  # a rank process went away: the restart takes over
                break
            _req, done, step, _ready = answer(segment, i)
            if done == request:
                pending.discard(i)
                steps.add(step)
    ok = not pending and len(steps) == 1
    return {"ok": ok, "step": next(iter(steps)) if ok else None, "ranks": ranks,
            "pending": sorted(int(table["rank"][i]) for i in pending), "seconds": round(clock() - start, 3)}


def recovered_by(gate, goodput, tracker) -> Callable[[str | None, float, float], None]:
    """The responder's `recovered(incident, started, ended)`: no restart is under
    way (the restart gate), the time went to recovery (goodput), and no restart
    will come for that fault (the restart tracker)."""
    def recovered(incident: str | None, started: float, ended: float) -> None:
        gate.recovered()
        goodput.in_process(incident, started, ended)
        tracker.forget(incident)
    return recovered
