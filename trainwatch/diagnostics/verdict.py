"""From telemetry + stacks + incidents to one verdict: category, culprits, why.

Pure logic. Who stalled the job comes from the same culprit rule the sidecar's
hang detector uses (trainwatch.diagnostics.culprit), so `diagnose` and the
watchdog's incident never disagree on a rank. Stacks then say where the
culprit is (the category and runbook) and add confidence when they agree;
when the rule names nobody (every rank in the same collective, nobody behind),
a stack that stands out, a rank py-spy could not sample or the watchdog's own
incident still can.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Iterable, Sequence

import numpy as np

from trainwatch import codec, kinds, slots
from trainwatch.rankrow import RankRow
from trainwatch.records import HardwareFinding, Incident, Verdict
from trainwatch.diagnostics import catalog
from trainwatch.diagnostics.culprit import FLOOR_S, HEARTBEAT_STALE_S, K, Facts, GroupEntries, blame
from trainwatch.diagnostics.stack_groups import odd_one_out
from trainwatch.diagnostics.xid import ECC_CODES


# Where a category's runbook lives when no catalog pattern named one; a
# category that is an incident kind has the kind's runbook (kinds.py).
CATEGORY_RUNBOOK = {k.name: k.runbook for k in kinds.KINDS.values()} | {
    "collective_wait": "collective-wait",
    "moe_all_to_all": "moe-all-to-all",
    "barrier": "barrier-hang",
    "gc_collect": "gc-hang",
    "dataloader": "dataloader-stall",
    "checkpoint_io": "checkpoint-io",
    "compile_lock": "triton-cache-lock",
    "cuda_sync": "cuda-sync",
    "other": "hang",
    "child_failed": "child-failed",
    "healthy": "healthy",
    "suspect": "hang",
    "stopped": "stopped",
    "preempted": "preempted",
    "starting": "starting",
    "finished": "finished",
}
ALERT_ONLY_KINDS = kinds.ALERT_ONLY_KINDS
"""Incident kinds that leave a job running: the verdict names an open one."""
SUSPECT_STEPS = 5.0
"""A rank idle this many of its usual steps (and at least SUSPECT_MIN_S) is
`suspect`: not yet hung by the watchdog's rule, no longer healthy."""
SUSPECT_MIN_S = 0.5
"""...idle at least this long (s)..."""
SUSPECT_FRACTION = 0.5
"""...and, in a phase with honest long pauses (start-up, checkpoint,
evaluation), this fraction of its hang threshold."""
FALLBACK_RUNBOOK = "hang"
"""Runbook of a category the table does not know, or of an incident that named none."""
PHASE_CATEGORY = {"data": "dataloader", "checkpoint": "checkpoint_io"}


def _runbook_for(category: str, pattern_id: str | None) -> str:
    """The runbook of the catalog pattern that matched, else the category's."""
    pattern = catalog.get(pattern_id)
    if pattern is not None:
        return pattern.runbook
    return CATEGORY_RUNBOOK.get(category, FALLBACK_RUNBOOK)


def _fmt(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


@dataclass(slots=True)
class HangThresholds:
    """The hang thresholds in force, as telemetry.json's `thresholds.hang` has them."""

    floor_s: float = FLOOR_S
    ranks: dict[str, float] = field(default_factory=dict)
    """Each rank's threshold (s), by rank as a string."""


@dataclass(slots=True)
class Thresholds:
    """telemetry.json's `thresholds` (the verdict reads the hang part)."""

    hang: HangThresholds | None = None


def decide(ranks: Sequence[RankRow], groups: list[Any] = (), incidents: Sequence[Incident] = (),
           hardware: Sequence[HardwareFinding] = (), thresholds: Any = None) -> Verdict:
    """ranks: the job's rank rows, with the process state and capture error
    diagnose (or the responder) saw;
    groups: StackGroup list; incidents: the job's incidents (JobDir.incidents),
    oldest first; hardware: the GPU faults among them; thresholds: the hang
    thresholds in force (telemetry.json's `thresholds`: `{"hang": {"floor_s",
    "k", "ranks": {rank: seconds}}}`), so the verdict judges a rank idle by the
    same numbers as the watchdog.

    Never `healthy` while an incident of the current run is open or a rank is
    idle past its threshold; before the threshold, a rank idle well past its
    usual step is `suspect`."""
    evidence: list[str] = []
    bad_hw = [h for h in hardware if h.severity in ("high", "critical")]
    if bad_hw:
        h = bad_hw[-1]
        cat = "ecc" if h.kind == "ecc" or h.xid in ECC_CODES else "xid"
        culprits = sorted({h.rank for h in bad_hw if h.rank is not None})
        return Verdict(
            cat, culprits,
            f"GPU fault on {_fmt(culprits) if culprits else 'this node'}: Xid {h.xid} ({h.meaning or ''}); "
            f"action: {h.action or 'check the GPU'}",
            _runbook_for(cat, None), 0.9, [h.evidence or h.meaning or ""],
        )
    if not ranks:
        last = incidents[-1] if incidents else None
        if last:
            return from_incident(last, "no live ranks; showing the last incident")
        return Verdict("other", [], "no telemetry from any rank yet", _runbook_for("other", None), 0.1, [])

    # Only incidents of the current run of the worker group count as live.
    incidents = list(incidents)
    last_restart = max((i for i, x in enumerate(incidents) if x.kind == "restart"), default=-1)
    # ...except a fault that stopped training and is still open: it stays open
    # across its restart until its ranks complete a step, and diagnose says so.
    recovering = [i for i in incidents[:last_restart + 1] if i.status == "open"
                  and getattr(kinds.spec(i.kind), "resolution", None) is kinds.Resolution.PROGRESS]
    incidents = incidents[last_restart + 1:]
    mismatch = next((i for i in reversed(incidents) if i.kind == "collective_mismatch"), None)
    if mismatch is not None:
        # A desync need not stall anything: later collectives pair with the wrong
        # partner and values are silently wrong. The incident is the verdict.
        return Verdict(
            "collective_mismatch", sorted(mismatch.culprit_ranks), mismatch.summary or "collective mismatch",
            _runbook_for("collective_mismatch", None), 0.9, [mismatch.summary],
        )
    stopped = [r for r in ranks if r.state == "stopped"]
    if stopped:
        culprits = sorted(r.rank for r in stopped)
        return Verdict(
            "stopped", culprits,
            f"{_fmt(culprits)} {'is' if len(culprits) == 1 else 'are'} stopped (process state T: SIGSTOP, job "
            f"control or a debugger); every peer waits for it. `kill -CONT` resumes it",
            _runbook_for("stopped", None), 0.95,
            [f"rank {r.rank}: process {r.pid} is stopped" for r in stopped],
        )
    # A rank that finished its work (phase 'done') and exited is not a failure.
    gone = [r for r in ranks if r.state in (None, "gone", "zombie") and r.pid and r.phase != "done"]
    steps = [r.step for r in ranks]
    step_s = [r.step_s for r in ranks if r.step_s]
    still_open = recovering + [i for i in incidents if i.status == "open" and i.kind in kinds.KINDS]
    limits = _thresholds(ranks, thresholds)
    for rank, called in _called_at(still_open).items():  # the figure the watchdog judged by, learnt or not
        if rank in limits:
            limits[rank] = min(limits[rank], called)
    stalled = [r for r in ranks if r.last_progress_s > limits[r.rank]]
    fault = next((i for i in reversed(still_open) if i.kind not in ALERT_ONLY_KINDS), None)
    if gone and fault is not None:
        # Ranks gone while a fault is open: the fault (a crash's culprit), or
        # the teardown of the restart it asked for, not a new failure of them all.
        return _from_open(fault, groups, prefix="restarting after" if fault.restart_requested else "open incident")
    if gone:
        culprits = sorted(r.rank for r in gone)
        return Verdict("child_failed", culprits, f"{_fmt(culprits)} exited; its peers cannot make progress",
                       _runbook_for("child_failed", None), 0.85,
                       [f"rank {r.rank}: process {r.pid} is gone" for r in gone])
    if not stalled and fault is not None:
        return _from_open(fault, groups, prefix="recovering after" if fault in recovering else "open incident")
    if not stalled:
        lp = max(r.last_progress_s for r in ranks)
        typical = median(step_s) if step_s else 0.0
        suspects = [r for r in ranks if r.last_progress_s > max(
            SUSPECT_MIN_S, SUSPECT_STEPS * typical,
            SUSPECT_FRACTION * limits[r.rank] if r.phase in slots.SLOW_PHASES else 0.0)]
        # Peers waiting on a stuck rank are idle too: name the ones not waiting.
        suspects = [r for r in suspects if r.phase not in slots.WAIT_PHASES] or suspects
        if suspects:
            who = sorted(r.rank for r in suspects)
            return Verdict(
                "suspect", who,
                f"{_fmt(who)} made no progress for {max(r.last_progress_s for r in suspects):.1f}s, short of the "
                f"hang threshold in force ({min(limits[k] for k in who):.1f}s); the watchdog calls it hung then",
                _runbook_for("suspect", None), 0.5,
                [f"rank {r.rank}: no progress for {r.last_progress_s:.1f}s in phase '{r.phase}' "
                 f"(threshold {limits[r.rank]:.1f}s)" for r in suspects])
        alert = next((i for i in reversed(still_open) if i.kind in ALERT_ONLY_KINDS), None)
        if alert is not None:
            return _from_open(alert, groups, prefix="training, with an open incident")
        recent = [i for i in incidents if i.kind in ALERT_ONLY_KINDS]
        note = f"; last incident: {recent[-1].kind} (resolved)" if recent else ""
        return Verdict(
            "healthy", [],
            f"healthy: steps advancing on all {len(ranks)} ranks (step {min(steps)}..{max(steps)}, "
            f"last progress {lp:.1f}s ago){note}",
            _runbook_for("healthy", None), 0.9,
            [f"rank {r.rank}: step {r.step} {r.last_progress_s:.1f}s ago" for r in ranks],
        )

    from_groups = {k: g for g in groups for k in g.ranks}
    live_incident = next((i for i in reversed(still_open) if i.kind in kinds.CAPTURE_KINDS), None)
    culprits, why = _culprits(ranks, limits)
    odd = odd_one_out(groups) if groups else None
    confidence = 0.6 if culprits else 0.45
    if not culprits:
        # The rule names nobody; what only diagnose has may still: a rank py-spy
        # could not sample, a stack that stands out, the watchdog's incident.
        unsampled = sorted(r.rank for r in ranks if r.capture_error)
        if unsampled and len(unsampled) < len(ranks):
            culprits = unsampled
            for r in ranks:
                if r.rank in unsampled:
                    why[r.rank].append(f"py-spy could not sample it: {r.capture_error}")
        elif odd is not None:
            culprits = sorted(odd.ranks)
        elif live_incident and live_incident.culprit_ranks:
            culprits = sorted(k for k in live_incident.culprit_ranks if k in why)
    if not culprits:
        g = groups[0] if groups else None
        cat = g.category if g is not None and g.category != "other" else "collective_wait"
        return Verdict(
            cat, [],
            f"all {len(ranks)} ranks stalled in the same place ({(g.evidence if g else None) or 'a collective'}); "
            "no rank stands out here: the culprit may be on another node, or the network/GPU",
            _runbook_for(cat, g.pattern_id if g else None), 0.4,
            [f"{len(stalled)} rank(s) without progress past the hang threshold in force "
             f"({min(limits[r.rank] for r in stalled):.1f}s)"],
        )
    lead = culprits[0]
    if odd is not None and set(odd.ranks) == set(culprits):
        confidence += 0.15
        why[lead].append(f"its stack differs from the majority: {odd.evidence or (odd.frames[:1] or [''])[0]}")
    if live_incident and set(live_incident.culprit_ranks) == set(culprits):
        confidence += 0.1
        why[lead].append(f"named by the watchdog's {live_incident.kind} incident")
    confidence += 0.05 * min(2, len(why[lead]))
    lead_row = next(r for r in ranks if r.rank == lead)
    group = from_groups.get(lead)
    category, pattern_id = _category(lead_row, group, live_incident)
    victims = sorted(r.rank for r in ranks if r.rank not in culprits)
    where = (group.evidence if group is not None and group.evidence else None) or f"phase '{lead_row.phase}'"
    summary = (
        f"{_fmt(culprits)} stuck ({category}) at {where} since step {lead_row.step}"
        + (f"; {_fmt(victims)} wait for it" if victims else "")
    )
    evidence.append(f"rank {lead}: no progress for {lead_row.last_progress_s:.1f}s, past the hang threshold in "
                    f"force ({limits[lead]:.1f}s)")
    evidence.extend(f"rank {lead}: {w}" for w in why[lead])
    return Verdict(category, culprits, summary, _runbook_for(category, pattern_id), round(min(0.95, confidence), 2),
                   evidence)


def _thresholds(ranks: Sequence[RankRow], thresholds: Any) -> dict[int, float]:
    """Each rank's hang threshold in force: the watchdog's own figure where
    telemetry.json has it, else max(its floor, k x the median step)."""
    known = codec.decode(Thresholds, thresholds) if thresholds is not None else None
    hang = known.hang if known is not None else None
    if hang is None:
        step_s = [r.step_s for r in ranks if r.step_s]
        fallback_s = max(FLOOR_S, K * median(step_s)) if step_s else FLOOR_S
        return {r.rank: fallback_s for r in ranks}
    out = {}
    for r in ranks:
        value = hang.ranks.get(str(r.rank), 0.0)
        out[r.rank] = value if value > 0 else hang.floor_s
    return out


def _called_at(incidents: Sequence[Incident]) -> dict[int, float]:
    """Each culprit's hang threshold as the watchdog held it when it called the
    hang (its evidence): a learnt steady-step threshold may be below the floor
    that telemetry.json's thresholds say."""
    out: dict[int, float] = {}
    for incident in incidents:
        culprits = incident.evidence.get("culprits") if incident.kind == "hang" else None
        for rank, facts in (culprits.items() if isinstance(culprits, dict) else ()):
            value = codec.finite_number(facts.get("threshold_s")) if isinstance(facts, dict) else None
            try:
                rank = int(rank)
            except (TypeError, ValueError):
                continue
            if value is not None and value > 0:
                out[rank] = min(out.get(rank, value), value)
    return out


def _from_open(incident: Incident, groups: list[Any], prefix: str = "open incident") -> Verdict:
    """The verdict of an open incident: its own kind, culprits and runbook (a
    capture's verdict refines the category), so diagnose says what the console
    said."""
    culprits = sorted(incident.culprit_ranks)
    captured = incident.verdict
    category = (captured.category if captured else None) or incident.category or incident.kind
    if captured is None and culprits:
        group = next((g for g in groups if culprits[0] in g.ranks), None)
        if group is not None and group.category not in ("other", "collective_wait"):
            category = group.category
    runbook = incident.runbook or CATEGORY_RUNBOOK.get(category, FALLBACK_RUNBOOK)
    ident = f" {incident.id}" if incident.id else ""
    return Verdict(category, culprits, f"{prefix} ({incident.kind}{ident}): {incident.summary}",
                   runbook, 0.9, [incident.summary])


def _culprits(ranks: Sequence[RankRow], limits: dict[int, float]) -> tuple[list[int], dict[int, list[str]]]:
    """The shared culprit rule over diagnose's rows (each rank held to its own
    threshold), with the reasons for each culprit."""
    stall_s = np.array([limits[r.rank] for r in ranks], dtype=float)
    phase = [r.phase for r in ranks]
    step = np.array([r.step for r in ranks], dtype=np.int64)
    age = np.array([r.last_progress_s for r in ranks], dtype=float)
    hb = np.array([np.nan if r.heartbeat_age_s is None else r.heartbeat_age_s for r in ranks], dtype=float)
    fresh = bool((hb <= HEARTBEAT_STALE_S).any())
    facts = Facts(
        step=step, age=age, base=stall_s,
        in_wait=np.array([p in slots.WAIT_PHASES for p in phase]),
        lenient=np.array([p in slots.SLOW_PHASES for p in phase]) & (step >= 1),
        started=step >= 1,
        # All heartbeats old says more about the sampling than about any rank.
        hb_stale=(hb > HEARTBEAT_STALE_S) & fresh,
        involved=age > stall_s,
        groups=GroupEntries.of_rows([[dataclasses.asdict(g) for g in r.groups] for r in ranks]),
    )
    b = blame(facts)
    culprits = sorted(ranks[i].rank for i in np.nonzero(b.culprit)[0])
    why: dict[int, list[str]] = {r.rank: [] for r in ranks}
    waiting = int(facts.in_wait.sum())
    for i, r in enumerate(ranks):
        if not b.culprit[i]:
            continue
        reasons = why[r.rank]
        if facts.hb_stale[i]:
            reasons.append(f"heartbeat {hb[i]:.1f}s old: holds the GIL or is stopped")
        if not facts.in_wait[i] and waiting:
            reasons.append(f"in phase '{r.phase}' while {waiting} rank(s) wait in collectives")
        if step[i] < step.max():
            reasons.append(f"behind at step {step[i]} (others up to {step.max()})")
        if b.behind_seq is not None and i in b.behind_seq[2]:
            reasons.append(f"launched collectives up to #{b.behind_seq[2][i]}, others up to #{b.behind_seq[1]}")
        if r.capture_error:
            reasons.append(f"py-spy could not sample it: {r.capture_error}")
    return culprits, why


def _category(row: RankRow, group: Any, incident: Incident | None) -> tuple[str, str | None]:
    if incident and incident.kind == "collective_mismatch":
        return "collective_mismatch", None
    hb = row.heartbeat_age_s
    if group is not None and group.category not in ("other", "collective_wait"):
        return group.category, group.pattern_id
    if row.state == "stopped":
        return "stopped", None
    if hb is not None and hb > HEARTBEAT_STALE_S:
        return "gc_collect", None
    phase_cat = PHASE_CATEGORY.get(row.phase)
    if phase_cat:
        return phase_cat, None
    if group is not None:
        return group.category, group.pattern_id
    return "other", None


def from_incident(incident: Incident, prefix: str) -> Verdict:
    """The verdict an incident's capture reached (else its own words), said with `prefix`."""
    v = incident.verdict
    if v is not None and v.category:
        return Verdict(v.category, list(v.culprit_ranks), f"{prefix}: {v.summary}", v.runbook or FALLBACK_RUNBOOK,
                       v.confidence or 0.5, list(v.evidence))
    category = incident.category or incident.kind
    return Verdict(
        category, list(incident.culprit_ranks), f"{prefix}: {incident.summary}",
        incident.runbook or CATEGORY_RUNBOOK.get(category, FALLBACK_RUNBOOK), 0.6, [],
    )
