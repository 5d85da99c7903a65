"""Emergency checkpoints on request: ask ranks, through their slots, to write
the state they staged at their last step; wait a bounded time; say who wrote
what. Used by the responder (before a restart) and by the agent (for the
survivors of a rank that died).

Nothing is waited for that cannot come: a rank that registered no state
(`ckpt_ready` unset in its slot: an unmodified script) is never asked, a
request that finds no such rank returns at once with a `skipped` reason, and
a rank that exits or is stopped while it is waited on stops being waited for.
The timeout bounds only ranks that have state and can still answer."""

from __future__ import annotations

import os
import time

from trainwatch import procctl, slots

_FINAL = (slots.CKPT_OK, slots.CKPT_FAILED)
_PROC = os.path.isdir("/proc/self")
EXITED = "exited before writing"
STOPPED = "stopped (SIGSTOP, job control): it cannot answer until continued"


def request_emergency_checkpoint(segment: slots.Segment, timeout_s: float, *, local_ranks: list[int] | None = None,
                                 alive=None, clock=time.monotonic, poll_s: float = 0.05) -> dict:
    """Ask ranks (through their slots) to write their staged state; wait up to timeout_s.

    local_ranks: only these slots (None: every live slot). alive(slot) -> bool:
    the caller's own word that a rank's process still runs (the agent polls its
    children); the slot's pid is checked on this machine in any case.

    Returns (recorded as an incident's `checkpoint`):
      requested: global ranks asked (those that registered state), sorted;
      no_state:  global ranks never asked: they registered no state;
      written:   {rank (str): step} of every rank that wrote its checkpoint;
      failed:    {rank (str): why} of every rank asked that did not write;
      step:      the newest step written (None: nothing was written);
      seconds:   how long the request took;
      skipped:   only when nobody was asked, why (then nothing was waited for).
    A rank that holds the GIL never answers: it is recorded, and the newest
    complete checkpoint from any rank is what the restart uses."""
    start = clock()
    table = segment.read_table()
    live = [int(i) for i in range(segment.nslots) if table["pid"][i] > 0]
    if local_ranks is not None:
        live = [i for i in live if i in local_ranks]
    # Only ranks that registered state can write anything: asking the others
    # would only wait out the timeout for an answer that never comes.
    targets = [i for i in live if table["ckpt_ready"][i]]
    no_state = sorted(int(table["rank"][i]) for i in live if not table["ckpt_ready"][i])
    if not targets:
        why = "no rank registered state (trainwatch.init().register_state)" if live else "no live rank to ask"
        return {"requested": [], "no_state": no_state, "written": {}, "failed": {}, "step": None,
                "seconds": round(clock() - start, 3), "skipped": why}
    new_id = int(time.time() * 1000)
    wanted: dict[int, int] = {}
    for i in targets:
        req, done, _status, _step = segment.read_control(i)
        if req and req != done:
            wanted[i] = req  # a write is already under way (agent and sidecar may both ask): wait for it
        else:
            segment.request_checkpoint(i, new_id)
            wanted[i] = new_id

    def cannot_answer(i: int) -> str | None:
        if alive is not None and not alive(i):
            return EXITED
        return _pid_cannot_answer(int(table["pid"][i]))

    pending = set(targets)
    written: dict[int, int] = {}
    failed: dict[int, str] = {}
    while True:
        for i in sorted(pending):
            why = cannot_answer(i)  # checked first: a write it finished before it went still counts
            _req, done, status, step = segment.read_control(i)
            rank = int(table["rank"][i])
            if done == wanted[i] and status in _FINAL:
                pending.discard(i)
                if status == slots.CKPT_OK:
                    written[rank] = step
                else:
                    failed[rank] = "write failed"
            elif why is not None:
                pending.discard(i)
                failed[rank] = why
        if not pending or clock() - start >= timeout_s:
            break
        time.sleep(poll_s)
    for i in pending:
        _req, done, status, _step = segment.read_control(i)
        rank = int(table["rank"][i])
        writing = status == slots.CKPT_WRITING and done == wanted[i]
        failed[rank] = "still writing at the deadline" if writing else "did not answer (GIL held, stopped or dead)"
    return {
        "requested": sorted(int(table["rank"][i]) for i in targets),
        "no_state": no_state,
        "written": {str(k): v for k, v in sorted(written.items())},
        "failed": {str(k): v for k, v in sorted(failed.items())},
        "step": max(written.values()) if written else None,
        "seconds": round(clock() - start, 3),
    }


def _pid_cannot_answer(pid: int) -> str | None:
    """Why the process `pid` on this machine cannot answer a request (gone, a
    zombie, stopped), or None. Without /proc only its existence is checked."""
    if not _PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return EXITED
        except OSError:
            pass
        return None
    pstate = procctl.process_state(pid)
    if pstate in (None, "zombie"):
        return EXITED
    # T only: a tracing stop (t) is py-spy sampling it for a moment.
    return STOPPED if pstate == "stopped" else None


def describe(ck: dict) -> str:
    """A request's result in words (part of a console line)."""
    if ck.get("skipped"):
        return f"no emergency checkpoint ({ck['skipped']})"
    written, requested = ck.get("written") or {}, ck.get("requested") or []
    if written:
        text = (f"emergency checkpoint of step {ck.get('step')} by {len(written)} of {len(requested)} rank(s) "
                f"in {ck.get('seconds')}s")
    else:
        text = f"no emergency checkpoint written by the {len(requested)} rank(s) asked, in {ck.get('seconds')}s"
    failed = ck.get("failed") or {}
    if failed:
        text += " (" + "; ".join(f"rank {r}: {why}" for r, why in failed.items()) + ")"
    if ck.get("no_state"):
        text += f"; rank(s) {','.join(map(str, ck['no_state']))} registered no state, not asked"
    return text
