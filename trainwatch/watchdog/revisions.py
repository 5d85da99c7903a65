"""Evidence revises the story, on the sidecar's side.

The responder's thread captures an incident's stacks; when they contradict
the kind it was detected as (trainwatch.diagnostics.revise), it records the
revision and hands it here. The sidecar's tick applies it to the open incident
and to the engine's condition, so the console, the exporter, `diagnose` and
the incident's resolution all tell the revised story, as one incident. When
the revision held the restart back (the new kind's threshold is not yet
reached), the first report of that kind by its own detector asks for it.
"""

from __future__ import annotations

import collections
from typing import Any

from trainwatch import records
from trainwatch.usage import printable
from trainwatch.watchdog.responder import Response, generation_of, incident_step


class Revisions:
    def __init__(self, sidecar: Any) -> None:
        self.sidecar = sidecar
        self._pending: collections.deque = collections.deque()  # appended on the responder's thread

    def add(self, incident: str | None, revision: records.Revision | None, waits: bool) -> None:
        """The responder's `revised`: applied on the next tick."""
        if incident and revision is not None:
            self._pending.append((incident, revision, waits))

    def withdrawn(self, incident: str | None) -> None:
        """The responder's `withdrawn`: the restart decided at detection is not under way."""
        self.sidecar.gate.recovered()
        self.sidecar.recovery.forget(incident)

    def gate(self, incident: records.Incident, record: dict, table: Any, generation: int) -> tuple[bool, str | None]:
        """The restart decision at detection: a hang called by the steady job's
        threshold alone is an alert until it is firm (its detector says so)."""
        sc = self.sidecar
        # A job incident's firm report is the aggregator's alone: there the fast call restarts as before.
        if (incident.evidence.get("provisional") is True and incident.scope != "job"
                and incident.kind in sc.config.actions.restart_kinds):
            return False, (f"{incident.kind} {incident.id}: an alert for now (called by the steady job's short step "
                           f"time alone); a restart follows if the rank stays without progress past the hang floor, "
                           f"or past the busy grace while it computes (an evaluation), or the slow-phase allowance while "
                           f"it writes (a checkpoint)")
        return sc.gate.decide(record, incident_step(record, table), generation)

    def apply(self) -> None:
        """On the tick: revise the open incidents, then ask for the restarts now due."""
        sc = self.sidecar
        while self._pending:
            incident_id, revision, waits = self._pending.popleft()
            incident = sc.open.get(incident_id)
            if incident is None or incident.kind == revision.kind:
                continue
            old_key, from_kind = incident.key, incident.kind
            incident.revise(revision)
            sc.engine.revised(old_key, incident, from_kind, waits)
            if sc._open_keys.get(old_key) == incident_id:
                sc._open_keys[incident.key] = sc._open_keys.pop(old_key)
            print(printable(f"[trainwatch] REVISED {from_kind} {incident_id} to {incident.kind}: {incident.summary} "
                            f"(runbook: trainwatch runbook {incident.runbook})", newlines=False),
                  file=sc.out, flush=True)
        for incident in sc.engine.take_confirmed():
            self.confirm(incident)

    def confirm(self, incident: records.Incident) -> None:
        """A revised incident's own detector calls it now: the restart held back, through the gate."""
        sc = self.sidecar
        record, table = incident.to_json(), sc.last_table
        record["detected_mono"] = sc.clock()  # detection ends here: the time it was held was spent on it
        sc.goodput.confirmed(incident.id, record["detected_mono"])
        generation = generation_of(table)
        restart, why = sc.gate.decide(record, incident_step(record, table), generation)
        if restart:
            sc.recovery.note_fault(record, table)
        print(printable(f"[trainwatch] CONFIRMED {incident.kind} {incident.id}: still no progress, past what honest "
                        f"work is allowed"
                        + ("; restarting" if restart else f"; {why}" if why else ""), newlines=False),
              file=sc.out, flush=True)
        if sc.responder is not None and restart:
            sc.responder.submit(Response(record, restart, generation, None))
