"""Emergency checkpoints on request: ask ranks, through their slots, to write
the state they staged at their last step; wait a bounded time; say who wrote
what. Used by the responder (before a restart) and by the agent (for the
survivors of a rank that died)."""

from __future__ import annotations

import time

from trainwatch import slots


def request_emergency_checkpoint(segment: slots.Segment, timeout_s: float, *, local_ranks: list[int] | None = None,
                                 alive=None, clock=time.monotonic, poll_s: float = 0.05) -> dict:
    """Ask ranks (through their slots) to write their staged state; wait up to timeout_s.

    Returns which ranks wrote (and the step), which did not and why. A rank
    that holds the GIL or is dead never answers: it is recorded, and the
    newest complete checkpoint from any rank is what the restart uses."""
    start = clock()
    table = segment.read_table()
    live = [int(i) for i in range(segment.nslots) if table["pid"][i] > 0]
    if local_ranks is not None:
        live = [i for i in live if i in local_ranks]
    # Only ranks that registered state can write anything: asking the others
    # would only wait out the timeout for an answer that never comes.
    targets = [i for i in live if table["ckpt_ready"][i]]
    if not targets:
        return {"requested": [], "written": {}, "failed": {}, "step": None, "seconds": round(clock() - start, 3),
                "skipped": "no rank registered state (trainwatch.init().register_state)"}
    new_id = int(time.time() * 1000)
    wanted: dict[int, int] = {}
    for i in targets:
        req, done, _status, _step = segment.read_control(i)
        if req and req != done:
            wanted[i] = req  # a write is already under way (agent and sidecar may both ask): wait for it
        else:
            segment.request_checkpoint(i, new_id)
            wanted[i] = new_id
    pending = set(targets)
    written: dict[int, int] = {}
    failed: dict[int, str] = {}
    while pending and clock() - start < timeout_s:
        for i in sorted(pending):
            gone = alive is not None and not alive(i)  # checked first: a write it finished still counts
            _req, done, status, step = segment.read_control(i)
            if gone and not (done == wanted[i] and status in (slots.CKPT_OK, slots.CKPT_FAILED)):
                pending.discard(i)
                failed[int(table["rank"][i])] = "exited before writing"
                continue
            if done == wanted[i] and status in (slots.CKPT_OK, slots.CKPT_FAILED):
                pending.discard(i)
                rank = int(table["rank"][i])
                if status == slots.CKPT_OK:
                    written[rank] = step
                else:
                    failed[rank] = "write failed"
        if pending:
            time.sleep(poll_s)
    for i in pending:
        _req, done, status, _step = segment.read_control(i)
        rank = int(table["rank"][i])
        writing = status == slots.CKPT_WRITING and done == wanted[i]
        failed[rank] = "still writing at the deadline" if writing else "did not answer (GIL held, stopped or dead)"
    return {
        "requested": sorted(int(table["rank"][i]) for i in targets),
        "written": {str(k): v for k, v in sorted(written.items())},
        "failed": {str(k): v for k, v in sorted(failed.items())},
        "step": max(written.values()) if written else None,
        "seconds": round(clock() - start, 3),
    }
