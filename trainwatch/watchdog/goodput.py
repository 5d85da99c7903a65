"""The sidecar's side of goodput: turns what it reads and records (slot
tables, incidents, restart requests, recoveries) into the calls of the pure
ledger (trainwatch.diagnostics.goodput), on the sidecar's clock."""

from __future__ import annotations

from typing import Callable

import numpy as np

from trainwatch.diagnostics.goodput import Goodput, GoodputLedger
from trainwatch.watchdog.incident import Incident
from trainwatch.watchdog.recovery import fault_began


class GoodputFeed:
    """One job's goodput, from the sidecar's start."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.ledger = GoodputLedger(clock())
        self._step_s: dict[str, float] = {}
        """Incident id -> the ranks' median step time when it opened: what a lost step costs to re-run (s)."""

    def read(self, live, nslots: int) -> None:
        """A slot read: start-up is over once every rank of the node finished a step."""
        if self.ledger.first_step is None and len(live) == nslots and (live["progress_mono"] > live["start_mono"]).all():
            self.ledger.stepped(self.clock())

    def opened(self, incident: Incident, table, foreign: bool) -> None:
        """An incident was recorded; `foreign`: a job incident taken from the
        store, whose times are another node's clock (timed from now here)."""
        detected = incident.detected_mono if not foreign else self.clock()
        self.ledger.opened(str(incident.id), incident.kind, detected,
                           None if foreign else fault_began(incident.culprit_ranks, table),
                           restarting=incident.restart_requested)
        if table is not None and len(table):
            step_s = table["step_s"][np.isfinite(table["step_s"]) & (table["step_s"] > 0)]
            if len(step_s):
                self._step_s[str(incident.id)] = float(np.median(step_s))

    def confirmed(self, incident: str | None, now: float) -> None:
        """A provisional incident is firm now: the time it was held counts as detection."""
        self.ledger.confirmed(incident, now)

    def timings_to(self, tracker: Callable[..., None]) -> Callable[..., None]:
        """The responder's `add_timings`: the restart tracker's, and the moment
        an incident's restart was requested (its capture and checkpoint done)."""
        def add_timings(incident: str | None = None, **times: float) -> None:
            tracker(**times)
            if "requested_mono" in times:
                self.ledger.requested(incident, float(times["requested_mono"]))
        return add_timings

    def resolved(self, incident: str) -> None:
        self.ledger.resolved(incident, self.clock())

    def recovered(self, restart: Incident, cause: str | None) -> None:
        """A restarted worker group trains again (the `restart` record of `cause`)."""
        ev = restart.evidence
        lost = ev.get("steps_lost")
        step_s = self._step_s.pop(cause, None) if cause else None
        recovery = ev.get("recovery_s")
        self.ledger.recovered(
            cause, self.clock(), recovery_s=float(recovery) if isinstance(recovery, (int, float)) else None,
            # steps lost x the step time before the fault; unknown when the script numbers no steps
            recompute_s=None if lost is None else float(lost) * (step_s or 0.0))

    def in_process(self, incident: str | None, started: float, ended: float) -> None:
        """`incident` was recovered inside its running ranks (no restart), from
        `started` (capture done, recovery asked) to `ended` (every rank back)."""
        self.ledger.requested(incident, started)
        self.ledger.recovered(incident, ended, recompute_s=0.0)

    def account(self) -> Goodput:
        return self.ledger.account(self.clock())
