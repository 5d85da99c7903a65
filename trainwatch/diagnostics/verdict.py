"""From telemetry + stacks + incidents to one verdict: category, culprits, why.

Pure logic. Each signal alone misleads (every rank of a hung job "waits in
all_reduce"); together they point at the rank that is somewhere else. Scores
are additive so that two independent signals beat one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any, Iterable

from trainwatch import slots

STALL_FLOOR_S = 5.0
"""A rank with no step for this long (or 5x its step time, if longer) counts as stalled."""
HEARTBEAT_STALE_S = 2.0
"""A heartbeat older than this means the rank holds the GIL or is stopped."""

# Where a category's runbook lives when no catalog pattern named one.
CATEGORY_RUNBOOK = {
    "collective_wait": "collective-timeout",
    "collective_mismatch": "collective-mismatch",
    "moe_all_to_all": "moe-all-to-all",
    "barrier": "barrier",
    "gc_collect": "gc-collect",
    "dataloader": "dataloader-stall",
    "checkpoint_io": "torch-save",
    "compile_lock": "triton-cache-lock",
    "cuda_sync": "cuda-synchronize",
    "other": "hang",
    "child_failed": "child-failed",
    "xid": "gpu-xid",
    "ecc": "gpu-ecc",
    "healthy": "healthy",
    "stopped": "stopped",
    "starting": "starting",
    "finished": "finished",
    "straggler": "straggler",
    "loss_nan": "loss-nan",
    "loss_spike": "loss-spike",
    "grad_explosion": "grad-explosion",
}
PHASE_CATEGORY = {"data": "dataloader", "checkpoint": "checkpoint_io"}


@dataclass(slots=True)
class Verdict:
    category: str
    culprit_ranks: list[int]
    summary: str
    runbook: str
    confidence: float
    evidence: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _runbook_for(category: str, pattern_id: str | None) -> str:
    if pattern_id:
        try:
            from trainwatch.diagnostics import catalog

            pattern = catalog.get(pattern_id)
            if pattern is not None and pattern.runbook:
                return pattern.runbook
        except (ImportError, AttributeError):
            pass
    return CATEGORY_RUNBOOK.get(category, "hang")


def _fmt(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def decide(ranks: list[dict], groups: list[Any] = (), incidents: list[dict] = (), hardware: list[dict] = ()) -> Verdict:
    """ranks: diagnose's per-rank rows (rank, step, phase, last_progress_s,
    heartbeat_age_s, collectives{enqueued,completed,last_op}, state, capture_error);
    groups: StackGroup list; incidents: events.jsonl records, oldest first."""
    evidence: list[str] = []
    bad_hw = [h for h in hardware if h.get("severity") in ("high", "critical")]
    if bad_hw:
        h = bad_hw[-1]
        cat = "ecc" if h.get("kind") == "ecc" or h.get("xid") in (48, 63, 64, 92, 94, 95) else "xid"
        culprits = sorted({int(h["rank"]) for h in bad_hw if h.get("rank") is not None})
        return Verdict(
            cat, culprits,
            f"GPU fault on {_fmt(culprits) if culprits else 'this node'}: Xid {h.get('xid')} ({h.get('meaning', '')}); "
            f"action: {h.get('action', 'check the GPU')}",
            _runbook_for(cat, None), 0.9, [str(h.get("evidence") or h.get("meaning") or "")],
        )
    if not ranks:
        last = incidents[-1] if incidents else None
        if last:
            return _from_incident(last, "no live ranks; showing the last incident")
        return Verdict("other", [], "no telemetry from any rank yet", "hang", 0.1, [])

    # Only incidents of the current run of the worker group count as live.
    incidents = list(incidents)
    last_restart = max((i for i, x in enumerate(incidents) if x.get("kind") == "restart"), default=-1)
    incidents = incidents[last_restart + 1:]
    mismatch = next((i for i in reversed(incidents) if i.get("kind") == "collective_mismatch"), None)
    if mismatch is not None:
        # A desync need not stall anything: later collectives pair with the wrong
        # partner and values are silently wrong. The incident is the verdict.
        culprits = sorted(mismatch.get("culprit_ranks") or [])
        return Verdict(
            "collective_mismatch", culprits, mismatch.get("summary", "collective mismatch"),
            "collective-mismatch", 0.9, [str(mismatch.get("summary", ""))],
        )
    stopped = [r for r in ranks if r.get("state") == "stopped"]
    if stopped:
        culprits = sorted(r["rank"] for r in stopped)
        return Verdict(
            "stopped", culprits,
            f"{_fmt(culprits)} {'is' if len(culprits) == 1 else 'are'} stopped (process state T: SIGSTOP, job "
            f"control or a debugger); every peer waits for it. `kill -CONT` resumes it",
            "stopped", 0.95, [f"rank {r['rank']}: process {r.get('pid')} is stopped" for r in stopped],
        )
    # A rank that finished its work (phase 'done') and exited is not a failure.
    gone = [r for r in ranks if r.get("state") in (None, "gone", "zombie") and r.get("pid")
            and r.get("phase") != "done"]
    steps = [r["step"] for r in ranks]
    step_s = [r["step_s"] for r in ranks if r.get("step_s")]
    stall_s = max(STALL_FLOOR_S, 5 * median(step_s)) if step_s else STALL_FLOOR_S
    stalled = [r for r in ranks if (r.get("last_progress_s") or 0) > stall_s]
    if gone:
        culprits = sorted(r["rank"] for r in gone)
        return Verdict("child_failed", culprits, f"{_fmt(culprits)} exited; its peers cannot make progress",
                       "child-failed", 0.85, [f"rank {r['rank']}: process {r['pid']} is gone" for r in gone])
    if not stalled:
        lp = max((r.get("last_progress_s") or 0) for r in ranks)
        recent = [i for i in incidents if i.get("kind") in ("straggler", "loss_spike", "loss_nan", "grad_explosion")]
        note = f"; last incident: {recent[-1]['kind']}" if recent else ""
        return Verdict(
            "healthy", [],
            f"healthy: steps advancing on all {len(ranks)} ranks (step {min(steps)}..{max(steps)}, "
            f"last progress {lp:.1f}s ago){note}",
            "healthy", 0.9, [f"rank {r['rank']}: step {r['step']} {r['last_progress_s']:.1f}s ago" for r in ranks],
        )

    score: dict[int, float] = {r["rank"]: 0.0 for r in ranks}
    why: dict[int, list[str]] = {r["rank"]: [] for r in ranks}

    def add(rank: int, points: float, reason: str) -> None:
        score[rank] += points
        why[rank].append(reason)

    fresh = [r for r in ranks if r.get("heartbeat_age_s") is not None and r["heartbeat_age_s"] <= HEARTBEAT_STALE_S]
    for r in ranks:
        if r.get("capture_error"):
            add(r["rank"], 3, f"py-spy could not sample it: {r['capture_error']}")
        hb = r.get("heartbeat_age_s")
        if hb is not None and hb > HEARTBEAT_STALE_S and fresh:
            add(r["rank"], 3, f"heartbeat {hb:.1f}s old: holds the GIL or is stopped")
    waiting = [r for r in ranks if r.get("phase") in slots.WAIT_PHASES]
    for r in ranks:
        if r.get("phase") not in slots.WAIT_PHASES and waiting:
            add(r["rank"], 2, f"in phase '{r.get('phase')}' while {len(waiting)} rank(s) wait in collectives")
    if len(set(steps)) > 1:
        for r in ranks:
            if r["step"] < max(steps):
                add(r["rank"], 1, f"behind at step {r['step']} (others up to {max(steps)})")
    enq = [r["collectives"]["enqueued"] for r in ranks if r.get("collectives") and r["collectives"].get("enqueued") is not None]
    if enq and len(set(enq)) > 1 and len(enq) == len(ranks):
        top = max(enq)
        for r in ranks:
            if r["collectives"]["enqueued"] < top:
                add(r["rank"], 2, f"launched collectives up to #{r['collectives']['enqueued']}, others up to #{top}")
    from_groups: dict[int, Any] = {}
    for g in groups:
        for k in g.ranks:
            from_groups[k] = g
    try:
        from trainwatch.diagnostics.stacks import odd_one_out

        odd = odd_one_out(groups) if groups else None
    except ImportError:
        odd = None
    if odd is not None:
        for k in odd.ranks:
            if k in score:
                add(k, 2, f"its stack differs from the majority: {odd.evidence or (odd.frames[:1] or [''])[0]}")
    live_incident = next((i for i in reversed(list(incidents)) if i.get("kind") in ("hang", "collective_mismatch")), None)
    if live_incident:
        for k in live_incident.get("culprit_ranks") or []:
            if k in score:
                add(k, 2, f"named by the watchdog's {live_incident['kind']} incident")

    best = max(score.values())
    culprits = sorted(k for k, v in score.items() if v == best and v > 0)
    if not culprits:
        g = groups[0] if groups else None
        cat = g.category if g is not None and g.category != "other" else "collective_wait"
        return Verdict(
            cat, [],
            f"all {len(ranks)} ranks stalled in the same place ({(g.evidence if g else None) or 'a collective'}); "
            "no rank stands out here: the culprit may be on another node, or the network/GPU",
            _runbook_for(cat, g.pattern_id if g else None), 0.4,
            [f"{len(stalled)} rank(s) without progress for > {stall_s:.0f}s"],
        )

    lead = culprits[0]
    lead_row = next(r for r in ranks if r["rank"] == lead)
    group = from_groups.get(lead)
    category, pattern_id = _category(lead_row, group, live_incident, ranks)
    victims = sorted(r["rank"] for r in ranks if r["rank"] not in culprits)
    where = (group.evidence if group is not None and group.evidence else None) or f"phase '{lead_row.get('phase')}'"
    summary = (
        f"{_fmt(culprits)} stuck ({category}) at {where} since step {lead_row['step']}"
        + (f"; {_fmt(victims)} wait for it" if victims else "")
    )
    evidence.extend(f"rank {lead}: {w}" for w in why[lead])
    confidence = min(0.95, 0.4 + 0.08 * best)
    return Verdict(category, culprits, summary, _runbook_for(category, pattern_id), round(confidence, 2), evidence)


def _category(row: dict, group: Any, incident: dict | None, ranks: list[dict]) -> tuple[str, str | None]:
    if incident and incident.get("kind") == "collective_mismatch":
        return "collective_mismatch", None
    hb = row.get("heartbeat_age_s")
    if group is not None and group.category not in ("other", "collective_wait"):
        return group.category, group.pattern_id
    if row.get("state") == "stopped":
        return "stopped", None
    if hb is not None and hb > HEARTBEAT_STALE_S:
        return "gc_collect", None
    phase_cat = PHASE_CATEGORY.get(row.get("phase", ""))
    if phase_cat:
        return phase_cat, None
    if group is not None:
        return group.category, group.pattern_id
    return "other", None


def _from_incident(incident: dict, prefix: str) -> Verdict:
    verdict = incident.get("verdict")
    if isinstance(verdict, dict) and verdict.get("category"):
        return Verdict(
            verdict["category"], list(verdict.get("culprit_ranks") or []),
            f"{prefix}: {verdict.get('summary', '')}", verdict.get("runbook") or "hang",
            float(verdict.get("confidence") or 0.5), list(verdict.get("evidence") or []),
        )
    kind = incident.get("kind", "other")
    category = incident.get("category") or kind
    return Verdict(
        category, list(incident.get("culprit_ranks") or []), f"{prefix}: {incident.get('summary', '')}",
        incident.get("runbook") or CATEGORY_RUNBOOK.get(category, "hang"), 0.6, [],
    )
