"""Evidence revises the story: what the stacks captured for an incident say
against the kind it was detected as.

The watchdog names some faults fast, from the ranks' counters alone: a
`collective_mismatch` when one rank's collective counts fall behind its
peers'. The stacks captured a moment later can contradict that reading: the
rank that fell behind is not in a collective at all but in its data loader,
a checkpoint write, the garbage collector or a compile lock. Then the job is
waiting on that rank's own work (a hang, or honest slow work), and the
mismatch runbook would send the user the wrong way. `revision` says what the
incident becomes, and whether it is past the hang threshold in force: a
revised incident restarts the job only when the hang rule would have.

Pure logic: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any, Sequence

from trainwatch.diagnostics.verdict import _fmt, _runbook_for, _thresholds
from trainwatch.rankrow import RankRow
from trainwatch.records import Incident, Revision

OUTSIDE_COLLECTIVES = {
    "dataloader": "data loading",
    "checkpoint_io": "checkpoint I/O",
    "gc_collect": "garbage collection",
    "compile_lock": "a compile lock",
}
"""Stack categories that place a rank in its own work, not in a collective (what each reads as)."""
REVISABLE = ("collective_mismatch",)
"""Kinds read from counters alone, that the stacks can contradict."""


def revision(incident: Incident, groups: Sequence[Any], now: float | None = None) -> Revision | None:
    """What `incident` becomes when every culprit's captured stack places it
    outside any collective; None when the stacks agree, or say nothing."""
    if incident.kind not in REVISABLE or not incident.culprit_ranks:
        return None
    by_rank = {k: g for g in groups for k in g.ranks}
    found = [by_rank.get(r) for r in sorted(incident.culprit_ranks)]
    if any(g is None or g.error or g.category not in OUTSIDE_COLLECTIVES for g in found):
        return None
    lead = found[0]
    what = OUTSIDE_COLLECTIVES[lead.category]
    where = lead.evidence or (lead.frames[0] if lead.frames else what)
    ranks = _fmt(incident.culprit_ranks)
    return Revision(
        kind="hang", from_kind=incident.kind, category=lead.category,
        runbook=_runbook_for(lead.category, lead.pattern_id),
        summary=f"{ranks} {'waits' if len(incident.culprit_ranks) == 1 else 'wait'} in {what} ({where}), not in a collective; its peers wait for it "
                f"(first read as a {incident.kind.replace('_', ' ')})",
        why=f"the stacks captured for it show {ranks} in {what}: {where}",
        time=now)


def past_threshold(rows: Sequence[RankRow], ranks: Sequence[int], thresholds: Any = None) -> bool:
    """Whether every one of `ranks` has been idle past its hang threshold in
    force (the watchdog's own figure, as telemetry.json's `thresholds` has it)."""
    limits = _thresholds(rows, thresholds)
    idle = {r.rank: r.last_progress_s for r in rows}
    return bool(ranks) and all(k in idle and idle[k] > limits[k] for k in ranks)
