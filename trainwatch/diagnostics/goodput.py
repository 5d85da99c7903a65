"""Goodput: how much of a job's wall time trained the model, and where the rest went.

Zero-code: built only from what the sidecar already sees. Its clock gives the
wall time; the first step on every rank ends start-up; each incident that
stops training (a hang, a crash, a mismatch, a lost node, a GPU fault: the
kinds resolved by progress) gives the fault time (its culprits' last
progress), the detection and the resolution; each restart record gives the
capture and checkpoint seconds, the first new step and the steps lost.

Every second of wall time is given to exactly one bucket, so the buckets add up
to the wall time: the spans of every cause are laid on one timeline and, where
they overlap, the more specific cause wins (a restart over the checkpoint
written for it, over the detection, over plain time hung, over start-up);
what no span covers is productive. Spans are laid as things happen (an
incident that asks for a restart is capture and checkpoint from its detection
until the restart is requested, then restart until the first new step; one
that does not is time hung until it is resolved), so a second counted in one
bucket stays there and the exported counters never go back; the spans only
known afterwards (detection: the fault is seen when it is detected) rank
below every other and take only productive time. Re-computation is not a span: the steps lost
since the last checkpoint were trained once already, so the time to re-run
them is taken out of the productive time after the restart (steps lost x the
step time before the fault). Scripts that number no steps (zero-code) resume
from their own checkpoint at a step trainwatch cannot see: their
re-computation is counted as unknown, never guessed.

Pure: no clock of its own, no process; the sidecar feeds it and `diagnose`,
the report and the exporter read its `Goodput`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainwatch import kinds

CAUSES = ("startup", "detection", "capture_checkpoint", "restart", "recompute", "hung")
"""Badput causes (`trainwatch_badput_seconds_total{cause}`): start-up before the
first step; detection (fault to incident); capture and checkpoint; teardown
and restart (rendezvous, load, first step); re-computation of lost steps; time
hung or stalled with nothing else going on."""

_PRIORITY = {"restart": 0, "capture_checkpoint": 1, "hung": 2, "startup": 3, "detection": 4}
"""Which cause wins where spans overlap: lower first. Detection is last: it is
laid after the fact, and must not take seconds already counted elsewhere."""

_WORDS = {"restart": "restarts", "recompute": "recomputed steps", "startup": "start-up"}
STOPPING_KINDS = frozenset(k.name for k in kinds.KINDS.values() if k.resolution is kinds.Resolution.PROGRESS)
"""Incident kinds that stop training until they are over: only these cost time."""


@dataclass(frozen=True, slots=True)
class Span:
    """A stretch of wall time lost to one cause."""

    cause: str
    """One of CAUSES (not recompute)."""
    start: float
    """Monotonic s."""
    end: float
    """Monotonic s."""
    kind: str | None = None
    """The kind of the incident it belongs to (None: start-up, a restart of an unknown incident)."""


@dataclass(slots=True)
class _Incident:
    kind: str
    detected: float
    fault: float | None
    restarting: bool = False
    end: float | None = None
    requested: float | None = None
    recovered: float | None = None


@dataclass(frozen=True, slots=True)
class Goodput:
    """Wall time split into productive time and badput by cause; adds up exactly."""

    wall_s: float
    """Job start to now (s)."""
    productive_s: float
    """Wall time less every badput (s)."""
    badput_s: dict
    """Cause -> seconds, every cause of CAUSES present."""
    by_kind: dict = field(default_factory=dict)
    """Incident kind -> (seconds lost to its detection, capture and hang, incidents)."""
    restarts: int = 0
    """Restarts that trained again."""
    recompute_unknown: int = 0
    """Restarts whose lost steps cannot be known (a script numbering no steps)."""

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 1.0

    def to_json(self) -> dict:
        return {"ratio": round(self.ratio, 4), "wall_s": round(self.wall_s, 3),
                "productive_s": round(self.productive_s, 3),
                "badput_s": {c: round(v, 3) for c, v in self.badput_s.items()},
                "by_kind": {k: {"seconds": round(s, 3), "incidents": n} for k, (s, n) in self.by_kind.items()},
                "restarts": self.restarts, "recompute_unknown": self.recompute_unknown}

    def line(self) -> str:
        """One line for people: `goodput 97.3%: lost 41 s to 2 hangs, 12 s to restarts, ...`."""
        return line_of(self.to_json())


def _plural(kind: str, n: int) -> str:
    words = kind.replace("_", " ")
    return words if n == 1 else (words + "es" if words.endswith(("sh", "ch", "s", "x")) else words + "s")


def line_of(record: dict) -> str:
    """The one-line summary of a `Goodput.to_json()` record (as telemetry.json keeps it)."""
    ratio = record.get("ratio")
    wall = record.get("wall_s")
    if not isinstance(ratio, (int, float)) or not isinstance(wall, (int, float)):
        return "goodput unknown"
    parts = []
    by_kind = record.get("by_kind") if isinstance(record.get("by_kind"), dict) else {}
    for kind, v in sorted(by_kind.items(), key=lambda kv: -_num(kv[1], "seconds")):
        seconds, n = _num(v, "seconds"), int(_num(v, "incidents"))
        if seconds >= 0.05:
            parts.append(f"{seconds:.0f} s to {n} {_plural(kind, n)}")
    badput = record.get("badput_s") if isinstance(record.get("badput_s"), dict) else {}
    for cause in ("restart", "recompute", "startup"):
        seconds = badput.get(cause)
        if isinstance(seconds, (int, float)) and seconds >= 0.05:
            parts.append(f"{seconds:.0f} s " + ("of " if cause == "recompute" else "to ") + _WORDS[cause])
    unknown = record.get("recompute_unknown")
    if isinstance(unknown, int) and unknown > 0:
        parts.append(f"recomputed steps unknown after {unknown} restart{'s' if unknown != 1 else ''} "
                     "(the script numbers no steps)")
    head = f"goodput {100 * ratio:.1f}% of {wall:.0f} s"
    return head + (": lost " + ", ".join(parts) if parts else "")


def _num(d, key: str) -> float:
    v = d.get(key) if isinstance(d, dict) else None
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


class GoodputLedger:
    """Fed by the sidecar as things happen (monotonic times of its clock);
    `account(now)` splits the wall time so far."""

    def __init__(self, started: float):
        self.started = started
        self.first_step: float | None = None
        self._incidents: dict[str, _Incident] = {}
        self._restarts: list[tuple[float, float | None]] = []
        """(first new step, seconds to re-run the lost steps or None when unknown) per restart."""
        self._orphans: list[Span] = []

    def stepped(self, now: float) -> None:
        """Every rank has finished a step: start-up is over (the first call counts)."""
        if self.first_step is None:
            self.first_step = max(self.started, now)

    def opened(self, incident_id: str, kind: str, detected: float, fault: float | None = None, *,
               restarting: bool = False) -> None:
        """An incident opened; `fault` is when the fault began (its culprits' last
        progress) when known; `restarting`: a restart was asked for it."""
        if kind not in STOPPING_KINDS or incident_id in self._incidents:
            return
        if fault is not None and not (self.started <= fault <= detected):
            fault = max(self.started, min(fault, detected))
        self._incidents[incident_id] = _Incident(kind, detected, fault, restarting)

    def confirmed(self, incident_id: str | None, now: float) -> None:
        """A provisional incident was confirmed at `now`: detected then, as far as the buckets go."""
        inc = self._incidents.get(incident_id) if incident_id else None
        if inc is not None and inc.requested is None:
            inc.detected = max(inc.detected, now)

    def requested(self, incident_id: str | None, now: float) -> None:
        """The capture and emergency checkpoint for `incident_id` are done and its restart requested."""
        inc = self._incidents.get(incident_id) if incident_id else None
        if inc is not None and inc.requested is None:
            inc.restarting = True
            inc.requested = max(inc.detected, now)

    def resolved(self, incident_id: str, now: float) -> None:
        inc = self._incidents.get(incident_id)
        if inc is not None and inc.end is None:
            inc.end = max(inc.detected, now)

    def recovered(self, incident_id: str | None, now: float, *, recovery_s: float | None = None,
                  recompute_s: float | None = None) -> None:
        """A restart for `incident_id` trained again at `now`; `recovery_s` is
        fault to first new step; `recompute_s` the time to re-run the steps
        lost (None: unknown)."""
        inc = self._incidents.get(incident_id) if incident_id else None
        if inc is not None:
            inc.restarting = True
        # One restart ends every fault it restarted for (a second fault while restarting too).
        for other in self._incidents.values():
            if other.restarting and other.recovered is None and other.detected <= now:
                other.recovered = now
        if inc is None and recovery_s is not None and recovery_s > 0:
            # A restart of an incident this ledger never saw open (another node's):
            # its recovery time is all it knows.
            self._orphans.append(Span("restart", max(self.started, now - recovery_s), now))
        self._restarts.append((now, recompute_s))

    def spans(self, now: float) -> list[Span]:
        out: list[Span] = []
        out.append(Span("startup", self.started, self.first_step if self.first_step is not None else now))
        for inc in self._incidents.values():
            if inc.fault is not None and inc.fault < inc.detected:
                out.append(Span("detection", inc.fault, inc.detected, inc.kind))
            if not inc.restarting:
                out.append(Span("hung", inc.detected, inc.end if inc.end is not None else now, inc.kind))
                continue
            # A restarting incident is resolved when its new processes appear;
            # its cost runs to their first step.
            end = inc.recovered if inc.recovered is not None else now
            # No request recorded (the agent restarted on its own): all of it is the restart.
            requested = inc.requested if inc.requested is not None else (
                inc.detected if inc.recovered is not None else end)
            out.append(Span("capture_checkpoint", inc.detected, min(requested, end), inc.kind))
            out.append(Span("restart", requested, end, inc.kind))
        out.extend(self._orphans)
        return [Span(s.cause, max(s.start, self.started), min(s.end, now), s.kind) for s in out
                if min(s.end, now) > max(s.start, self.started)]

    def account(self, now: float) -> Goodput:
        now = max(now, self.started)
        spans = self.spans(now)
        badput = {c: 0.0 for c in CAUSES}
        by_kind: dict[str, list] = {}
        for inc in self._incidents.values():
            by_kind.setdefault(inc.kind, [0.0, 0])[1] += 1
        # The timeline cut at every span edge: each piece goes to the winning span covering it.
        edges = sorted({self.started, now, *(s.start for s in spans), *(s.end for s in spans)})
        productive_pieces: list[tuple[float, float]] = []
        for a, b in zip(edges, edges[1:]):
            covering = [s for s in spans if s.start <= a and s.end >= b]
            if not covering:
                productive_pieces.append((a, b))
                continue
            win = min(covering, key=lambda s: _PRIORITY[s.cause])
            badput[win.cause] += b - a
            if win.kind is not None and win.cause != "restart":
                by_kind[win.kind][0] += b - a
        unknown = 0
        for at, recompute in self._restarts:
            if recompute is None:
                unknown += 1
                continue
            # Only productive time after the restart can have been spent re-running its steps.
            after = sum(b - max(a, at) for a, b in productive_pieces if b > at) - badput["recompute"]
            badput["recompute"] += min(max(0.0, recompute), max(0.0, after))
        wall = now - self.started
        return Goodput(wall_s=wall, productive_s=wall - sum(badput.values()), badput_s=badput,
                       by_kind={k: (v[0], v[1]) for k, v in by_kind.items()}, restarts=len(self._restarts),
                       recompute_unknown=unknown)


def typed_record(value) -> dict | None:
    """A goodput record read from a file (telemetry.json) as its readers use it:
    None unless it has a finite ratio and wall time; badput of every cause,
    what is missing or not a number read as 0."""
    if not isinstance(value, dict):
        return None
    ratio, wall = _num(value, "ratio"), _num(value, "wall_s")
    if not isinstance(value.get("ratio"), (int, float)) or not isinstance(value.get("wall_s"), (int, float)) \
            or not 0.0 <= ratio <= 1.0 or wall < 0:
        return None
    badput = value.get("badput_s") if isinstance(value.get("badput_s"), dict) else {}
    by_kind = value.get("by_kind") if isinstance(value.get("by_kind"), dict) else {}
    unknown = value.get("recompute_unknown")
    restarts = value.get("restarts")
    return {"ratio": ratio, "wall_s": wall, "productive_s": _num(value, "productive_s"),
            "badput_s": {c: _num(badput, c) for c in CAUSES},
            "by_kind": {str(k): {"seconds": _num(v, "seconds"), "incidents": int(_num(v, "incidents"))}
                        for k, v in by_kind.items() if k in kinds.KINDS and isinstance(v, dict)},
            "restarts": restarts if isinstance(restarts, int) and not isinstance(restarts, bool) else 0,
            "recompute_unknown": unknown if isinstance(unknown, int) and not isinstance(unknown, bool) else 0}
