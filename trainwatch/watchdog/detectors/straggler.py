"""Stragglers: ranks that are persistently slower than their peers, so that
every other rank waits for them.

Two kinds of evidence, one detector and one incident kind:

- collective arrival order (arrival.py): the rank that enters every
  collective last, from the flight recorder's per-collective times that each
  rank's sampler publishes. It needs nothing from the script (an unmodified
  one, FSDP whose waits hide in forward, a slow GPU) and is preferred
  whenever ranks publish arrivals (evidence `"source": "collective_arrival"`);
- compute time, below (evidence `"source": "compute"`): used where ranks
  publish no arrivals (the flight recorder off, TORCH_FR_BUFFER_SIZE=0, or
  unavailable), and for ranks the arrivals could not judge. It always runs:
  its per-rank slowdown ratio is the `trainwatch_straggler_slowdown_ratio`
  gauge. Zero-code compute time is step time less the time in `backward`
  (DDP's all-reduces overlap it), where a victim waits for the straggler.

Both compare a rank with its peers at the same step or collective, scale the
margin with the observed jitter and want the same persistence (`z`,
`persist`, `persist_s`); a culprit is reported by one of them at a time.

In synchronous training one slow rank makes every step slow, and every other
rank's step time grows by the same amount (they wait in collectives). So step
time cannot name the straggler; compute time (step time minus time in wait
phases) can.

Ranks are compared step by step: each rank's compute time at step s against
the median of its peers' at the same step s (leave-one-out, so with two ranks
each is compared with the other). A node-wide slowdown (another job on the
machine, a busy host) moves every rank's compute at that step together and
cancels out; what is left is each rank's own excess. A rank is a straggler
when, over the last `window` steps,

- its compute is `ratio` x its peers' at the same step (the median over the
  window of the per-step ratio: the gauge's value),
- its median excess over its peers is at least `min_excess_s`, and
- at least `z` robust standard deviations of the step-to-step jitter (the
  median over ranks of each rank's MAD of its excess over the window),

for `persist` evaluations in a row spanning at least `persist_s` seconds.

Why the jitter, measured with benchmarks/stragglers.py (4 healthy ranks on 2
cores beside a 2-rank job and/or a CPU hog, slot tables recorded every tick):
the scheduler slows the ranks by turns. One rank's compute at one step was
off its peers' by a robust sigma of 30-50% of the compute time (~35 ms of
0.12 s with the small model, ~20 ms of 50 ms with the tiny one), and the
placement lasts: a rank's ten-step median sat at 1.5-3x its peers' (+50-140
ms) for 5-25 steps, which the old median-vs-median test (with a z-score over
the ranks' medians, whose spread says nothing about the jitter) reported as a
straggler in 8 of 53 recorded healthy runs (2 of 29 jobs of 4 ranks, 6 of 24
of 2). Against the jitter such episodes reached 3.2 sigmas for an evaluation,
and never held even 1 sigma together with the ratio, the 50 ms and the
persistence. An injected straggler (+0.3 s
a step) stands at 7-10 sigmas under the same load, and at hundreds on a
quiet node (the 2% jitter floor), where it is still reported after the same
min_steps + persist - 1 = 9 steps as before (steps >= 0.5 s; on faster ones
`persist_s` adds a little).

CPU time is not used to excuse a slow rank: a rank starved by the scheduler
(runnable, not running) and a rank that is slow for real while using no CPU
(waiting for its GPU with a blocking sync, reading input from a slow disk, an
injected sleep) both show wall compute >> CPU time, so "descheduled-looking"
steps cannot be told from real stragglers by it, and on GPU jobs compute time
is not CPU time at all. The step-by-step comparison with peers and the jitter
margin do not depend on what the rank spends its time on.
"""

from __future__ import annotations

import numpy as np

from trainwatch.watchdog.detectorconfig import StragglerConfig
from trainwatch.watchdog.detectors.arrival import ArrivalEvaluator
from trainwatch.watchdog.detectors.base import (Detector, StepTracker, TickView, grow, median, row_median,
                                                 step_changes)
from trainwatch.watchdog.detectors.peers import JITTER_SAMPLE as _JITTER_SAMPLE
from trainwatch.watchdog.detectors.peers import MAD_TO_SIGMA as _MAD_TO_SIGMA
from trainwatch.watchdog.detectors.peers import StepTable, peer_median
from trainwatch.watchdog.incident import Incident, describe_ranks

__all__ = ["StepTable", "StragglerConfig", "StragglerDetector", "peer_median"]

# The jitter's MAD is floored at this fraction of the peers' median compute:
# identical compute times (MAD 0) would otherwise make any tiny difference
# infinitely significant; 2% is about the jitter of a step timer on a quiet node.
_MAD_FLOOR = 0.02


class StragglerDetector(Detector):
    """Reports `straggler` while some ranks are persistently slow."""

    name = "straggler"

    def __init__(self, config: StragglerConfig | None = None):
        self.config = config or StragglerConfig()
        self._steps = StepTracker()
        self._compute = StepTable(self.config.window)
        self._streak = np.zeros(0, dtype=np.int64)
        self._since = np.zeros(0)
        self._last_eval_step = -1
        self._ratio_ranks = np.zeros(0, dtype=np.int64)
        self._ratio_values = np.zeros(0)
        self._current: Incident | None = None
        self._arrival = ArrivalEvaluator(self.config) if self.config.arrivals else None
        self._compute_shown = False  # the compute incident was reported last tick

    def current_ratios(self) -> dict[int, float]:
        """Latest slowdown ratio per compared rank (its compute / its peers' median
        at the same step, median over the window), for the `trainwatch_straggler_slowdown_ratio` gauge."""
        return dict(zip(self._ratio_ranks.tolist(), np.round(self._ratio_values, 4).tolist()))

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        ranks = t["rank"]
        size = int(ranks.max()) + 1
        self._streak = grow(self._streak, size, 0)
        self._since = grow(self._since, size, 0.0)
        changes = step_changes(view, self._steps)
        advanced, restarted = changes.advanced, changes.restarted
        if restarted.any():
            self._compute.reset(ranks[restarted])
            self._streak[ranks[restarted]] = 0
        arrival = None
        if self._arrival is not None:
            arrival = self._arrival.check(view, ranks[restarted], self.current_ratios)
        compute = t["compute_s"]
        # NaN compute time means the rank does not know it (no wait phases
        # marked); such ranks are left out rather than guessed.
        push = advanced & np.isfinite(compute) & (compute >= 0)
        if push.any():
            self._compute.put(ranks[push], t["step"][push].astype(np.int64), compute[push])
        top = int(t["step"].max())
        # One evaluation per new group step: re-evaluating the same data every
        # tick would turn `persist` into a wall-clock delay.
        if top != self._last_eval_step and advanced.any():
            self._last_eval_step = top
            self._current = self._evaluate(view, top)
        out = self._prefer(arrival, self._current)
        self._compute_shown = any(inc is self._current for inc in out)
        # A slow rank building its streak: its persistence is timed on these rounds.
        self.busy = bool(self._streak.any()) or (self._arrival is not None and self._arrival.streaking())
        return out

    def sample(self, view: TickView) -> None:
        """Each rank's compute time of its current step (the window needs most steps of
        a fast job, and a quiet round comes only every few ticks; keyed by step, so the
        round that reads the same step again writes the same value), and the arrivals
        published since the last read (their ring wraps)."""
        t = view.table
        compute = t["compute_s"]
        ok = (t["step"] >= 1) & np.isfinite(compute) & (compute >= 0)
        if ok.any():
            self._compute.put(t["rank"][ok], t["step"][ok].astype(np.int64), compute[ok])
        if self._arrival is not None:
            self._arrival.sample(view)

    def _prefer(self, arrival: Incident | None, compute: Incident | None) -> list[Incident]:
        """Arrival order overrules compute time for the ranks it judged: a compute
        culprit they see arriving on time is no straggler, one they report is
        theirs, and a new one they see late is left for them to confirm. A
        compute incident already being reported stays while the arrivals still
        see its culprit late: a gap would make their confirmation a second
        incident for the same rank. A rank they see late from its start (no own
        baseline on time) is compute time's to report: a GPU slow from the first
        step is the commonest straggler."""
        if self._arrival is None or not self._arrival.active or compute is None:
            return [x for x in (arrival, compute) if x is not None]
        culprits = np.asarray(compute.culprit_ranks, dtype=np.int64)
        judged = np.isin(culprits, self._arrival.covered)
        theirs = arrival is not None and bool(np.isin(culprits, arrival.culprit_ranks).any())
        confirming = (judged & self._arrival.confirming(culprits)).any()
        if theirs or (judged & ~self._arrival.slow(culprits)).any() or (confirming and not self._compute_shown):
            return [arrival] if arrival is not None else []
        return [x for x in (arrival, compute) if x is not None]

    def _clear(self, ranks: np.ndarray) -> None:
        self._ratio_ranks, self._ratio_values = np.zeros(0, dtype=np.int64), np.zeros(0)
        self._streak[ranks] = 0

    def _evaluate(self, view: TickView, top: int) -> Incident | None:
        t = view.table
        cfg = self.config
        ranks = t["rank"]
        steps = np.arange(max(1, top - cfg.window + 1), top + 1, dtype=np.int64)
        compute = self._compute.matrix(ranks, steps)
        peers = peer_median(compute)
        excess = compute - peers  # NaN where the rank or all its peers lack the step
        counts = np.isfinite(excess).sum(axis=1)
        ok = counts >= cfg.min_steps
        if ok.sum() < 2:
            self._clear(ranks)
            return None
        rows = np.nonzero(ok)[0]
        exc = row_median(excess[ok], counts[ok])  # sorting puts NaN last: each row's first `counts`
        # The slowdown at each step against the peers at that step; NaN where
        # the peers computed nothing (all their time in wait phases).
        per_step = np.divide(compute[ok], peers[ok], out=np.full((len(rows), len(steps)), np.nan),
                             where=peers[ok] > 0)
        ratio = row_median(per_step, np.isfinite(per_step).sum(axis=1))
        # The jitter: each rank's spread of its excess over the window (MAD),
        # the median over ranks (a sample of them in big jobs).
        every = max(1, len(rows) // _JITTER_SAMPLE)
        sample = rows[::every]
        spread = row_median(np.abs(excess[sample] - exc[::every, None]), counts[sample])
        level = peers[sample][np.isfinite(peers[sample])]
        if not np.isfinite(ratio).any() or median(level) <= 0:
            self._clear(ranks)
            return None
        mad = max(median(spread), _MAD_FLOOR * median(level))
        z = _MAD_TO_SIGMA * exc / mad
        slow = (ratio >= cfg.ratio) & (z >= cfg.z) & (exc >= cfg.min_excess_s)
        r = ranks[rows]
        old = self._streak[r]
        self._streak[ranks] = 0  # a rank not compared this time loses its streak
        streak = np.where(slow, old + 1, 0)
        self._streak[r] = streak
        self._since[r] = np.where(slow & (old == 0), view.now, self._since[r])
        shown = np.isfinite(ratio)
        self._ratio_ranks, self._ratio_values = r[shown].astype(np.int64), ratio[shown]
        is_culprit = (streak >= cfg.persist) & (view.now - self._since[r] >= cfg.persist_s)
        if not is_culprit.any():
            return None
        culprit_rows = rows[is_culprit]
        c_ratio, c_exc = ratio[is_culprit], exc[is_culprit]
        # Their own median compute and their peers' over the same steps, for the summary.
        paired = np.isfinite(excess[culprit_rows])
        c_med = row_median(np.where(paired, compute[culprit_rows], np.nan), counts[culprit_rows])
        c_ref = row_median(peers[culprit_rows], counts[culprit_rows])
        wait = t["step_s"] - t["compute_s"]
        waiting = np.isfinite(wait) & (wait >= 0.5 * median(c_exc))
        waiting[culprit_rows] = False
        culprits = ranks[culprit_rows].tolist()
        victims = ranks[np.nonzero(waiting)[0]].tolist()
        lead = int(np.argmax(c_ratio))
        text = (
            f"straggler: {describe_ranks(culprits)} computes {c_ratio[lead]:.1f}x the group median "
            f"({c_med[lead]:.3f} s vs {c_ref[lead]:.3f} s per step over the last {cfg.window} steps)"
        )
        if victims:
            text += f"; {describe_ranks(victims)} wait for it in collectives (victims)"
        return Incident(
            kind="straggler",
            culprit_ranks=culprits,
            victims=victims,
            summary=text,
            category=None,
            evidence={
                "source": "compute",
                "slowdown_ratio": round(float(c_ratio.max()), 4),
                "ratios": {c: round(float(x), 4) for c, x in zip(culprits, c_ratio)},
                "compute_s": {c: round(float(x), 6) for c, x in zip(culprits, c_med)},
                "excess_s": {c: round(float(x), 6) for c, x in zip(culprits, c_exc)},
                "group_median_compute_s": round(float(np.median(c_ref)), 6),
                "jitter_mad_s": round(mad, 6),
                "z": {c: round(float(x), 2) for c, x in zip(culprits, z[is_culprit])},
                "slow_for_s": round(float(view.now - self._since[ranks[culprit_rows]].min()), 3),
                "window_steps": cfg.window,
                "step": top,
            },
            detected_mono=view.now,
        )
