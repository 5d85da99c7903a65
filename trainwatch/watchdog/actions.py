"""What the sidecar does about an incident: capture, diagnose, checkpoint, restart.

Order matters: stacks first (the evidence disappears with the processes), then
the emergency checkpoint (the state disappears with them too), then the
restart request, which the agent carries out through torchelastic.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from trainwatch import slots, state

log = logging.getLogger("trainwatch.sidecar")

CAPTURE_KINDS = frozenset({"hang", "collective_mismatch"})
"""Incidents that trigger an all-rank stack capture and a verdict."""
RESTART_KINDS = frozenset({"hang", "collective_mismatch", "xid", "ecc"})
"""Incidents the sidecar restarts the job for. Crashes restart through
torchelastic directly (the agent sees the exit); stragglers and loss
incidents only alert: restarting would not fix them and would lose work."""


@dataclass(kw_only=True, slots=True)
class ActionPolicy:
    """Which incidents restart the job, and how long checkpoints may take."""

    restart: bool = True
    """False = alert-only mode (`--no-restart`)."""
    restart_kinds: frozenset = field(default_factory=lambda: RESTART_KINDS)
    """Incident kinds that lead to an emergency checkpoint and a restart."""
    capture: bool = True
    """Capture stacks of every rank on hang/mismatch incidents."""
    capture_timeout_s: float = 5.0
    """Hard bound on one rank's py-spy dump."""
    emergency_timeout_s: float = 10.0
    """How long ranks get to write their emergency checkpoint."""
    min_severity_restart: str = "high"
    """Hardware incidents below this severity only alert."""


_SEVERITY = {"info": 0, "low": 1, "medium": 2, "high": 3, "critical": 4}
RESTART_IN_FLIGHT_S = 30.0
"""After a restart request, further incidents are recorded, said, and not acted on this long (s)."""


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks) or "-"


def _generation(sidecar: Any) -> int:
    table = getattr(sidecar, "last_table", None)
    return int(table["restart"].max()) if table is not None and len(table) else 0


def _step_of(sidecar: Any, record: dict) -> int | None:
    """The step an incident happened at: its evidence's, else its culprits' lowest."""
    step = (record.get("evidence") or {}).get("step")
    if isinstance(step, int):
        return step
    table = getattr(sidecar, "last_table", None)
    culprits = record.get("culprit_ranks") or []
    if table is None or not len(table) or not culprits:
        return None
    import numpy as np

    rows = table[np.isin(table["rank"], culprits)]
    return int(rows["step"].min()) if len(rows) else None


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


class IncidentActions:
    def __init__(self, policy: ActionPolicy, clock=time.monotonic):
        self.policy = policy
        self.clock = clock
        self.restart_requested_at: float | None = None
        self._last_cause: tuple | None = None
        """(kind, culprits, step, generation) of the incident the last restart was for."""

    def handle(self, sidecar: Any, incident: Any, record: dict) -> dict:
        kind = record.get("kind")
        extra: dict = {}
        if self.policy.capture and kind in CAPTURE_KINDS:
            extra.update(self.capture(sidecar, record))
        restart, why = self.restart_decision(record, _step_of(sidecar, record), _generation(sidecar))
        if why:
            extra["restart"] = {"requested": False, "why": why}
        if restart:
            t0 = time.monotonic()
            extra["checkpoint"] = request_emergency_checkpoint(sidecar.segment, self.policy.emergency_timeout_s)
            t1 = time.monotonic()
            extra["restart"] = self.request_restart(sidecar, record)
            sidecar.note_fault(
                record,
                capture_s=(extra.get("capture") or {}).get("seconds", 0.0),
                checkpoint_s=round(t1 - t0, 3),
                requested_mono=time.monotonic(),
            )
        return extra

    def restart_decision(self, record: dict, step: int | None, generation: int) -> tuple[bool, str | None]:
        """(restart?, why not, when worth saying). Pure apart from the clock."""
        kind = record.get("kind")
        if not self.policy.restart or kind not in self.policy.restart_kinds:
            return False, None
        if kind in ("xid", "ecc"):
            if _SEVERITY.get(record.get("severity", "medium"), 2) < _SEVERITY[self.policy.min_severity_restart]:
                return False, None
        # One restart request per episode: the agent is already tearing down.
        # Once the new worker generation is up, that restart is over.
        if self.restart_requested_at is not None and self._last_cause is not None and generation > self._last_cause[3]:
            self.restart_requested_at = None
        if self.restart_requested_at is not None:
            ago = self.clock() - self.restart_requested_at
            if ago < RESTART_IN_FLIGHT_S:
                return False, f"not restarting again: the restart requested {ago:.1f} s ago is under way"
        cause = (kind, tuple(record.get("culprit_ranks") or ()), step, generation)
        last = self._last_cause
        if last is not None and cause[:3] == last[:3] and step is not None and generation > last[3]:
            return False, (
                f"not restarting: the same {kind} (culprit {_ranks(cause[1])} at step {step}) came back after "
                f"restart {generation}; restarting again would replay it, so trainwatch only alerts now "
                f"(fix the cause, then relaunch)"
            )
        self._last_cause = cause
        return True, None

    def capture(self, sidecar: Any, record: dict) -> dict:
        from trainwatch.diagnostics.capture import capture_all, capture_dir
        from trainwatch.diagnostics.stacks import group_stacks
        from trainwatch.diagnostics.verdict import decide

        t0 = time.monotonic()
        sidecar.read()
        rows = sidecar.snapshot()
        pids = {int(r["rank"]): int(r["pid"]) for r in rows}
        out_dir = capture_dir(sidecar.job_dir, str(record.get("kind")))
        caps = capture_all(pids, timeout_s=self.policy.capture_timeout_s, out_dir=out_dir, job=sidecar.job)
        groups = group_stacks({rank: c.stack for rank, c in caps.items()})
        for r in rows:
            c = caps.get(r["rank"])
            r["state"] = (c.process_state or "gone") if c else None
            r["capture_error"] = c.stack.error if c else None
            g0 = r["groups"][0] if r.get("groups") else None
            r["collectives"] = {
                "enqueued": g0["enqueued"] if g0 else None,
                "completed": g0["completed"] if g0 else None,
                "last_op": (g0["last_op"] or None) if g0 else None,
            }
        v = decide(rows, groups, sidecar.incidents + [record], [])
        seconds = round(time.monotonic() - t0, 3)
        return {
            "capture": {
                "dir": str(out_dir),
                "seconds": seconds,
                "ranks": len(caps),
                "failed": {str(k): c.stack.error for k, c in caps.items() if c.stack.error},
            },
            "stack_groups": [
                {"ranks": list(g.ranks), "category": g.category, "pattern": g.pattern_id, "frames": list(g.frames[:5])}
                for g in groups
            ],
            "verdict": v.to_json(),
        }

    def request_restart(self, sidecar: Any, record: dict) -> dict:
        self.restart_requested_at = self.clock()
        table = sidecar.last_table
        request = {
            "reason": f"{record.get('kind')}: {record.get('summary', '')}",
            "kind": record.get("kind"),
            "time": time.time(),
            # The worker generation this is about: a request that arrives after the
            # agent already restarted for another reason must not restart again.
            "generation": int(table["restart"].max()) if table is not None and len(table) else 0,
        }
        state.write_json_atomic(sidecar.job_dir / "control" / "restart-request.json", request)
        return {"requested": True}
