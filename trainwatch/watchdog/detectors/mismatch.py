"""Collective mismatch: ranks that issued different collectives.

Two signals, because a desync often does not hang at all (measured with gloo:
when one rank skips an all_reduce, every later all_reduce pairs with the wrong
step's partner and values are silently wrong until a rank exits):

(a) live, at every step: the count of Python-issued collectives at the end of
    each step must be equal on all ranks. The slot publishes the running count
    at step end and at every phase change, so one read gives bounds, not
    always the exact end-of-step count:
      - read while a rank's last completed step is S: count >= end(S)
        (an upper bound of end(S)), and exact when no phase began since the
        step ended (phase_mono <= progress_mono);
      - read while a rank is inside step S (last completed S-1): count <= end(S)
        (a lower bound of end(S)).
    If some rank's upper bound for step S is below another rank's lower bound,
    they cannot have issued the same collectives by the end of S. This covers
    "two ranks completed S with different counts" and "rank A completed S
    with fewer collectives than rank B has already issued inside S".
(b) RAS-style, when ranks are stalled: members of a process group parked in a
    collective must agree on the flight recorder's last launched sequence
    number and op ("3 ranks have launched up to operation 812; rank 5 only up
    to 811"). The ranks behind are the culprits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectors.base import Detector, StepTracker, TickView, grow, op_name
from trainwatch.watchdog.incident import Incident, describe_ranks

# Phases whose rank has an honest reason not to have reached the collective
# yet (loading data, writing a checkpoint, evaluating, starting up, done):
# a rank stuck there is a hang, named by the hang detector, not a desync.
# RAS-style comparison only among ranks parked in a collective. A rank that is
# behind because it is still computing, loading data or saving is hung, not
# desynchronised: the hang detector names it, with the right category.
_WAITING = np.array([slots.PHASE_CODES[p] for p in sorted(slots.WAIT_PHASES)], dtype=np.int32)
_MAX_LISTED = 32


@dataclass(kw_only=True, slots=True)
class CollectiveMismatchConfig:
    """Settings of the collective mismatch detector."""

    live_counts: bool = True
    """Compare per-step Python collective counts across ranks; turn off when ranks legitimately
    issue different numbers of collectives (e.g. pipeline stages) (flag)."""
    history: int = 8
    """Steps of per-rank count bounds kept for the live comparison (steps)."""
    stall_s: float = 3.0
    """Time without a completed step and without a newly launched collective before ranks'
    sequence numbers are compared (s)."""
    stall_factor: float = 2.0
    """...and at least this multiple of the rank's last step time, so long steps are not stalls (factor)."""
    settle_s: float = 1.0
    """Sequence numbers must be unchanged this long (five sampler rounds) before they are compared (s)."""
    heartbeat_stale_s: float = 2.0
    """A rank whose heartbeat is older holds the GIL or is stopped; it is hung, not desynced (s)."""


class CollectiveMismatchDetector(Detector):
    """Reports `collective_mismatch` while ranks disagree on their collectives."""

    name = "collective_mismatch"

    def __init__(self, config: CollectiveMismatchConfig | None = None):
        self.config = config or CollectiveMismatchConfig()
        if self.config.history < 2:
            raise ValueError(f"collective mismatch history must be >= 2 steps; got {self.config.history}")
        h = self.config.history
        self._steps = StepTracker()
        # Bounds of each rank's end-of-step count, in a ring keyed by step % h;
        # the tag says which step a cell belongs to.
        self._up_tag = np.full((0, h), -1, dtype=np.int64)
        self._up_val = np.zeros((0, h), dtype=np.int64)
        self._lo_tag = np.full((0, h), -1, dtype=np.int64)
        self._lo_val = np.zeros((0, h), dtype=np.int64)
        # Last seen (pg, enqueued) per rank and group slot, and since when.
        self._pg = np.full((0, slots.MAX_GROUPS), -1, dtype=np.int64)
        self._enq = np.full((0, slots.MAX_GROUPS), -2, dtype=np.int64)
        self._since = np.zeros((0, slots.MAX_GROUPS))
        self._tracked = np.full(0, np.nan)

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        ranks = t["rank"]
        size = int(ranks.max()) + 1
        self._up_tag = grow(self._up_tag, size, -1)
        self._up_val = grow(self._up_val, size, 0)
        self._lo_tag = grow(self._lo_tag, size, -1)
        self._lo_val = grow(self._lo_val, size, 0)
        self._pg = grow(self._pg, size, -1)
        self._enq = grow(self._enq, size, -2)
        self._since = grow(self._since, size, 0.0)
        self._tracked = grow(self._tracked, size, np.nan)
        _, restarted = self._steps.update(t)
        if restarted.any():
            gone = ranks[restarted]
            self._up_tag[gone] = -1
            self._lo_tag[gone] = -1
        out = []
        if self.config.live_counts:
            found = self._live(view)
            if found is not None:
                out.append(found)
        found = self._ras(view)
        if found is not None:
            out.append(found)
        return out

    # ---- (a) live per-step counts ------------------------------------------------

    def _bound(self, tag: np.ndarray, val: np.ndarray, ranks, steps, counts, keep) -> None:
        if len(ranks) == 0:
            return
        j = steps % self.config.history
        same = tag[ranks, j] == steps
        val[ranks, j] = np.where(same, keep(val[ranks, j], counts), counts)
        tag[ranks, j] = steps

    def _live(self, view: TickView) -> Incident | None:
        t = view.table
        ranks = t["rank"]
        step = t["step"]
        count = t["py_collectives"]
        done = step >= 1
        exact = done & (t["phase_mono"] <= t["progress_mono"])
        self._bound(self._up_tag, self._up_val, ranks[done], step[done], count[done], np.minimum)
        self._bound(self._lo_tag, self._lo_val, ranks, step + 1, count, np.maximum)
        self._bound(self._lo_tag, self._lo_val, ranks[exact], step[exact], count[exact], np.maximum)

        h = self.config.history
        # The steps ranks are at now and the ones they are inside: a skipped
        # call offsets every later count, so recent steps are enough.
        first = int(step[done].min()) if done.any() else 1
        last = int(step.max()) + 1
        up_tag, up_val = self._up_tag[ranks], self._up_val[ranks]
        lo_tag, lo_val = self._lo_tag[ranks], self._lo_val[ranks]
        for s in range(max(first, last - h + 2), last + 1):
            j = s % h
            has_up = up_tag[:, j] == s
            has_lo = lo_tag[:, j] == s
            if not (has_up.any() and has_lo.any()):
                continue
            up = up_val[:, j]
            lo = lo_val[:, j]
            min_up = up[has_up].min()
            max_lo = lo[has_lo].max()
            if min_up >= max_lo:
                continue
            behind = has_up & (up < max_lo)
            ahead = has_lo & (lo > min_up)
            return self._live_incident(view, s, behind, ahead, up, lo, int(min_up), int(max_lo))
        return None

    def _live_incident(self, view, s, behind, ahead, up, lo, min_up, max_lo) -> Incident:
        ranks = view.table["rank"]
        # The ranks behind are the culprits (one skipped call makes everyone
        # else look ahead). When the side behind is the larger one, a single
        # rank issuing an extra call is the likelier story: name the minority.
        extra = int(behind.sum()) > int(ahead.sum())
        if extra:
            c_rows, v_rows = np.nonzero(ahead)[0], np.nonzero(behind)[0]
            counts = {int(ranks[r]): int(lo[r]) for r in c_rows[:_MAX_LISTED]}
            text = (
                f"collective mismatch: {describe_ranks(ranks[c_rows])} issued more collectives than "
                f"{describe_ranks(ranks[v_rows])} by the end of step {s} "
                f"(at least {max_lo} vs at most {min_up}): an extra collective desynchronises every later one"
            )
        else:
            c_rows, v_rows = np.nonzero(behind)[0], np.nonzero(ahead)[0]
            counts = {int(ranks[r]): int(up[r]) for r in c_rows[:_MAX_LISTED]}
            text = (
                f"collective mismatch: {describe_ranks(ranks[c_rows])} issued fewer collectives than "
                f"{describe_ranks(ranks[v_rows])} by the end of step {s} "
                f"(at most {min_up} vs at least {max_lo}): a skipped collective pairs every later one "
                f"with the wrong step's partner"
            )
        return Incident(
            kind="collective_mismatch",
            culprit_ranks=ranks[c_rows].tolist(),
            victims=ranks[v_rows].tolist(),
            summary=text,
            severity="high",
            runbook="collective-mismatch",
            category="collective_mismatch",
            evidence={
                "source": "py_collectives",
                "step": s,
                "culprit_counts": counts,
                "peers_min_upper": min_up,
                "peers_max_lower": max_lo,
                "extra_collective": extra,
            },
            detected_mono=view.now,
        )

    # ---- (b) RAS-style sequence numbers of stalled ranks -------------------------

    def _ras(self, view: TickView) -> Incident | None:
        t = view.table
        cfg = self.config
        now = view.now
        age = now - t["progress_mono"]
        # Only ranks without a step for a while can be stalled; skipping the
        # others keeps a healthy 4096-rank tick cheap.
        rows = np.nonzero(age >= min(cfg.settle_s, cfg.stall_s))[0]
        if len(rows) == 0:
            return None
        sub = t[rows]
        ranks = sub["rank"]
        width = int(np.clip(sub["ngroups"], 0, slots.MAX_GROUPS).max())
        if width == 0:
            return None
        groups = sub["groups"][:, :width]
        enq = groups["enqueued"]
        pgs = groups["pg"].astype(np.int64)
        # Restart the "unchanged since" clock of a rank that completed a step
        # since we last looked at it, or whose sequence numbers moved.
        fresh = self._tracked[ranks] != sub["progress_mono"]
        changed = fresh[:, None] | (enq != self._enq[ranks, :width]) | (pgs != self._pg[ranks, :width])
        since = np.where(changed, now, self._since[ranks, :width])
        self._enq[ranks, :width] = enq
        self._pg[ranks, :width] = pgs
        self._since[ranks, :width] = since
        self._tracked[ranks] = sub["progress_mono"]

        limit = np.fmax(cfg.stall_s, cfg.stall_factor * sub["step_s"])
        hb = sub["heartbeat_mono"]
        hb_stale = (hb > 0) & (now - hb > cfg.heartbeat_stale_s)
        stalled = (age[rows] >= limit) & (sub["step"] >= 1) & np.isin(sub["phase"], _WAITING) & ~hb_stale
        if not stalled.any():
            return None
        ng = np.clip(sub["ngroups"], 0, slots.MAX_GROUPS)
        valid = (np.arange(width)[None, :] < ng[:, None]) & stalled[:, None]
        # Sampled at different instants, moving counters always differ a little;
        # compare only numbers that have settled.
        valid &= (now - since >= cfg.settle_s) & (enq >= 0)
        r, k = np.nonzero(valid)
        if len(r) < 2:
            return None
        e_pg = pgs[r, k]
        e_enq = enq[r, k]
        candidates = []
        op_mismatch = None
        steps = sub["step"]
        for pg in np.unique(e_pg):
            sel = e_pg == pg
            if sel.sum() < 2:
                continue
            members, seqs = r[sel], e_enq[sel]
            top = int(seqs.max())
            if seqs.min() < top:
                # A rank that skipped a collective in one group runs ahead into
                # the next step and is then "ahead" in the other groups. The
                # group that tells the truth is the one where the ranks behind
                # in sequence are not behind in steps.
                lag = float(steps[members[seqs < top]].mean() - steps[members[seqs == top]].mean())
                candidates.append((lag, -int(pg), members, seqs, top))
                continue
            raw = groups["last_op"][members, k[sel]]
            if op_mismatch is None and len(np.unique(raw[raw != b""])) > 1:
                op_mismatch = (int(pg), members, [op_name(o) for o in raw], top)
        if candidates:
            _lag, neg_pg, members, seqs, top = max(candidates, key=lambda c: (c[0], c[1]))
            return self._seq_incident(view, -neg_pg, rows[members], seqs, top)
        if op_mismatch is not None:
            pg, members, ops, top = op_mismatch
            return self._op_incident(view, pg, rows[members], ops, top)
        return None

    def _seq_incident(self, view, pg, rows, seqs, top) -> Incident:
        ranks = view.table["rank"]
        at_top = rows[seqs == top]
        parts = [f"{len(at_top)} rank{'s' if len(at_top) != 1 else ''} have launched up to operation {top}"]
        behind_by_seq: dict[int, list[int]] = {}
        for row, seq in zip(rows, seqs):
            if seq < top:
                behind_by_seq.setdefault(int(seq), []).append(int(ranks[row]))
        for seq in sorted(behind_by_seq, reverse=True):
            parts.append(f"{describe_ranks(behind_by_seq[seq])} only up to {seq}")
        culprits = [r for rs in behind_by_seq.values() for r in rs]
        return Incident(
            kind="collective_mismatch",
            culprit_ranks=culprits,
            victims=ranks[at_top].tolist(),
            summary=f"collective mismatch in pg {pg}: " + "; ".join(parts),
            severity="high",
            runbook="collective-mismatch",
            category="collective_mismatch",
            evidence={
                "source": "flight_recorder",
                "pg": pg,
                "top_enqueued": top,
                "ranks_at_top": len(at_top),
                "behind": {r: s for s, rs in behind_by_seq.items() for r in rs[:_MAX_LISTED]},
                "stalled_s": round(float(view.now - view.table["progress_mono"][rows].max()), 3),
            },
            detected_mono=view.now,
        )

    def _op_incident(self, view, pg, rows, ops, top) -> Incident:
        ranks = view.table["rank"]
        by_op = Counter(o for o in ops if o)
        best = max(by_op.values())
        # Ties: the op of the lowest rank is the reference (rank 0 by convention).
        ref = next(o for r, o in sorted(zip(ranks[rows], ops)) if o and by_op[o] == best)
        odd: dict[str, list[int]] = {}
        for row, o in zip(rows, ops):
            if o and o != ref:
                odd.setdefault(o, []).append(int(ranks[row]))
        parts = [f"at operation {top}, {by_op[ref]} rank{'s' if by_op[ref] != 1 else ''} launched '{ref}'"]
        parts += [f"{describe_ranks(rs)} launched '{o}'" for o, rs in sorted(odd.items())]
        culprits = [r for rs in odd.values() for r in rs]
        return Incident(
            kind="collective_mismatch",
            culprit_ranks=culprits,
            victims=[int(ranks[row]) for row, o in zip(rows, ops) if o == ref],
            summary=f"collective mismatch in pg {pg}: " + "; ".join(parts),
            severity="high",
            runbook="collective-mismatch",
            category="collective_mismatch",
            evidence={"source": "flight_recorder", "pg": pg, "seq": top, "ops": dict(by_op)},
            detected_mono=view.now,
        )
