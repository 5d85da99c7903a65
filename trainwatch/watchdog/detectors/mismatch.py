"""Collective mismatch: ranks that issued different collectives.

Two signals, because a desync often does not hang at all (measured with gloo:
when one rank skips an all_reduce, every later all_reduce pairs with the wrong
step's partner and values are silently wrong until a rank exits):

(a) live, at equal step numbers: at the end of every step each rank records,
    in one atomic write with the step, how many Python collectives it issued
    on world-spanning groups and the default process group's sequence number
    (which also counts DDP's and FSDP's own collectives). The slot keeps the
    last few steps, so ranks a step or two apart still share steps to compare.
    Collectives issued between steps (a metric all-reduce after the optimizer
    step, FSDP's prefetches, gradient accumulation) land in the next step's
    count on every rank alike, so a healthy job always agrees. A skipped or
    extra collective offsets every later count: a mismatch is called only
    when the same ranks disagree in the same direction at `persist_steps`
    consecutive compared steps, never from one boundary reading.
(b) RAS-style, when ranks are stuck: when every stalled rank is parked in a
    collective (one launched and not completed, or blocked in a Python
    collective call) for about as long as a hang takes, the members of each
    process group must agree on the last launched sequence number and op
    ("3 ranks have launched up to operation 812; rank 5 only up to 811").
    If any stalled rank is somewhere else (computing, loading data, blocked
    in a send/recv), that rank is hung and the others wait for it: a hang,
    named by the hang detector, not a desync.
    Ranks are sampled at different instants, so two healthy ranks about to
    meet in the same collective can read one apart ("358" vs "357"): a
    position is compared only once it has been unchanged for `settle_s` and
    re-read by `settle_rounds` later sampler rounds of its own rank, so an
    off-by-one that the next sample closes is never a mismatch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectorconfig import CollectiveMismatchConfig
from trainwatch.watchdog.detectors.base import Detector, StepTracker, TickView, step_changes, grow, op_name
from trainwatch.watchdog.incident import Incident, describe_ranks

_COLLECTIVE = slots.PHASE_CODES["collective"]
_WAITS = np.array([slots.PHASE_CODES[p] for p in sorted(slots.WAIT_PHASES)])
_DONE = slots.PHASE_CODES["done"]
_MAX_LISTED = 32
_TRACK_MIN_S = 0.3
"""Ranks this long without a step are the earliest whose sequence numbers are watched (s)."""
_SETTLE_MIN_S = 0.5
"""The shortest settle: on a steady job, numbers unchanged this long (and re-read by
settle_rounds sampler rounds) are compared (s)."""
_STEADY_STALL_MIN_S = 0.8
"""The earliest a steady job's parked ranks are compared (s). A disagreement among ranks that
all wait in collectives is positive evidence that no slowness produces, so it needs less
time than a hang (the hang detector's steady threshold): half that threshold, not under this."""
_SOURCES = {
    "colls": ("py_collectives", "Python collectives on world-spanning groups"),
    "seq": ("default_pg_seq", "collectives on the default process group"),
}


@dataclass(slots=True)
class _Disagreement:
    key: tuple
    """(source, direction, culprit ranks)."""
    steps: list
    """Compared steps at which it was seen, newest last."""
    detail: dict


class CollectiveMismatchDetector(Detector):
    """Reports `collective_mismatch` while ranks disagree on their collectives."""

    name = "collective_mismatch"

    def __init__(self, config: CollectiveMismatchConfig | None = None):
        self.config = config or CollectiveMismatchConfig()
        if self.config.persist_steps < 1:
            raise ValueError(f"persist_steps must be >= 1; got {self.config.persist_steps}")
        if self.config.settle_rounds < 0:
            raise ValueError(f"settle_rounds must be >= 0; got {self.config.settle_rounds}")
        self._steps = StepTracker()
        self.steady_s: Callable[[], float] = lambda: math.inf
        """The job's steady hang threshold as the hang detector holds it (wired by
        default_detectors; inf while the job is not steady)."""
        self._last_compared = 0
        self._watching = False
        self._open: _Disagreement | None = None
        self._current: Incident | None = None
        # Last seen (pg, enqueued) per rank and group slot, and since when.
        self._pg = np.full((0, slots.MAX_GROUPS), -1, dtype=np.int64)
        self._enq = np.full((0, slots.MAX_GROUPS), -2, dtype=np.int64)
        self._done = np.full((0, slots.MAX_GROUPS), -2, dtype=np.int64)
        self._since = np.zeros((0, slots.MAX_GROUPS))
        self._rounds = np.zeros((0, slots.MAX_GROUPS), dtype=np.int64)
        self._hb = np.zeros(0)
        self._cpu = np.zeros(0)
        # The step and pid each rank had when last looked at: a new step (or a
        # new process) restarts its clocks. Not its progress time: a remote
        # node's times are rebased on every summary and never read equal twice.
        self._tracked = np.full((0, 2), -1, dtype=np.int64)

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        size = int(t["rank"].max()) + 1
        self._pg = grow(self._pg, size, -1)
        self._enq = grow(self._enq, size, -2)
        self._done = grow(self._done, size, -2)
        self._since = grow(self._since, size, 0.0)
        self._rounds = grow(self._rounds, size, 0)
        self._hb = grow(self._hb, size, 0.0)
        self._cpu = grow(self._cpu, size, np.nan)
        self._tracked = grow(self._tracked, size, -1)
        restarted = step_changes(view, self._steps).restarted
        if restarted.any():
            self._open, self._current, self._last_compared = None, None, 0
        out = []
        if self.config.live_counts:
            found = self._live(view)
            if found is not None:
                out.append(found)
        found = self._ras(view)
        if found is not None:
            out.append(found)
        # A disagreement being confirmed, or parked ranks being watched settle.
        self.busy = self._open is not None or self._current is not None or self._watching
        return out

    # ---- (a) exact end-of-step counts -------------------------------------------

    def _live(self, view: TickView) -> Incident | None:
        t = view.table
        gen = t["restart"] == t["restart"].max()
        ring = t["ring"][gen]
        ranks = np.repeat(t["rank"][gen], slots.RING)
        steps = ring["step"].ravel()
        usable = steps > self._last_compared
        if not usable.any():
            return self._current
        n_ranks = int(gen.sum())
        for s in np.unique(steps[usable]):
            at = steps == s
            if at.sum() < 2:
                continue
            verdict = None
            for source in ("colls", "seq"):
                values = ring[source].ravel()[at]
                known = values >= 0
                if known.sum() >= 2 and len(np.unique(values[known])) > 1:
                    verdict = self._odd_ones(source, int(s), ranks[at][known], values[known])
                    break
            complete = int(at.sum()) == n_ranks
            if verdict is not None or complete:
                # Agreement counts only once every rank posted the step: a
                # lagging culprit has not shown its count yet.
                self._observe(int(s), verdict)
            if complete:
                self._last_compared = max(self._last_compared, int(s))
        if self._open is not None and len(self._open.steps) >= self.config.persist_steps and self._current is None:
            self._current = self._live_incident(view, self._open)
        return self._current

    def _odd_ones(self, source: str, step: int, ranks: np.ndarray, values: np.ndarray):
        counts = Counter(values.tolist())
        ref, n_ref = counts.most_common(1)[0]
        ties = [v for v, n in counts.items() if n == n_ref]
        if len(ties) > 1:
            ref = max(ties)  # a tie: the ranks behind (a skipped call is likelier) are the odd ones
        odd = values != ref
        direction = "fewer" if (values[odd] < ref).all() else "more" if (values[odd] > ref).all() else "different"
        culprits = tuple(sorted(ranks[odd].tolist()))
        detail = {
            "source": _SOURCES[source][0],
            "step": step,
            "reference": int(ref),
            "culprit_counts": {int(r): int(v) for r, v in zip(ranks[odd][:_MAX_LISTED], values[odd][:_MAX_LISTED])},
            "victims": sorted(ranks[~odd].tolist()),
        }
        return (source, direction, culprits), detail

    def _observe(self, step: int, verdict) -> None:
        if verdict is None:
            # Agreement at a newer step ends a disagreement (and its incident).
            if self._open is not None and step > self._open.steps[-1]:
                self._open, self._current = None, None
            return
        key, detail = verdict
        if self._open is None or self._open.key != key:
            if self._current is not None:
                return  # one incident at a time; it ends when counts agree again
            self._open = _Disagreement(key, [step], detail)
        elif step > self._open.steps[-1]:
            self._open.steps.append(step)
            self._open.detail = detail

    def _live_incident(self, view: TickView, d: _Disagreement) -> Incident:
        source, direction, culprits = d.key
        detail = d.detail
        victims = detail["victims"]
        what = _SOURCES[source][1]
        culprit_values = sorted(set(detail["culprit_counts"].values()))
        theirs = "/".join(str(v) for v in culprit_values)
        span = f"steps {d.steps[0]}-{d.steps[-1]}" if len(d.steps) > 1 else f"step {d.steps[0]}"
        if direction == "fewer":
            why = "a skipped collective pairs every later one with the wrong step's partner"
        elif direction == "more":
            why = "an extra collective desynchronises every later one"
        else:
            why = "ranks issue different collectives"
        text = (
            f"collective mismatch: {describe_ranks(culprits)} issued {direction} {what} than "
            f"{describe_ranks(victims)} at the end of {span} ({theirs} vs {detail['reference']} "
            f"at step {detail['step']}): {why}"
        )
        return Incident(
            kind="collective_mismatch",
            culprit_ranks=list(culprits),
            victims=victims,
            summary=text,
            category="collective_mismatch",
            evidence={
                "source": detail["source"],
                "steps": list(d.steps),
                "step": detail["step"],
                "culprit_counts": detail["culprit_counts"],
                "reference_count": detail["reference"],
                "direction": direction,
            },
            key=f"collective_mismatch:{','.join(map(str, culprits))}",
            detected_mono=view.now,
        )

    # ---- (b) RAS-style sequence numbers of parked ranks --------------------------

    def _ras(self, view: TickView) -> Incident | None:
        t = view.table
        cfg = self.config
        now = view.now
        age = now - t["progress_mono"]
        # Only ranks without a step for a while can be stalled; skipping the
        # others keeps a healthy 4096-rank tick cheap.
        # A steady job's ranks are parked for good well before the conservative
        # stall_s, and ranks that all wait in collectives yet disagree are
        # evidence no slowness gives: compared from half its hang threshold,
        # watched early enough to have settled by then.
        steady = self.steady_s()
        stall_s = min(cfg.stall_s, max(_STEADY_STALL_MIN_S, steady / 2)) if steady < cfg.stall_s else cfg.stall_s
        track_s = min(cfg.settle_s, max(_TRACK_MIN_S, stall_s - cfg.settle_s))
        settle_s = min(cfg.settle_s, max(_SETTLE_MIN_S, stall_s - track_s))
        rows = np.nonzero(age >= track_s)[0]
        self._watching = len(rows) > 0
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
        seen = np.stack([sub["step"], sub["pid"]], axis=1).astype(np.int64)
        fresh = (self._tracked[ranks] != seen).any(axis=1)
        done = groups["completed"]
        changed = (fresh[:, None] | (enq != self._enq[ranks, :width]) | (pgs != self._pg[ranks, :width])
                   | (done != self._done[ranks, :width]))
        since = np.where(changed, now, self._since[ranks, :width])
        # Sampler rounds that re-read the same numbers. A new round is a sample
        # the rank took since: its process CPU time moved (the sampler's own
        # work moves it; a rebased time does not), or, where the rank publishes
        # none, a heartbeat at least round_min_s newer.
        hb = sub["heartbeat_mono"]
        cpu = sub["cpu_s"]
        new_round = (hb > 0) & np.where(np.isfinite(cpu), cpu != self._cpu[ranks],
                                        hb - self._hb[ranks] >= cfg.round_min_s)
        rounds = np.where(changed, 0, self._rounds[ranks, :width] + new_round[:, None])
        keep = new_round | changed.any(axis=1)
        self._hb[ranks] = np.where(keep, hb, self._hb[ranks])
        self._cpu[ranks] = np.where(keep, cpu, self._cpu[ranks])
        self._enq[ranks, :width] = enq
        self._done[ranks, :width] = done
        self._pg[ranks, :width] = pgs
        self._since[ranks, :width] = since
        self._rounds[ranks, :width] = rounds
        self._tracked[ranks] = seen

        ng = np.clip(sub["ngroups"], 0, slots.MAX_GROUPS)
        in_group = np.arange(width)[None, :] < ng[:, None]
        limit = np.fmax(stall_s, cfg.stall_factor * np.nan_to_num(sub["step_s"]))
        hb_stale = (hb > 0) & (now - hb > cfg.heartbeat_stale_s)
        # Parked: a launched collective has not completed (the flight recorder
        # counts collectives only, so a rank blocked in a send/recv is not
        # parked), or, without the flight recorder, blocked in a Python
        # collective call.
        outstanding = (in_group & (enq > done)).any(axis=1)
        # A rank inside a blocking collective call is parked too, whatever its
        # flight recorder's last snapshot says: the ranks left waiting in the
        # all-reduce a peer on another node skipped read `enqueued == completed`.
        parked = outstanding & (sub["fr_ok"] > 0) | (sub["phase"] == _COLLECTIVE)
        stalled = (age[rows] >= limit) & (sub["step"] >= 1) & ~hb_stale & (sub["phase"] != _DONE)
        if not stalled.any() or (stalled & ~parked).any():
            # A stalled rank that is not waiting in a collective is hung
            # elsewhere (data, compute, a send/recv): the hang detector's call.
            return None
        stalled &= parked
        valid = in_group & stalled[:, None]
        # Sampled at different instants, moving counters always differ a little;
        # compare only numbers that have settled.
        valid &= (now - since >= settle_s) & (rounds >= cfg.settle_rounds) & (enq >= 0)
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
            raw = groups["last_op"][members, k[sel]]
            if seqs.min() < top:
                behind = members[seqs < top]
                peers_done = int(done[members[seqs == top], k[sel][seqs == top]].max())
                if (seqs[seqs < top] <= peers_done).all() and not np.isin(sub["phase"][behind], _WAITS).any():
                    # What the ranks behind launched last, their peers have
                    # completed (a collective completes on every member): the
                    # ranks behind only have not marked it done yet (an async
                    # op not waited on, as FSDP's prefetch). Outside a phase
                    # that waits on peers (a collective call; backward, where
                    # DDP launches buckets as gradients arrive), they are stuck
                    # before their next launch: a hang.
                    return None
                # A rank that skipped a collective in one group runs ahead into
                # the next step and is then "ahead" in the other groups. The
                # group that tells the truth is the one where the ranks behind
                # in sequence are not behind in steps.
                lag = float(steps[members[seqs < top]].mean() - steps[members[seqs == top]].mean())
                candidates.append((lag, -int(pg), members, seqs, top, [op_name(o) for o in raw]))
                continue
            if op_mismatch is None and len(np.unique(raw[raw != b""])) > 1:
                op_mismatch = (int(pg), members, [op_name(o) for o in raw], top)
        if candidates:
            lag, neg_pg, members, seqs, top, ops = max(candidates, key=lambda c: (c[0], c[1]))
            # The ranks behind in sequence are behind in steps too: they wait in
            # the collective that the ranks ahead skipped, and ran on past.
            return self._seq_incident(view, -neg_pg, rows[members], seqs, top, ops, ahead_skipped=lag < 0)
        if op_mismatch is not None:
            pg, members, ops, top = op_mismatch
            return self._op_incident(view, pg, rows[members], ops, top)
        return None

    def _seq_incident(self, view, pg, rows, seqs, top, ops, ahead_skipped: bool = False) -> Incident:
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
        victims = ranks[at_top].tolist()
        tail = " (all of them waiting in a collective)"
        if ahead_skipped:
            culprits, victims = victims, culprits
            tail = (f" ({describe_ranks(culprits)} ran a step ahead: skipped a collective that "
                    f"{describe_ranks(victims)} wait in)")
        return Incident(
            kind="collective_mismatch",
            culprit_ranks=culprits,
            victims=victims,
            summary=f"collective mismatch in pg {pg}: " + "; ".join(parts) + tail,
            category="collective_mismatch",
            evidence={
                "source": "flight_recorder",
                "pg": pg,
                "top_enqueued": top,
                "ranks_at_top": len(at_top),
                "behind": {r: s for s, rs in behind_by_seq.items() for r in rs[:_MAX_LISTED]},
                "stalled_s": round(float(view.now - view.table["progress_mono"][rows].max()), 3),
                # The op each rank last launched in the group, where the flight recorder names it.
                "last_ops": {int(ranks[row]): o for row, o in list(zip(rows, ops))[:_MAX_LISTED] if o},
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
            category="collective_mismatch",
            evidence={"source": "flight_recorder", "pg": pg, "seq": top, "ops": dict(by_op)},
            detected_mono=view.now,
        )
