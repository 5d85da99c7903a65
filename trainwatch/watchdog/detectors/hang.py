"""Hang detection: a job that stopped making progress, and who it is waiting on.

Progress is a completed step, and also forward-only work (a DataLoader batch, a
finished no_grad/inference_mode block), so an evaluation pass is progress too.
A rank is stale when it made no progress for longer than
max(floor_s, k x p99 of its own recent step times). That fires within seconds
of a real hang, far before NCCL's 600 s timeout or gloo's 30 minutes, while a
job whose steps honestly take a minute is not flagged after five seconds.

Some pauses are honest. A rank in an init, checkpoint or eval phase gets a
longer allowance, and so does a rank that is busy computing (its CPU time keeps
advancing and its heartbeat is alive) while nobody waits on it. Once peers wait
for it in a collective, only a rank that is visibly working (CPU or I/O moving)
in a slow phase keeps its allowance; everyone else is held to the normal
threshold. Ranks waiting in a collective are never a hang by themselves while
some rank is still legitimately working: they are waiting for it.

Thresholds are also learnt per phase (checkpoint and eval by default; data,
forward, optimizer and compute on request). How long each phase lasts is
observed as ranks move between phases; once a phase was seen ending `phase_min_samples` times, a rank in it
that is not visibly working is hung after max(floor_s, phase_factor x the p99
of those lengths), counted from the later of the phase's start and the rank's
last progress, whenever that is tighter than the fixed threshold. A job whose
checkpoints take 1 s has a stuck checkpoint named after the floor, not after
60 s. Learning only tightens, never below the floor; a cold job keeps the
fixed allowances, and a rank that works through a longer phase (CPU or I/O
moving) keeps them too: that longer phase, once it ends, is learnt.

Naming the culprit matters more than noticing the hang: in a synchronous job
every rank stops at once. Ranks parked in a wait phase (backward, collective)
are victims; the culprit is the rank that is somewhere else (data loading,
compute, checkpoint I/O), whose heartbeat stopped (it holds the GIL or is
stopped), or that is behind in step or collective sequence number.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainwatch import slots
from trainwatch.diagnostics.culprit import QUIET_FRACTION, Facts, GroupEntries, blame
from trainwatch.watchdog.detectorconfig import HangConfig
from trainwatch.watchdog.detectors.base import (
    SLOW_CODES,
    WAIT_CODES,
    ActivityTracker,
    Detector,
    PhaseLearner,
    RankRing,
    StepTracker,
    step_changes,
    TickView,
    grow,
    in_phases,
    op_name,
    phase_mask,
    phase_name,
    row_quantile,
)
from trainwatch.watchdog.detectors.steady import SteadyJob
from trainwatch.watchdog.detectors.work import OtherWork
from trainwatch.watchdog.incident import Incident, describe_ranks, format_ranks

_DONE = slots.PHASE_CODES["done"]
_DATA = slots.PHASE_CODES["data"]
_PHASE_CATEGORY = {"data": "dataloader", "checkpoint": "checkpoint_io"}
_CATEGORY_WORDS = {
    "dataloader": "data loading",
    "checkpoint_io": "checkpoint I/O",
    "gc_collect": "holding the GIL",
    "stopped": "process stopped",
    "other": "compute",
}
_QUIET_FRACTION = QUIET_FRACTION
_WAIT, _SLOW = phase_mask(WAIT_CODES), phase_mask(SLOW_CODES)
_MAX_LISTED = 32


class HangDetector(Detector):
    """Reports one `hang` incident per episode of no progress."""

    name = "hang"

    def __init__(self, config: HangConfig | None = None):
        self.config = config or HangConfig()
        self._steps = StepTracker()
        self._step_s = RankRing(self.config.history)
        # Steps that contained an evaluation, a checkpoint or a rollout: their
        # own history, so the training-step threshold stays near the steady step.
        self.other = OtherWork(late_s=self.config.other_work_late_s)
        self._other_s = RankRing(self.config.history)
        self.activity = ActivityTracker()
        self.phases = PhaseLearner(self.config.learn_phases, self.config.phase_history,
                                   min_samples=self.config.phase_min_samples)
        # p99 per rank, recomputed lazily: only for ranks that look stale and
        # whose history changed, so a healthy 4096-rank tick never sorts.
        self._p99 = np.zeros(0)
        self._p99_fresh = np.zeros(0, dtype=bool)
        self.steady = SteadyJob(floor_s=self.config.floor_s, steady_floor_s=self.config.steady_floor_s,
                                k=self.config.k, min_steps=self.config.steady_min_steps)
        self._in_episode = False
        self._provisional: list[int] | None = None
        """Culprits of this episode's hang, called by the steady threshold alone, until it is firm."""

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        cfg = self.config
        if len(t) == 0:
            self._in_episode = self.busy = False
            self._provisional = None
            return []
        ranks = t["rank"]
        changes = step_changes(view, self._steps)
        advanced, restarted = changes.advanced, changes.restarted
        size = int(ranks.max()) + 1
        self._p99 = grow(self._p99, size, np.nan)
        self._p99_fresh = grow(self._p99_fresh, size, False)
        if restarted.any():
            self._step_s.reset(ranks[restarted])
            self._other_s.reset(ranks[restarted])
            self._p99_fresh[ranks[restarted]] = False
            self.steady.reset(ranks[restarted])
        step_s = t["step_s"]
        other = self.other.update(t, advanced, restarted, self._median_of)
        # The first step of a process includes start-up and compilation; kept,
        # it would make the threshold lenient for the next `history` steps.
        usable = advanced & ~changes.first & np.isfinite(step_s) & (step_s > 0)
        push = usable & ~other
        if push.any():
            self.steady.observe(self._step_s.counts(ranks[push]), step_s[push])
            self._step_s.push(ranks[push], step_s[push])
            self._p99_fresh[ranks[push]] = False
        if (usable & other).any():
            self._other_s.push(ranks[usable & other], step_s[usable & other])
        cpu_rate, io_rate = self.activity.update(t)
        self.phases.update(t)

        now = view.now
        age = now - np.fmax(t["progress_mono"], t["active_mono"])
        steady = self.steady.threshold(now, self._step_s, ranks, t["step"])
        # A steady job's short-window activity is kept current every tick: a
        # rate over a long gap would average the work done before the stall.
        hb = t["heartbeat_mono"]
        hb_age = np.where(hb > 0, now - hb, np.nan)
        hb_stale = hb_age > cfg.heartbeat_stale_s
        quiet_io = self.steady.not_writing(t, hb_stale, cfg.active_io_bytes_s) if steady < cfg.floor_s else None
        # Busy while the job's steady threshold is still being learnt (it needs a step
        # time of most steps), and from here on: a rank is past half its threshold, and
        # the rounds that follow must time the rest of its stall closely.
        near = bool((age > min(cfg.floor_s, steady) * _QUIET_FRACTION).any())
        self.busy = near or (self.steady.enabled and not math.isfinite(steady))
        if not near:
            self._in_episode, self._provisional = False, None
            return []

        base = np.full(len(t), float(cfg.floor_s))
        idx = np.nonzero(age > cfg.floor_s * _QUIET_FRACTION)[0]
        base[idx] = np.fmax(cfg.floor_s, cfg.k * self._p99_of(ranks[idx]))

        phase = t["phase"]
        done = phase == _DONE
        in_wait = in_phases(phase, _WAIT)
        in_slow = in_phases(phase, _SLOW)
        started = t["step"] >= 1
        active = ~hb_stale & ((cpu_rate >= cfg.active_cpu) | (io_rate >= cfg.active_io_bytes_s))
        stuck = age > base
        peers_waiting = bool((stuck & in_wait & ~done).any())

        limit = base.copy()
        limit[~started] = np.fmax(base[~started], cfg.warmup_s)
        # A slow phase keeps its allowance while nobody waits, or while the rank
        # visibly works through it (a checkpoint being written, an eval running).
        slow_ok = started & in_slow & (active | (not peers_waiting))
        limit[slow_ok] = np.fmax(base[slow_ok], cfg.slow_phase_s)
        # A step that already contains other work (an evaluation without an
        # eval marker, a rollout) is held to that kind of step's own history:
        # k x its p99 once seen, the slow-phase allowance before (a kind of work
        # the job never showed gets the conservative floor).
        other_ok = started & self.other.current & ~in_wait & ~done & (active | (not peers_waiting))
        if other_ok.any():
            rows = np.nonzero(other_ok)[0]
            values, counts = self._other_s.window(ranks[rows])
            seen = np.fmin(cfg.k * row_quantile(values, counts, 0.99), cfg.slow_phase_s)
            limit[rows] = np.fmax(limit[rows], np.where(counts > 0, seen, cfg.slow_phase_s))
        if not peers_waiting:
            busy = started & ~in_wait & ~in_slow & active
            limit[busy] = np.fmax(base[busy], cfg.busy_s)
        # A learnt phase length holds a rank that is not visibly working to
        # max(floor, factor x p99 length) from its phase start or last progress,
        # whichever is later; only where that is tighter.
        allow = self.phases.limits(cfg.floor_s, cfg.phase_factor)[np.clip(phase, 0, len(slots.PHASES) - 1)]
        learnt = started & ~active & ~in_wait & ~done & np.isfinite(allow)
        if learnt.any():
            offset = np.fmax(t["phase_mono"] - np.fmax(t["progress_mono"], t["active_mono"]), 0.0)
            learnt &= offset + allow < limit
            limit[learnt] = offset[learnt] + allow[learnt]
        # A steady job: a rank outside any wait, fetch, write or slow work, that
        # peers already wait on past the steady threshold, is held to it (one
        # spinning in Python is as hung as one asleep).
        held = np.zeros(len(t), dtype=bool)
        # What a rank held to the steady threshold must pass before its hang is
        # more than an alert: the limit without that hold; the busy grace while
        # it computes (an evaluation on rank 0), the slow-phase allowance while
        # it writes (a checkpoint).
        writing = ~hb_stale & (io_rate >= cfg.active_io_bytes_s)
        firm = np.where(writing, np.fmax(limit, cfg.slow_phase_s),
                        np.where(active, np.fmax(limit, cfg.busy_grace_s), limit))
        if quiet_io is not None and (in_wait & ~done & started & (age > steady)).any():
            held = (started & quiet_io & ~in_wait & ~done & ~in_slow & ~self.other.current & (phase != _DATA)
                    & (steady < limit))
            limit[held] = steady
            learnt &= ~held
            base[held | (in_wait & started)] = np.fmin(base[held | (in_wait & started)], steady)
        elsewhere = ~in_wait & ~done
        stale = elsewhere & (age > limit)
        # Someone outside a collective still within its allowance: the ranks
        # that wait are waiting for it, not hung.
        working = elsewhere & ~stale
        involved = stale.copy()
        if not working.any():
            involved |= in_wait & ~done & (age > limit)
        if not involved.any():
            self._in_episode, self._provisional = False, None
            return []
        if self._in_episode and self._provisional is not None:
            rows = np.nonzero(np.isin(ranks, self._provisional))[0]
            if len(rows) and (age[rows] > firm[rows]).all():
                involved |= np.isin(ranks, self._provisional)
                self._provisional = None  # past what honest work is allowed: the same hang, now firm
                return [self._report(view, age, limit, involved, hb_age, hb_stale, base, in_wait, slow_ok, started,
                                     learnt, held, firm=True)]
        if self._in_episode:
            return []
        self._in_episode = True
        incident = self._report(view, age, limit, involved, hb_age, hb_stale, base, in_wait, slow_ok, started, learnt,
                                held)
        if incident.evidence.get("provisional"):
            self._provisional = list(incident.culprit_ranks)
        return [incident]

    def _report(self, view, age, limit, involved, hb_age, hb_stale, base, in_wait, slow_ok, started, learnt, held,
                firm: bool = False) -> Incident:
        t = view.table
        facts = Facts(step=t["step"], age=age, base=base, in_wait=in_wait, lenient=slow_ok, started=started,
                      hb_stale=hb_stale, involved=involved, groups=GroupEntries.of(t))
        incident = self._incident(_Context(view, age, limit, involved, hb_age, hb_stale, blame(facts), learnt, held))
        culprits = np.isin(t["rank"], incident.culprit_ranks)
        # Called by the steady job's threshold alone: an alert now, a restart
        # only once past what honest work on that rank is allowed.
        incident.evidence["provisional"] = bool(not firm and culprits.any() and held[culprits].all())
        if firm:
            incident.evidence["firm"] = True
        return incident

    def thresholds_in_force(self, ranks: np.ndarray) -> dict:
        """The step-time hang threshold of each of `ranks` as the detector holds
        it now (max(floor, k x p99), the floor while a rank has no history),
        for `diagnose` to judge with the same numbers (telemetry.json)."""
        cfg = self.config
        ranks = np.asarray(ranks, dtype=np.int64)
        ranks = ranks[(ranks >= 0) & (ranks < len(self._p99))]
        base = np.fmax(cfg.floor_s, cfg.k * self._p99_of(ranks)) if len(ranks) else np.zeros(0)
        steady = self.steady.value
        return {"floor_s": cfg.floor_s, "k": cfg.k,
                "steady_s": round(steady, 3) if math.isfinite(steady) else None,
                "ranks": {str(int(r)): round(float(b), 3) for r, b in zip(ranks, base)}}
    def _median_of(self, ranks: np.ndarray) -> np.ndarray:
        """Median training step time per rank (NaN: none yet)."""
        values, counts = self._step_s.window(ranks)
        return row_quantile(values, counts, 0.5)

    def _p99_of(self, ranks: np.ndarray) -> np.ndarray:
        need = ranks[~self._p99_fresh[ranks]]
        if len(need):
            need = np.unique(need)
            values, counts = self._step_s.window(need)
            self._p99[need] = row_quantile(values, counts, 0.99)
            self._p99_fresh[need] = True
        return self._p99[ranks]

    def _incident(self, c: _Context) -> Incident:
        view, t = c.view, c.view.table
        now = view.now
        ranks = t["rank"]
        step = t["step"]
        involved = c.involved
        pattern, behind_seq = c.blame.pattern, c.blame.behind_seq
        c_rows = np.nonzero(c.blame.culprit)[0]
        v_rows = np.nonzero(c.blame.victims)[0]
        culprits = ranks[c_rows].tolist()
        at_step = int(step[involved].max())
        stopped_rows = []
        if pattern == "gil_or_stopped":
            if view.proc_state is not None:
                stopped_rows = [r for r in c_rows if view.proc_state(int(t["pid"][r])) == "stopped"]
            if stopped_rows:
                pattern = "stopped"

        if pattern in ("rank_elsewhere", "gil_or_stopped", "stopped"):
            cats: Counter = Counter()
            for r in c_rows:
                gil = c.hb_stale[r]
                cat = "stopped" if r in stopped_rows else _PHASE_CATEGORY.get(phase_name(t["phase"][r]))
                cats[cat or ("gc_collect" if gil else "other")] += 1
            category = cats.most_common(1)[0][0]
        else:
            category = "collective_wait"

        codes, n_codes = np.unique(t["phase"][v_rows], return_counts=True)
        victim_phases = {phase_name(code): int(n) for code, n in zip(codes, n_codes)}
        wait_words = "/".join(sorted(victim_phases)) or "a collective"
        span = float(c.age[involved].max())
        if pattern in ("rank_elsewhere", "gil_or_stopped", "stopped"):
            lead = c_rows[int(np.argmax(c.age[c_rows]))]
            ph = phase_name(t["phase"][lead])
            idle = float(c.age[lead])
            who = describe_ranks(culprits)
            one = len(culprits) == 1
            if view.nodes and len(set(view.nodes)) > 1:
                who += f" ({', '.join(sorted({view.nodes[r] for r in c_rows}))})"
            if pattern == "stopped":
                text = (
                    f"hang: {who} {'is' if one else 'are'} stopped (process state T: SIGSTOP, job control "
                    f"or a debugger; no heartbeat for {c.hb_age[lead]:.1f} s) in phase '{ph}', "
                    f"no progress for {idle:.1f} s at step {int(step[lead])}"
                )
            elif pattern == "gil_or_stopped":
                unknown = " or is stopped" if one else " or are stopped"
                text = (
                    f"hang: {who} {'holds' if one else 'hold'} the GIL{unknown if view.proc_state is None else ''} "
                    f"(no heartbeat for {c.hb_age[lead]:.1f} s) in phase '{ph}', "
                    f"no progress for {idle:.1f} s at step {int(step[lead])}"
                )
            else:
                text = (
                    f"hang: {who} stuck in phase '{ph}' ({_CATEGORY_WORDS.get(category, 'compute')}, "
                    f"outside any collective), no progress for {idle:.1f} s at step {int(step[lead])}"
                )
            if len(v_rows):
                text += f"; {describe_ranks(ranks[v_rows])} wait in {wait_words} (victims)"
        else:
            n_all = int(involved.sum())
            where = f"phase {', '.join(repr(p) for p in sorted(victim_phases))}" if victim_phases else "a wait phase"
            if pattern == "behind_in_step":
                text = (
                    f"hang: all {n_all} stalled ranks stuck in collectives ({where}) for {span:.1f} s; "
                    f"{describe_ranks(culprits)} behind at step {int(step[c_rows].min())} (others at {at_step})"
                )
            elif pattern == "behind_in_seq":
                pg, top, behind = behind_seq
                low = min(behind.values())
                text = (
                    f"hang: all {n_all} stalled ranks stuck in collectives ({where}) for {span:.1f} s "
                    f"at step {at_step}; {describe_ranks(culprits)} behind in pg {pg} "
                    f"(launched up to {low}, others {top})"
                )
            else:
                text = (
                    f"hang: all {n_all} stalled ranks stuck in the same collective ({where}{_same_op(t, involved)}) "
                    f"for {span:.1f} s at step {at_step}; no rank is behind (check stacks and the network)"
                )

        evidence: dict = {
            "pattern": pattern,
            "step": at_step,
            "threshold_s": round(float(c.limit[involved].min()), 3),
            "stalled_ranks": int(involved.sum()),
            "victim_count": len(v_rows),
            "victim_phases": dict(victim_phases),
            "culprits": {
                int(ranks[r]): {
                    "node": view.nodes[r] if view.nodes else "",
                    "phase": phase_name(t["phase"][r]),
                    "step": int(step[r]),
                    "no_progress_s": round(float(c.age[r]), 3),
                    "in_phase_s": round(float(now - t["phase_mono"][r]), 3),
                    "heartbeat_age_s": None if np.isnan(c.hb_age[r]) else round(float(c.hb_age[r]), 3),
                    "threshold_s": round(float(c.limit[r]), 3),
                    "threshold_learnt": bool(c.learnt[r]),
                    "threshold_steady": bool(c.held[r]),
                    "stopped": bool(r in stopped_rows),
                }
                for r in c_rows[:_MAX_LISTED]
            },
        }
        if len(v_rows) <= _MAX_LISTED:
            evidence["victim_ranks"] = format_ranks(ranks[v_rows])
        if behind_seq is not None:
            pg, top, behind = behind_seq
            evidence["collectives"] = {
                "pg": pg,
                "top_enqueued": top,
                "behind": {int(ranks[r]): v for r, v in list(behind.items())[:_MAX_LISTED]},
            }
        return Incident(
            kind="hang",
            culprit_ranks=culprits,
            victims=ranks[v_rows].tolist(),
            summary=text,
            runbook="stopped" if category == "stopped" else None,
            category=category,
            evidence=evidence,
            detected_mono=now,
        )


@dataclass(slots=True)
class _Context:
    """One tick's per-row facts the incident text is built from."""

    view: TickView
    age: np.ndarray
    limit: np.ndarray
    involved: np.ndarray
    hb_age: np.ndarray
    hb_stale: np.ndarray
    blame: Any
    learnt: np.ndarray
    """Rows held to a learnt phase threshold."""
    held: np.ndarray
    """Rows held to the steady job's threshold."""


def _same_op(t: np.ndarray, rows: np.ndarray) -> str:
    """', pg 0 operation 812 (allreduce)' when the stalled ranks' first group agrees."""
    sub = t[rows]
    if len(sub) == 0 or (sub["ngroups"] < 1).any():
        return ""
    g = sub["groups"][:, 0]
    if len(np.unique(g["pg"])) != 1 or len(np.unique(g["enqueued"])) != 1 or g["enqueued"][0] < 0:
        return ""
    op = op_name(g["last_op"][0])
    return f", pg {int(g['pg'][0])} operation {int(g['enqueued'][0])}" + (f" ({op})" if op else "")
