"""Incident: what a detector found, in one record every consumer understands.

The same class carries incidents from the slot detectors (hang, collective
mismatch, straggler, crash, loss health) and from elsewhere (GPU XID/ECC
events, restarts), so events.jsonl, the exporter, `diagnose` and the actions
read one shape.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from trainwatch import codec, kinds

SEVERITIES = ("info", "low", "medium", "high", "critical")
"""Allowed severities, least to most urgent."""


def severity_rank(severity: str) -> int:
    """Position of a severity in SEVERITIES (higher is more urgent)."""
    return SEVERITIES.index(severity)


@dataclass(slots=True)
class Incident:
    """One detected fault. Times are CLOCK_MONOTONIC seconds unless named otherwise."""

    kind: str
    """What happened: hang, collective_mismatch, straggler, crash, loss_nan,
    loss_spike, grad_explosion (xid, ecc, restart come from other sources)."""
    culprit_ranks: list[int] = field(metadata=codec.check(min=0))
    """Global ranks that caused it; empty when no single rank can be blamed."""
    victims: list[int] = field(default_factory=list, metadata=codec.check(min=0))
    """Global ranks affected only because of the culprits (e.g. waiting on them)."""
    summary: str = ""
    """One readable sentence for consoles and logs."""
    severity: str = ""
    """One of SEVERITIES; empty: the kind's declared severity (kinds.KINDS), medium for another kind."""
    runbook: str | None = None
    """Runbook id to follow (e.g. 'hang', 'collective-mismatch'); None: the kind's declared runbook."""
    category: str | None = None
    """Best stack/error category guess (DESIGN.md lists), None if unknown."""
    evidence: dict = field(default_factory=dict)
    """Facts behind the verdict (steps, seq numbers, durations, ratios)."""
    key: str = ""
    """De-duplication key; default: kind plus sorted culprit ranks."""
    detected_mono: float = 0.0
    """Monotonic time of the tick that found it."""

    def __post_init__(self) -> None:
        declared = kinds.spec(self.kind)
        if not self.severity:
            self.severity = declared.severity if declared is not None else "medium"
        if self.runbook is None and declared is not None:
            self.runbook = declared.runbook
        if self.severity not in SEVERITIES:
            raise ValueError(f"incident severity must be one of {', '.join(SEVERITIES)}; got {self.severity!r}")
        self.culprit_ranks = sorted({int(r) for r in self.culprit_ranks})
        self.victims = sorted({int(r) for r in self.victims} - set(self.culprit_ranks))
        if not self.key:
            self.key = f"{self.kind}:{','.join(map(str, self.culprit_ranks))}"

    def to_json(self, *, wall_time: float | None = None) -> dict:
        """A JSON-ready dict; `time` is the wall-clock ISO time of emission
        (now unless `wall_time`, Unix seconds, is given)."""
        when = _dt.datetime.fromtimestamp(
            wall_time if wall_time is not None else _dt.datetime.now(_dt.timezone.utc).timestamp(),
            tz=_dt.timezone.utc,
        )
        return {"time": when.isoformat(timespec="milliseconds")} | codec.encode(self) | {
            "evidence": jsonable(self.evidence),
            "detected_mono": round(float(self.detected_mono), 6),
        }

    @classmethod
    def from_json(cls, data: Any) -> Incident | None:
        """An incident from `to_json()` output (a line of events.jsonl, a job
        store record): None for one that does not fit (the reader skips it)."""
        return codec.decode(cls, data)


def jsonable(value: Any) -> Any:
    """Convert numpy scalars/arrays, tuples and sets to plain JSON types.

    Non-finite floats become the strings 'nan'/'inf'/'-inf': a NaN loss is a
    fact worth keeping, and bare NaN is not valid JSON for other readers."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.rstrip(b"\0").decode("ascii", "replace")
    if hasattr(value, "tolist") and not isinstance(value, (str, int, float, bool)):
        return jsonable(value.tolist())  # numpy scalar or array
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def describe_ranks(ranks: Iterable[int], *, limit: int = 16) -> str:
    """'rank 3' or 'ranks 0,2,5-9' for a summary sentence; long lists are cut."""
    ranks = sorted({int(r) for r in ranks})
    if not ranks:
        return "no rank"
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {format_ranks(ranks, limit=limit)}"


def format_ranks(ranks: Iterable[int], *, limit: int = 16) -> str:
    """Compact rank list: runs of three or more become 'a-b'; after `limit`
    pieces the rest is counted, so a 4096-rank job still reads in one line."""
    ranks = sorted({int(r) for r in ranks})
    pieces: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            pieces.append(f"{ranks[i]}-{ranks[j]}")
        else:
            pieces.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    if len(pieces) > limit:
        return ",".join(pieces[:limit]) + f",... ({len(ranks)} ranks)"
    return ",".join(pieces)
