"""What happens about an incident, off the detection loop: capture, verdict,
emergency checkpoint, restart request.

The sidecar's tick only detects: an incident is printed and recorded the
moment it is found, then handed here with what the tick knew (`Response`).
One worker thread works through them, so detection, the history and the
exporter keep running during a capture and checkpoint that take seconds.
Each action's result is appended to events.jsonl as it finishes (an `action`
record naming the incident's id; JobDir.incidents() merges them).

Order matters: stacks first (the evidence disappears with the processes), then
the emergency checkpoint (the state disappears with them too), then the
restart request, which the agent carries out through torchelastic.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from trainwatch import codec, kinds, messages, rankrow, records, slots, state
from trainwatch.capture import capture_ranks
from trainwatch.procctl import process_state
from trainwatch.diagnostics.revise import past_threshold, revision
from trainwatch.diagnostics.verdict import decide
from trainwatch.watchdog.checkpointing import describe as describe_checkpoint
from trainwatch.watchdog.checkpointing import request_emergency_checkpoint
from trainwatch.watchdog.config import ActionPolicy
from trainwatch.watchdog.inprocess import request_in_process
from trainwatch.usage import printable

log = logging.getLogger("trainwatch.sidecar")

CAPTURE_KINDS = kinds.CAPTURE_KINDS
IN_PROCESS_KINDS = kinds.IN_PROCESS_KINDS
"""Incidents that trigger an all-rank stack capture and a verdict."""
RESTART_IN_FLIGHT_S = 30.0
"""After a restart request, further incidents are recorded, said, and not acted on this long (s)."""
_SEVERITY = {"info": 0, "low": 1, "medium": 2, "high": 3, "critical": 4}


class RestartGate:
    """Whether an incident restarts the job: policy, one request per episode,
    and never the same fault at the same step twice in a row."""

    def __init__(self, policy: ActionPolicy, clock: Callable[[], float] = time.monotonic,
                 launcher_pid: int | None = None):
        self.policy = policy
        self.clock = clock
        self.launcher_pid = launcher_pid
        """The launcher's pid: what to signal to stop a job that is not restarted."""
        self.requested_at: float | None = None
        self._last_cause: tuple | None = None
        """(kind, culprits, step, generation) of the incident the last restart was for."""

    def decide(self, record: dict, step: int | None, generation: int) -> tuple[bool, str | None]:
        """(restart?, why not, when worth saying)."""
        kind = record.get("kind")
        if kind not in self.policy.restart_kinds:
            return False, None
        if kind in kinds.HARDWARE_KINDS:
            if _SEVERITY.get(record.get("severity", "medium"), 2) < _SEVERITY[self.policy.min_severity_restart]:
                return False, None
        if not self.policy.restart:
            # Said, or the console goes quiet while the job stays hung or broken.
            stop = f"`kill -TERM {self.launcher_pid}` (the launcher)" if self.launcher_pid else \
                "`kill -TERM` the launcher (job.json's launcher_pid)"
            return False, (f"not restarting (--no-restart): the job stays as it is until stopped; stop it with "
                           f"Ctrl-C in the launcher's terminal or {stop}")
        # One restart request per episode: the agent is already tearing down.
        # Once the new worker generation is up, that restart is over.
        if self.requested_at is not None and self._last_cause is not None and generation > self._last_cause[3]:
            self.requested_at = None
        if self.requested_at is not None:
            ago = self.clock() - self.requested_at
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
        self.requested_at = self.clock()
        return True, None

    def recovered(self) -> None:
        """The incident was recovered inside the running ranks: no restart is under way."""
        self.requested_at = None


@dataclass(slots=True)
class Response:
    """One incident to act on, with what the detecting tick knew."""

    record: dict
    """The incident as recorded (with its id)."""
    restart: bool
    """Decided at detection: request a restart once the evidence and state are saved."""
    generation: int
    """The worker generation the incident is about."""
    span: Any = None
    """The incident's OpenTelemetry span, opened at detection."""


@dataclass(kw_only=True, slots=True)
class ResponderContext:
    """What the responder needs of the job, passed in explicitly."""

    job: state.JobDir
    segment: slots.Segment
    node: str
    run: str
    """This run's id: the agent only obeys requests of its own run."""
    incidents: Callable[[], list[records.Incident]]
    """The job's open incidents (for the verdict)."""
    thresholds: Callable[[], dict] = dict
    """The hang thresholds in force (for the verdict, as telemetry.json has them)."""
    add_timings: Callable[..., None]
    """Tell the restart tracker how long the capture and checkpoint took."""
    out: Any
    tracer: Any = None
    single_node: bool = True
    """In-process recovery asks this node's ranks only: a multi-node job restarts."""
    recovered: Callable[[str | None, float, float], None] = lambda incident, started, ended: None
    """Say that an incident was recovered inside its ranks, from when to when (the restart gate, goodput)."""
    revised: Callable[[str | None, records.Revision | None, bool], None] = lambda incident, revision, held: None
    """Say that the stacks revised an incident (the sidecar's open incident, the engine's condition), and
    whether its restart is held back until the new kind's own detector calls it."""
    withdrawn: Callable[[str | None], None] = lambda incident: None
    """Say that the restart decided at detection will not be requested (the restart gate)."""


class Responder:
    """A worker thread that captures, judges, checkpoints and asks for restarts."""

    def __init__(self, policy: ActionPolicy, ctx: ResponderContext):
        self.policy = policy
        self.ctx = ctx
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()

    def submit(self, response: Response) -> None:
        self._idle.clear()
        self._queue.put(response)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainwatch-responder", daemon=True)
            self._thread.start()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted incident was handled; False on timeout."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            response = self._queue.get()
            if response is None:
                return
            try:
                self.respond(response)
            except Exception:  # one failed response must not end the responder
                log.exception("trainwatch: responding to %s failed", response.record.get("kind"))
            finally:
                if self._queue.empty():
                    self._idle.set()

    def respond(self, response: Response) -> dict:
        """Run the incident's actions in order. The incident itself was printed
        and recorded at detection (Sidecar.emit); each action's result is
        appended (an `action` record) and said as soon as that action is done,
        so a slow checkpoint never hides the verdict that came before it."""
        record, ctx = response.record, self.ctx
        kind = record.get("kind")
        results: dict = {}

        def done(part: dict) -> None:
            results.update(part)
            ctx.job.append_event({"kind": "action", "incident": record.get("id"), "time": time.time(), **part})
            print(printable(f"[trainwatch] {kind} {record.get('id')}: {describe(part)}", newlines=False), file=ctx.out,
                  flush=True)

        t0 = time.monotonic()
        if self.policy.capture and kind in CAPTURE_KINDS:
            part, waits = self.capture(record)
            done(part)
            held = bool(waits and response.restart)
            if "revised" in part:
                kind = part["revised"]["kind"]
                ctx.revised(record.get("id"), codec.decode(records.Revision, part["revised"]), held)
            if held:
                # Read from counters, contradicted by the stacks, short of the hang rule: no restart yet.
                response.restart = False
                ctx.withdrawn(record.get("id"))
                done({"restart": {"requested": False, "why": waits}})
        if response.restart and self.policy.in_process and kind in IN_PROCESS_KINDS and ctx.single_node:
            t1 = time.monotonic()
            part = request_in_process(ctx.segment, self.policy.in_process_timeout_s, proc_state=process_state)
            if part["ok"]:
                ctx.recovered(record.get("id"), t1, time.monotonic())
                response.restart = False
            done({"in_process": part} | ({"restart": {"requested": False, "why": "recovered inside the running ranks"}}
                                         if part["ok"] else {}))
        if response.restart:
            t1 = time.monotonic()
            done({"checkpoint": request_emergency_checkpoint(ctx.segment, self.policy.emergency_timeout_s)})
            t2 = time.monotonic()
            restart = self.request_restart(record, response.generation)
            ctx.add_timings(incident=record.get("id"), capture_s=round(t1 - t0, 3), checkpoint_s=round(t2 - t1, 3),
                            requested_mono=time.monotonic())
            done({"restart": restart})
        if ctx.tracer is not None and response.span is not None:
            ctx.tracer.finish(response.span, results)
        return results

    def capture(self, record: dict) -> tuple[dict, str | None]:
        """The stacks, their groups and the verdict (and what the stacks revise
        of the incident), with why a restart waits when it does."""
        ctx = self.ctx
        t0 = time.monotonic()
        rows = rankrow.decode(ctx.segment.read_table(), time.monotonic(), ctx.node)
        groups, where, failed, rows = capture_ranks(rows, job=ctx.job, label=str(record.get("kind")),
                                                    timeout_s=self.policy.capture_timeout_s)
        own = records.Incident.from_json(record)
        revised = revision(own, groups, time.time()) if own is not None else None
        waits = None
        if revised is not None:
            own.revise(revised)
            if not past_threshold(rows, own.culprit_ranks, ctx.thresholds()):
                waits = (f"not restarting yet: {revised.why}, short of the hang threshold in force; the "
                         f"hang detector restarts if it stays stuck past it")
        current = [i for i in ctx.incidents() if i.id != record.get("id")] + ([own] if own is not None else [])
        v = decide(rows, groups, current, [], ctx.thresholds())
        return {
            "capture": {"dir": str(where), "seconds": round(time.monotonic() - t0, 3), "ranks": len(rows),
                        "failed": failed},
            "stack_groups": [
                {"ranks": list(g.ranks), "category": g.category, "pattern": g.pattern_id, "frames": list(g.frames[:5])}
                for g in groups
            ],
            "verdict": v.to_json(),
        } | ({"revised": codec.encode(revised)} if revised is not None else {}), waits

    def request_restart(self, record: dict, generation: int) -> dict:
        kind, incident = record.get("kind"), record.get("id")
        request = messages.RestartRequest(
            run=self.ctx.run, generation=generation, reason=str(record.get("summary") or kind),
            kind=kind if isinstance(kind, str) else None, incident=incident if isinstance(incident, str) else None,
            time=time.time())
        state.write_json_atomic(self.ctx.job.restart_request_file, codec.encode(request))
        return {"requested": True}


def describe(results: dict) -> str:
    """One console line of what the responder did."""
    parts = []
    if rev := results.get("revised"):
        parts.append(f"revised to {rev.get('kind')} ({rev.get('category')}): {rev.get('why')}")
    cap = results.get("capture")
    if cap:
        v = results.get("verdict") or {}
        who = ",".join(str(r) for r in v.get("culprit_ranks") or []) or "-"
        parts.append(f"stacks of {cap.get('ranks')} rank(s) in {cap.get('seconds')}s, verdict {v.get('category')} "
                     f"(culprit {who})")
    ip = results.get("in_process")
    if ip:
        parts.append(f"recovered in process in {ip.get('seconds')}s: {len(ip.get('ranks') or [])} rank(s) back at "
                     f"step {ip.get('step')}, no restart" if ip.get("ok") else
                     f"in-process recovery skipped ({ip['skipped']})" if ip.get("skipped") else
                     f"in-process recovery not done in {ip.get('seconds')}s (ranks "
                     f"{_ranks(ip.get('pending') or [])} did not answer): restarting the processes")
    ck = results.get("checkpoint")
    if ck:
        parts.append(describe_checkpoint(ck))
    restart = results.get("restart") or {}
    if restart.get("requested"):
        parts.append("restart requested")
    elif restart.get("why") and not ip:
        parts.append(str(restart["why"]))
    return "; ".join(parts)


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks) or "-"


def generation_of(table) -> int:
    """The worker generation of the last read (0 before any rank registered)."""
    return int(table["restart"].max()) if table is not None and len(table) else 0


def incident_step(record: dict, table) -> int | None:
    """The step an incident happened at: its evidence's, else its culprits' lowest."""
    step = (record.get("evidence") or {}).get("step")
    if isinstance(step, int):
        return step
    culprits = record.get("culprit_ranks") or []
    if table is None or not len(table) or not culprits:
        return None
    rows = table[np.isin(table["rank"], culprits)]
    return int(rows["step"].min()) if len(rows) else None
