"""Recovery accounting: when a restarted worker group is back to training, one
`restart` record (an action of the incident it restarted for) says from which step it resumed, how many steps were lost
and where the seconds between the fault and the first new step went.

The step a job resumed from is only stated when it is known: ranks that number
their own steps (the trainer API) report their first step after the restart;
zero-code steps are counted from 0 in every new process (whatever checkpoint
the script loaded), so for those the summary says the steps lost are unknown
instead of claiming a number.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import numpy as np

from trainwatch import rankrow, slots, state
from trainwatch.watchdog.incident import Incident

_STARTING = (slots.PHASE_CODES["init"], slots.PHASE_CODES["checkpoint"])
"""Phases of a rank still starting: imports, process group, finding and loading its checkpoint."""


def _delta(a, b) -> float | None:
    if a is None or b is None:
        return None
    return round(max(0.0, float(b) - float(a)), 3)


def fault_began(culprits: list[int], table) -> float | None:
    """When the fault of an incident began: its culprits' last progress in
    `table` (monotonic s); None when no culprit is in it."""
    if table is None or not culprits or not len(table):
        return None
    rows = table[np.isin(table["rank"], list(culprits))]
    seen = rankrow.progress_mono(rows) if len(rows) else np.zeros(0)
    seen = seen[seen > 0]  # 0: never made progress (not a time: the clock's epoch is the machine's boot)
    return float(seen.min()) if len(seen) else None


class RestartTracker:
    """Fed every sidecar read; returns the `restart` incident once a new worker
    generation has completed a step on every rank."""

    def __init__(self, job: state.JobDir, clock: Callable[[], float]):
        self.job = job
        self.clock = clock
        self._seen = 0
        self._last_step = 0
        self._gen_ready: float | None = None
        self._fault: dict | None = None
        self._tentative = False
        self._lock = threading.Lock()

    def note_fault(self, record: dict, table=None, *, tentative: bool = False) -> None:
        """Remember the fault a restart will recover from (for the breakdown);
        `table` is the slot table the fault was seen in. A `tentative` one (an
        incident whose policy may stop the ranks: a non-finite loss) is the
        cause only if no other fault is noted before the restart."""
        # A job incident taken from another node carries that node's monotonic
        # clock: not comparable with ours, so it times nothing here.
        detected = record.get("detected_mono") if record.get("scope") != "job" else None
        when = record.get("time")
        if detected is None and isinstance(when, (int, float)) and math.isfinite(when):
            # ...its wall-clock time is: that long ago on our clock.
            detected = self.clock() - min(max(0.0, time.time() - float(when)), 600.0)
        fault: dict[str, Any] = {"kind": record.get("kind"), "culprit_ranks": record.get("culprit_ranks") or [],
                                 "detected_mono": detected or self.clock(), "id": record.get("id")}
        began = fault_began(record.get("culprit_ranks") or [], table)
        if began is not None:
            fault["fault_mono"] = began
        with self._lock:
            self._fault, self._tentative = fault, tentative

    def add_timings(self, **times: float) -> None:
        """What the responder measured for the noted fault (capture, checkpoint, request time)."""
        with self._lock:
            if self._fault is not None:
                self._fault.update(times)

    def forget(self, incident: str | None) -> None:
        """That incident was recovered without a restart: no restart will time it."""
        with self._lock:
            if self._fault is not None and self._fault.get("id") == incident:
                self._fault, self._tentative = None, False

    def has_fault(self) -> bool:
        return self._fault is not None and not self._tentative

    def observe(self, live) -> Incident | None:
        restart = int(live["restart"].max())
        old = live[live["restart"] < restart]
        if restart == self._seen:
            self._last_step = max(self._last_step, int(live["step"].max()))
            return None
        new = live[live["restart"] == restart]
        if self._gen_ready is None and not len(old) and not np.isin(new["phase"], _STARTING).any():
            # Every new rank is past start-up (imports, checkpoint load, process group).
            self._gen_ready = self.clock()
        # The new worker group has recovered once every rank finished a step.
        if len(old) or not (new["progress_mono"] > new["start_mono"]).all():
            return None
        self._seen = restart
        with self._lock:
            fault, self._fault = self._fault or {}, None
        incident = self._incident(restart, new, fault)
        self._gen_ready = None
        self._last_step = int(new["step"].max())
        return incident

    def _incident(self, restart: int, new, fault: dict) -> Incident:
        first_step_done = float(new["progress_mono"].max())
        started = float(new["start_mono"].min())
        timing = state.read_json(self.job.restart_timing_file) or {}
        # When the fault began is known from its culprits' rows on this node; for a
        # culprit elsewhere only the detection is, and the recovery is timed from it.
        known = fault.get("fault_mono") is not None
        t_fault = fault.get("fault_mono", fault.get("detected_mono"))
        requested = fault.get("requested_mono") or timing.get("stop_begin")
        breakdown = {
            "detect_s": _delta(t_fault, fault.get("detected_mono")) if known else None,
            "capture_s": fault.get("capture_s", 0.0),
            "checkpoint_s": fault.get("checkpoint_s", 0.0),
            "teardown_s": _delta(requested, timing.get("stop_end")),
            "rendezvous_s": timing.get("rendezvous_s"),
            "load_s": _delta(timing.get("workers_started"), self._gen_ready or started),
            "first_step_s": _delta(self._gen_ready or started, first_step_done),
        }
        recovery_s = _delta(t_fault, first_step_done)
        parts = ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in breakdown.items() if v is not None)
        resumed_at, lost, where = self._resumed(new)
        return Incident(
            kind="restart",
            culprit_ranks=fault.get("culprit_ranks") or [],
            summary=f"restart {restart}: {where}"
            + (f", back to training {recovery_s:.1f}s after the {'fault' if known else 'detection'}"
               if recovery_s is not None else "")
            + (f" ({parts})" if parts else ""),
            severity="info",
            runbook=None,
            # evidence: restart = the worker generation now training;
            # resumed_from_step = the step its checkpoint was of (its first step
            # less one), steps_lost = last_step_before less that: both null when
            # unknown, never guessed (see _resumed); last_step_before = the
            # highest step trainwatch saw before the restart (for counted steps,
            # a count since the earlier process started); recovery_s = fault to
            # first new step on every rank (s); breakdown = where those seconds
            # went; cause = the incident kind restarted for.
            evidence={"restart": restart, "resumed_from_step": resumed_at, "last_step_before": self._last_step,
                      "steps_lost": lost, "recovery_s": recovery_s, "breakdown": breakdown,
                      "cause": fault.get("kind"), "cause_id": fault.get("id")},
            key=f"restart:{restart}",
            detected_mono=self.clock(),
        )

    def _resumed(self, new) -> tuple[int | None, int | None, str]:
        """(step resumed from, steps lost, in words) for the new generation's rows.

        Only step numbers the script reports (tw.step(step=N)) say where it
        resumed: its first step after the restart, less one. Counted steps
        (the zero-code hooks) start from 0 in every new process, whatever
        checkpoint the script loaded; and a first step of 1 is what both a run
        from scratch and tw.step() without step= look like. In those cases
        where it resumed is unknown, and said to be (never a made-up number)."""
        if not (new["step_source"] == slots.STEP_REPORTED).all():
            return None, None, ("resumed; steps lost unknown: the script reports no step numbers (trainwatch counts "
                                "its optimizer steps from 0 in every new process; the script restarted from its own "
                                "checkpoint, if it keeps one)")
        firsts = new["first_step"][new["first_step"] > 0]
        resumed_at = int(firsts.min(initial=int(new["step"].min()))) - 1
        if resumed_at <= 0:
            return None, None, ("resumed; steps lost unknown: the script's steps count from 1 again (a run from "
                                "scratch, or tw.step() without step=N, which counts from 1 in every new process)")
        lost = max(0, self._last_step - resumed_at)
        return resumed_at, lost, f"resumed from step {resumed_at} (lost {lost} step{'s' if lost != 1 else ''})"
