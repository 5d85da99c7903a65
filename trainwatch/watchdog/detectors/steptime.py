"""Step time spikes: a step far slower than the rank's usual, and where the time went.

A training log's time per iteration should be steady; a step that suddenly
takes several times longer is a data-loading stall, a communication stall, or
one rank holding everyone up. Each rank publishes its step time and the part
of it spent in the data, backward and optimizer phases (slot fields `step_s`,
`data_s`, `backward_s`, `optimizer_s`; the rest of the step is "other":
forward and anything outside the marked phases), and the slowest step since
the sidecar's previous read with its breakdown (`peak_step_s`, ...), so one
slow step between two reads is not missed.

A spike is a step at least `factor` x the rank's median step time and
`min_excess_s` longer. Its time is attributed to the phase that exceeds its
own usual time the most. In data parallel training a slow rank makes every
peer wait in its gradient all-reduce, which runs inside backward: a rank
whose extra time is in data, optimizer or other is a culprit; a rank whose
extra time is in backward (or in a collective phase the sidecar saw it in)
only waited, and is named as a victim. Steps during which the sidecar saw the
rank in a checkpoint, eval or init phase, or doing forward-only work late in
the step (an RL rollout: `work.OtherWork`), are honest pauses and never count
nor enter the baseline, nor do the waits of its peers at the same time. When every slow rank only
waited and no rank here explains it, the spike is a communication stall, a
slow rank on another node, or a rank slowed inside backward itself (reported
at low severity, from `stall_min_excess_s` of extra time; `stall_alerts` off
turns that off).

When every rank of a node is slow at once (a busy host, another job, thermal
throttling) no rank is behind its peers: that is one node-level observation
(`node_slowdowns`, logged), not a rank alert. Culprits are held `node_grace_s`
so every rank of the node has been judged before the call.

A spike episode lasts while spikes keep coming (`hold_s` after the last one):
a periodic slow step is one incident, not one per occurrence. Ranks that do
not publish a phase breakdown are not judged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectorconfig import StepTimeConfig
from trainwatch.watchdog.detectors.base import Detector, StepTracker, TickView, step_changes, grow, row_median
from trainwatch.watchdog.detectors.work import OtherWork
from trainwatch.watchdog.incident import Incident, describe_ranks

log = logging.getLogger("trainwatch.steptime")

_MAX_LISTED = 32
_REFRESH = 8
"""A rank's cached median step time is recomputed after this many new samples."""
PHASES = ("data", "backward", "optimizer", "other")
_BACKWARD, _OTHER = 1, 3
# Per phase code: 0 when the sidecar sees a rank waiting for peers there, 1 in an honest pause, 2 otherwise.
_SEEN = np.full(len(slots.PHASES), 2, dtype=np.int64)
_SEEN[slots.PHASE_CODES["collective"]] = 0
_SEEN[[slots.PHASE_CODES[p] for p in ("init", "checkpoint", "eval")]] = 1
_TEXT = {
    "data": "data loading",
    "optimizer": "the optimizer step",
    "other": "forward or work outside the marked phases",
    "backward": "backward (the gradient all-reduce: waiting for peers)",
    "collective": "a collective (waiting for peers)",
}


@dataclass(slots=True)
class _Episode:
    key: str
    since: float
    last: float
    culprits: dict = field(default_factory=dict)
    victims: dict = field(default_factory=dict)


class StepTimeDetector(Detector):
    """Reports `step_time_spike`."""

    name = "step_time"

    def __init__(self, config: StepTimeConfig | None = None):
        self.config = config or StepTimeConfig()
        self._steps = StepTracker()
        # Per rank, the last `history` samples of (step, data, backward, optimizer, other) seconds.
        self._ring = np.zeros((0, self.config.history, 1 + len(PHASES)))
        self._pos = np.zeros(0, dtype=np.int64)
        self._count = np.zeros(0, dtype=np.int64)
        self._med = np.zeros(0)
        self._pushes = np.zeros(0, dtype=np.int64)
        self._seen = np.zeros((0, 2))  # longest stretch seen since the last step: waiting, honest pause
        self._episode: _Episode | None = None
        self._stall: _Episode | None = None
        self._pending: dict[int, tuple[float, dict]] = {}
        self._excused_at = -np.inf
        self._other = OtherWork()
        self.node_slowdowns: list[dict] = []
        """Node-level observations: {"nodes", "ranks", "since_mono", "excess_s"}, newest last (a few kept)."""
        self._node_noted: str | None = None

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        ranks = t["rank"]
        size = int(ranks.max()) + 1
        self._ring = grow(self._ring, size, np.nan)
        self._pos = grow(self._pos, size, 0)
        self._count = grow(self._count, size, 0)
        self._med = grow(self._med, size, np.nan)
        self._pushes = grow(self._pushes, size, 0)
        self._seen = grow(self._seen, size, 0.0)
        changes = step_changes(view, self._steps)
        advanced, restarted = changes.advanced, changes.restarted
        if restarted.any():
            gone = ranks[restarted]
            self._ring[gone] = np.nan
            self._pos[gone] = self._count[gone] = 0
            self._med[gone] = np.nan
            self._seen[gone] = 0.0
        other = self._other.update(t, advanced, restarted, lambda r: self._med[r])
        if other.any():
            # An evaluation, a checkpoint or a rollout: its length is that work's,
            # and peers that waited for it waited for honest work.
            self._excused_at = view.now
        if advanced.any():
            rows = np.nonzero(advanced & ~other)[0]
            self._judge(view, rows)
            rows = np.nonzero(advanced)[0]
            self._seen[ranks[rows]] = 0.0
        self._watch_phases(view)
        self._settle(view.now)
        learning = ((self._count[ranks] < self.config.min_samples) & np.isfinite(t["step_s"])).any()
        self.busy = bool(self._pending) or self._episode is not None or self._stall is not None or bool(learning)
        return [inc for inc in (self._culprit_incident(view), self._stall_incident(view)) if inc is not None]

    def _watch_phases(self, view: TickView) -> None:
        """The longest stretch of a waiting phase and of an honest pause seen since each rank's last step."""
        t = view.table
        since = t["phase_mono"]
        dur = np.where(since > 0, view.now - since, 0.0)
        dur = np.where(np.isfinite(dur), np.maximum(dur, 0.0), 0.0)
        col = _SEEN[np.clip(t["phase"], 0, len(_SEEN) - 1)]
        inside = col < 2
        if inside.any():
            r, c = t["rank"][inside], col[inside]
            self._seen[r, c] = np.maximum(self._seen[r, c], dur[inside])

    def _judge(self, view: TickView, rows: np.ndarray) -> None:
        cfg = self.config
        t = view.table
        r = t["rank"][rows]
        cur = t["step_s"][rows]
        pk, pk_at = t["peak_step_s"][rows], t["peak_step_s_step"][rows]
        use_peak = (pk_at > 0) & np.isfinite(pk) & ~(pk <= cur)
        total = np.where(use_peak, pk, cur)
        counts = self._count[r]
        stale = (counts > 0) & ((self._pushes[r] >= _REFRESH) | np.isnan(self._med[r]))
        if stale.any():
            rs = r[stale]
            self._med[rs] = self._median(rs, 0)
            self._pushes[rs] = 0
        med = self._med[r]
        with np.errstate(invalid="ignore"):
            spiking = np.isfinite(total) & (total >= cfg.factor * med) & (total - med >= cfg.min_excess_s)
            cur_spike = (cur >= cfg.factor * med) & (cur - med >= cfg.min_excess_s)
        cand = np.nonzero(spiking & (counts >= cfg.min_samples))[0]
        if len(cand):
            rc = rows[cand]
            ph = np.column_stack([np.where(use_peak[cand], t[f"peak_{p}_s"][rc], t[f"{p}_s"][rc]) for p in PHASES[:3]])
            vals = _with_other(total[cand], ph)
            told = np.isfinite(vals[:, :3]).any(axis=1)
            at = np.where(use_peak, pk_at, t["step"][rows])
            if told.any():
                k = cand[told]
                self._attribute(view, r[k], at[k], total[k], med[k], vals[told])

        # Record after judging: a slow step must not raise its own baseline.
        keep = np.isfinite(cur) & (cur >= 0) & ~cur_spike
        rk = r[keep]
        pos = self._pos[rk]
        kept = rows[keep]
        phases = _with_other(cur[keep], np.column_stack([t[f"{p}_s"][kept] for p in PHASES[:3]]))
        self._ring[rk, pos] = np.column_stack([cur[keep], phases])
        self._pos[rk] = (pos + 1) % self.config.history
        self._count[rk] += 1
        self._pushes[rk] += 1

    def _median(self, r: np.ndarray, col: int) -> np.ndarray:
        """Median of column `col` of each rank's recent samples (NaN: none)."""
        values = self._ring[r, :, col]
        return row_median(values, np.isfinite(values).sum(axis=1))

    def _attribute(self, view: TickView, r: np.ndarray, at: np.ndarray, total: np.ndarray, med: np.ndarray,
                   vals: np.ndarray) -> None:
        usual = np.column_stack([np.nan_to_num(self._median(r, 1 + i), nan=0.0) for i in range(len(PHASES))])
        excess = np.where(np.isfinite(vals), vals - usual, -np.inf)
        where = np.argmax(excess, axis=1)
        extra = total - med
        seen = self._seen[r]
        excused = seen[:, 1] >= 0.5 * extra
        waited = (where == _BACKWARD) | ((where == _OTHER) & (seen[:, 0] >= 0.5 * extra))
        now = view.now
        if excused.any():
            self._excused_at = now
        for k in np.nonzero(~excused)[0]:
            label = PHASES[where[k]] if not (waited[k] and where[k] == _OTHER) else "collective"
            info = {"step": int(at[k]), "step_s": round(float(total[k]), 4), "median_s": round(float(med[k]), 4),
                    "excess_s": round(float(extra[k]), 4), "phase": label,
                    "phases": {p: round(float(v), 4) for p, v in zip(PHASES, vals[k]) if np.isfinite(v)},
                    "usual": {p: round(float(v), 4) for p, v in zip(PHASES, usual[k])}}
            rank = int(r[k])
            if not waited[k]:
                ep = self._episode
                if ep is None:
                    culprits = sorted({rank} | {int(x) for x in r[~excused & ~waited]})
                    ep = self._episode = _Episode(f"step_time_spike:{','.join(map(str, culprits))}", now, now)
                ep.culprits[rank] = info
                ep.last = now
            else:
                self._pending[rank] = (now, info)

    def _settle(self, now: float) -> None:
        """Place the waiting ranks held back, end quiet episodes."""
        cfg = self.config
        for rank, (when, info) in list(self._pending.items()):
            if abs(when - self._excused_at) <= cfg.stall_grace_s:
                del self._pending[rank]  # they waited for a checkpoint or an eval: honest
            elif self._episode is not None and self._episode.last >= when - cfg.stall_grace_s:
                self._episode.victims[rank] = info
                del self._pending[rank]
            elif now - when >= cfg.stall_grace_s:
                del self._pending[rank]
                if cfg.stall_alerts and info["excess_s"] >= cfg.stall_min_excess_s:
                    if self._stall is None:
                        self._stall = _Episode("step_time_spike:stall", now, when)
                    self._stall.victims[rank] = info
                    self._stall.last = max(self._stall.last, when)
        for name in ("_episode", "_stall"):
            ep = getattr(self, name)
            if ep is not None and now - ep.last >= cfg.hold_s:
                setattr(self, name, None)

    def _whole_nodes(self, view: TickView, ep: _Episode) -> list[str] | None | bool:
        """The nodes whose every live rank is a culprit of `ep` (>= 2 culprits); None when some
        rank of theirs was judged and is not; False while one has not reached the culprits' step."""
        culprits = ep.culprits
        if len(culprits) < 2:
            return None
        t = view.table
        labels = view.nodes if view.nodes and len(view.nodes) == len(t) else [""] * len(t)
        ranks = t["rank"].tolist()
        on = {labels[i] for i, r in enumerate(ranks) if r in culprits}
        first = min(v["step"] for v in culprits.values())
        others = [i for i, r in enumerate(ranks) if labels[i] in on and r not in culprits]
        if any(int(t["step"][i]) < first for i in others):
            return False  # not judged at that step yet
        return None if others else sorted(on)

    def _culprit_incident(self, view: TickView) -> Incident | None:
        ep = self._episode
        if ep is None:
            return None
        nodes = self._whole_nodes(view, ep)
        if nodes is False and view.now - ep.since < self.config.node_grace_s:
            return None  # the node's other ranks may finish the same slow step a tick later
        if nodes:
            if self._node_noted != ep.key:
                self._node_noted = ep.key
                excess = max(v["excess_s"] for v in ep.culprits.values())
                self.node_slowdowns = (self.node_slowdowns + [{
                    "nodes": nodes, "ranks": sorted(ep.culprits), "since_mono": ep.since,
                    "excess_s": round(float(excess), 4)}])[-8:]
                log.info("node slowdown: every rank of %s (ranks %s) slowed at once by up to %.2f s a step: "
                         "the host, not a rank", ", ".join(n or "this node" for n in nodes),
                         ",".join(map(str, sorted(ep.culprits))), excess)
            return None
        lead = min(ep.culprits, key=lambda k: (ep.culprits[k]["step"], -ep.culprits[k]["excess_s"]))
        first = ep.culprits[lead]
        label = first["phase"]
        text = (f"step time spike: {describe_ranks(ep.culprits)} slow; rank {lead} step {first['step']} took "
                f"{first['step_s']:.2f} s, {first['step_s'] / max(first['median_s'], 1e-9):.1f}x its median "
                f"{first['median_s']:.2f} s; the extra {first['excess_s']:.2f} s went to {_TEXT[label]} "
                f"({label} {first['phases'].get(label, float('nan')):.2f} s, usually {first['usual'][label]:.2f} s)")
        victims = [r for r in ep.victims if r not in ep.culprits]  # a culprit is never its own victim
        if victims:
            text += f"; {describe_ranks(victims)} waited for it"
        return Incident(
            kind="step_time_spike", culprit_ranks=list(ep.culprits), victims=victims, summary=text,
            category=None,
            evidence=_evidence(ep, label), key=ep.key, detected_mono=ep.since,
        )

    def _stall_incident(self, view: TickView) -> Incident | None:
        ep = self._stall
        if ep is None:
            return None
        first = max(ep.victims.values(), key=lambda v: v["excess_s"])
        text = (f"step time spike: {describe_ranks(ep.victims)} took up to {first['step_s']:.2f} s at step "
                f"{first['step']} ({first['excess_s']:.2f} s over the median), all of it waiting for peers in "
                f"{first['phase']}; no rank here spent it elsewhere: a communication stall, a slow rank on "
                "another node, or a rank slowed inside that phase itself")
        return Incident(
            kind="step_time_spike", culprit_ranks=[], victims=list(ep.victims), summary=text, severity="low",
            category=None, evidence=_evidence(ep, first["phase"]), key=ep.key,
            detected_mono=ep.since,
        )


def _with_other(total: np.ndarray, phases: np.ndarray) -> np.ndarray:
    """Columns data, backward, optimizer, other (the step's time outside the three; NaN where unknown)."""
    with np.errstate(invalid="ignore"):
        known = np.where(np.isfinite(phases) & (phases >= 0), phases, np.nan)
        other = np.maximum(total - np.where(np.isnan(known), 0.0, known).sum(axis=1), 0.0)
    other = np.where(np.isfinite(total) & np.isfinite(known).any(axis=1), other, np.nan)
    return np.column_stack([known, other])


def _evidence(ep: _Episode, phase: str) -> dict:
    return {
        "phase": phase,
        "culprits": {int(k): v for k, v in list(ep.culprits.items())[:_MAX_LISTED]},
        "victims": {int(k): v for k, v in list(ep.victims.items())[:_MAX_LISTED]},
    }
