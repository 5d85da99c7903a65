"""The records of a job's events.jsonl, typed as their readers use them.

events.jsonl is append-only: an incident when it is detected, then records that
name it by id as things happen to it: `action` (what the responder did:
stacks, verdict, checkpoint, restart request), `resolved` (its condition is
over: when, after how long, how often it was seen) and `restart` (the worker
group it restarted is training again). `read_events` folds them into one
`Incident` per incident, its actions and resolution typed sub-records, so the
console, `diagnose`, the report and the exporter tell the same story. Every
record is read with `trainwatch.codec`: a field of the wrong type takes its
default, a record that does not fit is skipped, never a traceback (the file
may have been written by another version or by hand).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
from dataclasses import field
from typing import Any

from trainwatch import codec, kinds
from trainwatch.codec import finite_number, is_int, jsonable  # noqa: F401  (the readers' names for them)


class JobStatus(str, enum.Enum):
    """job.json's `status`: written by the launcher and its agent only, through
    these names. A reader of a status it does not know (a newer writer's) shows
    it as written."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    """Set by a reader: the launcher died without saying how the run ended."""

    def __str__(self) -> str:
        return self.value


LIVE_STATUSES = (JobStatus.STARTING.value, JobStatus.RUNNING.value, JobStatus.RESTARTING.value)
"""Statuses of a run whose launcher is (or should be) alive."""


# ---- incidents (events.jsonl, the job store) ----------------------------------------------

SUMMARY_CHARS = 2000
"""Longest summary written or read: a readable sentence is far shorter, and a
reader (`diagnose`, the console, the report) prints what it is given."""
TEXT_CHARS = 1000
"""Longest other free text (a reason, an error, a stack frame, a string of the evidence)."""
NAME_CHARS = 200
"""Longest name or id (a kind, a runbook, a category, a node)."""
_SUMMARY, _TEXT, _NAME = (codec.check(max_len=n) for n in (SUMMARY_CHARS, TEXT_CHARS, NAME_CHARS))

SEVERITIES = ("info", "low", "medium", "high", "critical")
"""Allowed severities, least to most urgent."""


def headline(kind: str, summary: str) -> str:
    """`kind: summary`, the kind said once (most detectors' summaries begin with it)."""
    return summary if summary.startswith(f"{kind}:") else f"{kind}: {summary}"


def severity_rank(severity: str) -> int:
    """Position of a severity in SEVERITIES (higher is more urgent)."""
    return SEVERITIES.index(severity)


@dataclasses.dataclass(slots=True)
class Verdict:
    """What is wrong and who did it: `diagnose`'s answer, and the responder's
    capture of an incident (its `verdict` action)."""

    category: str = field(metadata=_NAME)
    culprit_ranks: list[int] = field(default_factory=list, metadata=codec.check(min=0))
    summary: str = field(default="", metadata=_SUMMARY)
    runbook: str = field(default="", metadata=_NAME)
    confidence: float = 0.5
    evidence: list[str] = field(default_factory=list, metadata=_TEXT)

    def to_json(self) -> dict:
        return codec.encode(self)


@dataclasses.dataclass(slots=True)
class _GpuEvidence:
    """What an xid or ecc incident's evidence says about the GPU."""

    gpu: int | str | None = None
    xid: int | None = None
    meaning: str | None = None
    action: str | None = None
    line: str | None = None
    """The kernel log line it was read from."""


@dataclasses.dataclass(slots=True)
class HardwareFinding:
    """A GPU fault among a job's incidents, as `diagnose` lists it and the verdict weighs it."""

    kind: str
    """'xid' or 'ecc'."""
    severity: str
    gpu: int | str | None = None
    xid: int | None = None
    meaning: str | None = None
    rank: int | None = None
    """The rank on that GPU, if known."""
    action: str | None = None
    evidence: str | None = None

    @classmethod
    def of(cls, incident: Incident) -> HardwareFinding:
        ev = codec.decode(_GpuEvidence, incident.evidence) or _GpuEvidence()
        return cls(incident.kind, incident.severity, ev.gpu, ev.xid, ev.meaning or incident.summary,
                   next(iter(incident.culprit_ranks), None), ev.action, ev.line)


@dataclasses.dataclass(slots=True)
class RestartDecision:
    """Whether the incident asked for a restart of the worker group, and why not."""

    requested: bool = False
    why: str | None = field(default=None, metadata=_TEXT)


@dataclasses.dataclass(slots=True)
class StackGroupSummary:
    """One group of ranks whose stacks agree, as the responder recorded it."""

    ranks: list[int] = field(default_factory=list, metadata=codec.check(min=0))
    category: str | None = field(default=None, metadata=_NAME)
    pattern: str | None = field(default=None, metadata=_NAME)
    frames: list[str] = field(default_factory=list, metadata=_TEXT)


@dataclasses.dataclass(slots=True)
class CaptureResult:
    """The responder's stack capture: where the dumps went, how long it took."""

    dir: str = field(default="", metadata=codec.check(max_len=4096))
    seconds: float | None = None
    ranks: int = 0
    failed: dict[str, str] = field(default_factory=dict, metadata=_TEXT)
    """Rank (as a string) -> why it was not sampled."""


@dataclasses.dataclass(slots=True)
class CheckpointResult:
    """The emergency checkpoint asked of every rank that registered state."""

    requested: list[int] = field(default_factory=list)
    no_state: list[int] = field(default_factory=list)
    written: dict[str, int] = field(default_factory=dict)
    """Rank (as a string) -> the step it wrote."""
    failed: dict[str, str] = field(default_factory=dict, metadata=_TEXT)
    step: int | None = None
    seconds: float | None = None
    skipped: str | None = field(default=None, metadata=_TEXT)


@dataclasses.dataclass(slots=True)
class InProcessResult:
    """The in-process recovery: every rank back at `step`, or why not."""

    ok: bool = False
    step: int | None = None
    ranks: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    seconds: float | None = None
    skipped: str | None = field(default=None, metadata=_TEXT)


@dataclasses.dataclass(slots=True)
class Revision:
    """Evidence gathered after detection (the stacks captured for it) contradicted
    the incident's kind: what it became, from what, and why."""

    kind: str = field(metadata=_NAME)
    from_kind: str = field(default="", metadata=_NAME)
    category: str | None = field(default=None, metadata=_NAME)
    runbook: str | None = field(default=None, metadata=_NAME)
    summary: str = field(default="", metadata=_SUMMARY)
    why: str = field(default="", metadata=_TEXT)
    time: float | None = None


@dataclasses.dataclass(slots=True)
class Actions:
    """One `action` record: the results of what the responder did (each optional)."""

    capture: CaptureResult | None = None
    stack_groups: list[StackGroupSummary] | None = None
    verdict: Verdict | None = None
    in_process: InProcessResult | None = None
    checkpoint: CheckpointResult | None = None
    restart: RestartDecision | None = None
    revised: Revision | None = None


@dataclasses.dataclass(slots=True)
class Resolution:
    """A `resolved` record: the incident's condition is over."""

    time: float | None = None
    """Wall-clock Unix time it was seen over."""
    duration_s: float | None = field(default=None, metadata=codec.check(min=0))
    count: int | None = field(default=None, metadata=codec.check(min=1))
    """Ticks it was reported in while open."""
    reason: str | None = field(default=None, metadata=_TEXT)


_LINE = ("kind", "culprit_ranks", "victims", "summary", "severity", "runbook", "category", "key")
"""Fields every incident line holds; the others below are written when set."""
_SET = ("id", "opened_time", "node", "job", "scope", "nodes", "incident", "restart")
_MERGED = ("capture", "stack_groups", "verdict", "in_process", "checkpoint", "revisions")
"""What `action` records add to an incident."""


@dataclasses.dataclass(slots=True)
class Incident:
    """One detected fault, from the detector that found it through events.jsonl
    to every reader. Times are CLOCK_MONOTONIC seconds unless named otherwise."""

    kind: str = field(metadata=_NAME)
    """What happened: hang, collective_mismatch, straggler, crash, loss_nan, ...
    (trainwatch.kinds); `restart`: a worker group restarted for another incident
    trains again."""
    culprit_ranks: list[int] = field(default_factory=list, metadata=codec.check(min=0))
    """Global ranks that caused it; empty when no single rank can be blamed."""
    victims: list[int] = field(default_factory=list, metadata=codec.check(min=0))
    """Global ranks affected only because of the culprits (e.g. waiting on them)."""
    summary: str = field(default="", metadata=_SUMMARY)
    """One readable sentence for consoles and logs."""
    severity: str = field(default="", metadata=codec.check(one_of=SEVERITIES))
    """One of SEVERITIES; empty: the kind's declared severity (kinds.KINDS), medium for another kind."""
    runbook: str | None = field(default=None, metadata=_NAME)
    """Runbook id to follow (e.g. 'hang', 'collective-mismatch'); None: the kind's declared runbook."""
    category: str | None = field(default=None, metadata=_NAME)
    """Best stack/error category guess (DESIGN.md lists), None if unknown."""
    evidence: dict = field(default_factory=dict, metadata=_TEXT)
    """Facts behind the verdict (steps, seq numbers, durations, ratios)."""
    key: str = field(default="", metadata=codec.check(max_len=1 << 16))
    """De-duplication key; default: kind plus sorted culprit ranks."""
    detected_mono: float = 0.0
    """Monotonic time of the tick that found it (on the clock of the node that found it)."""
    time: str = field(default="", metadata=codec.check(max_len=64))
    """Wall-clock ISO time it was recorded ('' until then)."""
    id: str | None = field(default=None, metadata=_NAME)
    """Its id, given by the sidecar (or the aggregator) that recorded it."""
    opened_time: float | None = None
    """Wall-clock Unix time it was recorded."""
    node: str | None = field(default=None, metadata=_NAME)
    job: str | None = field(default=None, metadata=_NAME)
    scope: str | None = field(default=None, metadata=_NAME)
    """'job': raised by the job-wide aggregator for every node."""
    nodes: list[str] | None = field(default=None, metadata=_NAME)
    """A job incident's nodes (those of its culprits)."""
    incident: str | None = field(default=None, metadata=_NAME)
    """A `restart` record: the id of the incident whose restart it ends."""
    restart: RestartDecision | None = None
    """Whether it asked for a restart (a later action may say it did not)."""
    capture: CaptureResult | None = None
    stack_groups: list[StackGroupSummary] | None = None
    verdict: Verdict | None = None
    """The capture's verdict: it refines the category and the runbook."""
    in_process: InProcessResult | None = None
    checkpoint: CheckpointResult | None = None
    revisions: list[Revision] | None = None
    """What the evidence gathered after detection changed, oldest first (None: nothing)."""
    resolution: Resolution | None = None
    """Set once a `resolved` record names it; None while it is open."""

    def __post_init__(self) -> None:
        declared = kinds.spec(self.kind)
        if not self.severity:
            self.severity = declared.severity if declared is not None else "medium"
        if self.runbook is None and declared is not None and self.kind != "restart":
            self.runbook = declared.runbook
        if self.severity not in SEVERITIES:
            raise ValueError(f"incident severity must be one of {', '.join(SEVERITIES)}; got {self.severity!r}")
        self.culprit_ranks = sorted({int(r) for r in self.culprit_ranks})
        self.victims = sorted({int(r) for r in self.victims} - set(self.culprit_ranks))
        if not self.key:
            self.key = f"{self.kind}:{','.join(map(str, self.culprit_ranks))}"

    @property
    def status(self) -> str:
        """'open' until a `resolved` record names it, then 'resolved' ('' for a restart record)."""
        if self.kind == "restart":
            return ""
        return "resolved" if self.resolution is not None else "open"

    @property
    def restart_requested(self) -> bool:
        return self.restart is not None and self.restart.requested

    def stamp(self, wall_time: float | None = None) -> Incident:
        """Give it its wall-clock `time` (now unless `wall_time`, Unix seconds), once."""
        if not self.time:
            when = wall_time if wall_time is not None else _dt.datetime.now(_dt.timezone.utc).timestamp()
            self.time = _dt.datetime.fromtimestamp(when, tz=_dt.timezone.utc).isoformat(timespec="milliseconds")
        return self

    def to_json(self, *, wall_time: float | None = None) -> dict:
        """Its events.jsonl line (and job store record): what was known when it
        was recorded; its actions and resolution are records of their own."""
        self.stamp(wall_time)
        return self._line()

    def _line(self) -> dict:
        out = ({"time": self.time} if self.time else {}) | {name: codec.encode_field(self, name) for name in _LINE}
        out |= {name: codec.encode_field(self, name) for name in _SET if getattr(self, name) is not None}
        if self.restart is not None and self.restart.why is None:
            out["restart"] = {"requested": self.restart.requested}
        evidence = codec.bound_text(jsonable(self.evidence), TEXT_CHARS)
        return out | {"evidence": evidence, "detected_mono": round(float(self.detected_mono), 6)}

    def view(self) -> dict:
        """As `diagnose --json` lists it: the line with its actions' results,
        its status and how it ended merged in."""
        out = self._line() | {n: codec.encode(v) for n in _MERGED if (v := getattr(self, n)) is not None}
        if self.status:
            out["status"] = self.status
        r = self.resolution
        if r is not None:
            out |= {"resolved_time": r.time, "duration_s": r.duration_s, "count": r.count, "resolution": r.reason}
        return out

    def act(self, actions: Actions) -> None:
        """An `action` record's results, merged in."""
        for name in ("capture", "stack_groups", "verdict", "in_process", "checkpoint", "restart"):
            if (value := getattr(actions, name)) is not None:
                setattr(self, name, value)
        if actions.verdict is not None and actions.verdict.runbook:
            # The capture's verdict refines where the incident points: every
            # reader then names the same runbook.
            self.runbook = actions.verdict.runbook
        if (r := actions.revised) is not None and r.kind in kinds.KINDS:
            self.revise(r)

    def revise(self, r: Revision) -> None:
        """Become what the later evidence says (one incident, its revision kept)."""
        r.from_kind = r.from_kind or self.kind
        self.revisions = [*(self.revisions or []), r]
        self.kind, self.summary = r.kind, r.summary or self.summary
        self.category, self.runbook = r.category or self.category, r.runbook or self.runbook
        self.key = f"{self.kind}:{','.join(map(str, self.culprit_ranks))}"

    @classmethod
    def from_json(cls, data: Any) -> Incident | None:
        """An incident line (or a job store record): None when it does not fit
        (the reader skips it)."""
        return codec.decode(cls, data)


@dataclasses.dataclass(slots=True)
class _Tag:
    """What tells the records of events.jsonl apart."""

    kind: str = field(metadata=_NAME)
    incident: str | None = field(default=None, metadata=_NAME)
    """An `action` or `resolved` record: the id of the incident it is about."""


def read_events(events: list[Any]) -> list[Incident]:
    """Incidents (and restart records) oldest first, each with the records that
    name it merged in: an `action`'s results, a `resolved` record's time,
    duration, count and reason. Records that do not fit are skipped."""
    out: list[Incident] = []
    by_id: dict[str, Incident] = {}
    for record in events:
        tag = codec.decode(_Tag, record)
        if tag is None:
            continue
        if tag.kind in ("action", "resolved"):
            target = by_id.get(tag.incident) if tag.incident is not None else None
            if target is None:
                continue
            if tag.kind == "resolved":
                target.resolution = codec.decode(Resolution, record) or Resolution()
            elif (actions := codec.decode(Actions, record)) is not None:
                target.act(actions)
            continue
        incident = Incident.from_json(record)
        if incident is None:
            continue
        if incident.id is not None:
            if incident.id in by_id:
                continue  # a job incident that every node of a shared home recorded
            by_id[incident.id] = incident
        out.append(incident)
    return out
