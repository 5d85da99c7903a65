"""Who stalled a job: one culprit rule, shared by the sidecar's hang detector
and `trainwatch diagnose`'s verdict, so the two never disagree on a rank.

In a synchronous job every rank stops at once, so "no progress" alone names
everyone. The rule separates culprits from victims with facts both callers
have: a rank waiting in a collective (backward, collective phase) is a victim;
a rank somewhere else (data loading, compute, checkpoint I/O) past its
threshold is a culprit; so is a rank whose heartbeat stopped (it holds the
GIL or is stopped); when everyone waits, the rank behind in steps, then in
collective sequence number, is the one the others wait for.

Pure numpy over aligned arrays: the detector passes slot-table columns, the
verdict builds the same arrays from diagnose's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainwatch import slots

FLOOR_S = 5.0
"""Minimum time without progress before a rank counts as stalled (s)."""
K = 5.0
"""...or k x the p99 (diagnose: the median) of its recent step times, when longer (factor)."""
HEARTBEAT_STALE_S = 2.0
"""Heartbeat age meaning the rank holds the GIL or is stopped; the sampler beats every 0.2 s (s)."""
QUIET_FRACTION = 0.5
"""A rank is a culprit candidate after this fraction of its threshold: a healthy
rank completes a step every p99 at worst, so half of k x p99 without progress
is already far outside normal; it lets a culprit whose last step ended a few ms
after its victims' be named on the same tick."""
WAIT_CODES = np.array(sorted(slots.PHASE_CODES[p] for p in slots.WAIT_PHASES), dtype=np.int32)


@dataclass(slots=True)
class Facts:
    """Per-rank facts, one array per field, rows aligned."""

    step: np.ndarray
    age: np.ndarray
    """Seconds since the rank's last progress."""
    base: np.ndarray
    """Its normal threshold (the floor or k x its p99 step time), no allowances."""
    in_wait: np.ndarray
    """In a phase that waits on peers (backward, collective)."""
    lenient: np.ndarray
    """Within an honest allowance: warm-up, or a slow phase it works through."""
    started: np.ndarray
    """Completed at least one step."""
    hb_stale: np.ndarray
    """Heartbeat older than HEARTBEAT_STALE_S."""
    involved: np.ndarray
    """Stalled past its own threshold: the ranks the stall is about."""
    groups: GroupEntries
    """Collective progress of every row, flattened."""


@dataclass(slots=True)
class Blame:
    culprit: np.ndarray
    victims: np.ndarray
    pattern: str
    """rank_elsewhere, gil_or_stopped, behind_in_step, behind_in_seq or all_in_collective."""
    behind_seq: tuple[int, int, dict[int, int]] | None = None
    """(pg, highest launched seq, {row: seq} behind) for behind_in_seq."""


@dataclass(slots=True)
class GroupEntries:
    """The (row, process group) pairs of a table, flattened: one entry per
    collective group a rank reported, so groups compare with column ops."""

    row: np.ndarray
    """Row index into the table."""
    pg: np.ndarray
    """Process group id."""
    enqueued: np.ndarray
    """Last launched collective sequence number."""
    completed: np.ndarray
    """Last completed collective sequence number."""
    last_op: np.ndarray
    """Last launched op name (bytes)."""

    @classmethod
    def of(cls, table: np.ndarray, rows: np.ndarray | None = None) -> GroupEntries:
        """From a slot table (dtype slots.slot_dtype())."""
        sub = table if rows is None else table[rows]
        base = np.arange(len(table)) if rows is None else np.asarray(rows)
        ng = np.clip(sub["ngroups"], 0, slots.MAX_GROUPS)
        r, k = np.nonzero(np.arange(slots.MAX_GROUPS)[None, :] < ng[:, None])
        g = sub["groups"][r, k]
        return cls(row=base[r], pg=g["pg"], enqueued=g["enqueued"], completed=g["completed"], last_op=g["last_op"])

    @classmethod
    def of_rows(cls, groups: list[list[dict]]) -> GroupEntries:
        """From diagnose's rows: each row's list of {pg, enqueued, completed, last_op}."""
        flat = [(i, g["pg"], g["enqueued"], g["completed"], str(g.get("last_op") or "").encode())
                for i, gs in enumerate(groups) for g in gs]
        cols = list(zip(*flat)) if flat else [(), (), (), (), ()]
        return cls(row=np.array(cols[0], dtype=np.int64), pg=np.array(cols[1], dtype=np.int64),
                   enqueued=np.array(cols[2], dtype=np.int64), completed=np.array(cols[3], dtype=np.int64),
                   last_op=np.array(cols[4], dtype="S16"))


def seq_behind(entries: GroupEntries, rows: np.ndarray | None = None) -> tuple[int, int, dict[int, int]] | None:
    """First process group (lowest id) whose ranks disagree on the last
    launched sequence number, among `rows` (all when None): (pg, highest seq,
    {row: seq} of the rows behind). None when all agree."""
    keep = np.ones(len(entries.row), dtype=bool) if rows is None else np.isin(entries.row, rows)
    keep &= entries.enqueued >= 0
    pgs = entries.pg[keep]
    enq = entries.enqueued[keep]
    erow = entries.row[keep]
    for pg in np.unique(pgs):
        sel = pgs == pg
        e = enq[sel]
        if len(e) < 2 or e.min() == e.max():
            continue
        top = int(e.max())
        behind = e < top
        return int(pg), top, {int(r): int(v) for r, v in zip(erow[sel][behind], e[behind])}
    return None


def blame(f: Facts) -> Blame:
    """Culprits and victims of a stall (f.involved must name at least one row)."""
    quiet = f.age > f.base * QUIET_FRACTION
    involved = f.involved
    culprit = (involved & ~f.in_wait) | (quiet & f.hb_stale)
    # Not yet past its own threshold but clearly not progressing either,
    # outside any wait and with no excuse (warm-up, a slow phase it works through).
    culprit |= quiet & ~f.in_wait & f.started & ~f.lenient & (f.step <= f.step[involved].max())
    pattern = "gil_or_stopped" if (culprit & f.hb_stale).any() else "rank_elsewhere"
    behind = None
    if not culprit.any():
        pattern = "all_in_collective"
        rows = np.nonzero(involved)[0]
        low = f.step[rows].min()
        if low < f.step[rows].max():
            culprit[rows[f.step[rows] == low]] = True
            pattern = "behind_in_step"
        else:
            behind = seq_behind(f.groups, rows)
            if behind is not None:
                culprit[list(behind[2])] = True
                pattern = "behind_in_seq"
    victims = (involved | quiet) & f.in_wait & ~culprit
    return Blame(culprit, victims, pattern, behind)
