"""Stragglers: ranks whose own compute is persistently slower than the group's.

In synchronous training one slow rank makes every step slow, and every other
rank's step time grows by the same amount (they wait in collectives). So step
time cannot name the straggler; compute time (step time minus time in wait
phases) can. A rank is a straggler when its median compute time over the
last `window` steps is both `ratio` x the group's median and a robust outlier
(z-score from the median absolute deviation), for `persist` evaluations in a
row, so a single slow step (a GC pause, a cold cache) never fires.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainwatch.watchdog.detectors.base import Detector, RankRing, StepTracker, TickView, grow, row_median
from trainwatch.watchdog.incident import Incident, describe_ranks

# 0.6745 makes the MAD a standard-deviation estimate for normal data.
_MAD_TO_SIGMA = 0.6745
# The group's MAD is floored at this fraction of its median: identical
# compute times (MAD 0) would otherwise make any tiny difference infinitely
# significant; 2% is about the jitter of a step timer on a quiet node.
_MAD_FLOOR = 0.02


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """Thresholds of the straggler detector."""

    window: int = 10
    """Recent steps whose median compute time represents a rank (steps)."""
    min_steps: int = 5
    """Steps a rank needs in its window before it is compared (steps)."""
    ratio: float = 1.5
    """Minimum slowdown: rank median compute / group median compute (factor)."""
    z: float = 4.0
    """Minimum robust z-score of the rank's median against the group (MAD units)."""
    persist: int = 5
    """Consecutive evaluations (one per new group step) a rank must be slow before it is reported."""
    min_excess_s: float = 0.05
    """Minimum absolute extra compute per step over the group median (s): on small,
    fast steps OS scheduling noise alone reaches 1.5x, and costs nothing."""


class StragglerDetector(Detector):
    """Reports `straggler` while some ranks are persistently slow."""

    name = "straggler"

    def __init__(self, config: StragglerConfig | None = None):
        self.config = config or StragglerConfig()
        self._steps = StepTracker()
        self._compute = RankRing(self.config.window)
        self._streak = np.zeros(0, dtype=np.int64)
        self._last_eval_step = -1
        self._ratio_ranks = np.zeros(0, dtype=np.int64)
        self._ratio_values = np.zeros(0)
        self._current: Incident | None = None

    def current_ratios(self) -> dict[int, float]:
        """Latest slowdown ratio per compared rank (rank median compute / group
        median), for the `trainwatch_straggler_slowdown_ratio` gauge."""
        return dict(zip(self._ratio_ranks.tolist(), np.round(self._ratio_values, 4).tolist()))

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        ranks = t["rank"]
        self._streak = grow(self._streak, int(ranks.max()) + 1, 0)
        advanced, restarted = self._steps.update(t)
        if restarted.any():
            self._compute.reset(ranks[restarted])
            self._streak[ranks[restarted]] = 0
        compute = t["compute_s"]
        # NaN compute time means the rank does not know it (no wait phases
        # marked); such ranks are left out rather than guessed.
        push = advanced & np.isfinite(compute) & (compute >= 0)
        if push.any():
            self._compute.push(ranks[push], compute[push])
        top = int(t["step"].max())
        # One evaluation per new group step: re-evaluating the same data every
        # tick would turn `persist` into a wall-clock delay.
        if top != self._last_eval_step and advanced.any():
            self._last_eval_step = top
            self._current = self._evaluate(view)
        return [self._current] if self._current is not None else []

    def _evaluate(self, view: TickView) -> Incident | None:
        t = view.table
        cfg = self.config
        ranks = t["rank"]
        values, counts = self._compute.window(ranks)
        ok = counts >= cfg.min_steps
        if ok.sum() < 2:
            self._ratio_ranks, self._ratio_values = np.zeros(0, dtype=np.int64), np.zeros(0)
            self._streak[ranks] = 0
            return None
        med = row_median(values[ok], counts[ok])
        rows = np.nonzero(ok)[0]
        # The lower median: with two ranks (one node of two GPUs) the plain
        # median would average the straggler into its own reference.
        ref = float(np.sort(med)[(len(med) - 1) // 2])
        mad = float(np.sort(np.abs(med - ref))[(len(med) - 1) // 2])
        if ref <= 0:
            self._ratio_ranks, self._ratio_values = np.zeros(0, dtype=np.int64), np.zeros(0)
            self._streak[ranks] = 0
            return None
        mad = max(mad, _MAD_FLOOR * ref)
        ratio = med / ref
        z = _MAD_TO_SIGMA * (med - ref) / mad
        slow = (ratio >= cfg.ratio) & (z >= cfg.z) & (med - ref >= cfg.min_excess_s)
        old = self._streak[ranks[rows]]
        self._streak[ranks] = 0  # a rank not compared this time loses its streak
        streak = np.where(slow, old + 1, 0)
        self._streak[ranks[rows]] = streak
        self._ratio_ranks, self._ratio_values = ranks[rows].astype(np.int64), ratio
        is_culprit = streak >= cfg.persist
        if not is_culprit.any():
            return None
        culprit_rows = rows[is_culprit]
        c_ratio = ratio[is_culprit]
        c_med = med[is_culprit]
        excess = float(np.median(c_med)) - ref
        wait = t["step_s"] - t["compute_s"]
        waiting = np.isfinite(wait) & (wait >= 0.5 * excess)
        waiting[culprit_rows] = False
        culprits = ranks[culprit_rows].tolist()
        victims = ranks[np.nonzero(waiting)[0]].tolist()
        lead = int(np.argmax(c_ratio))
        text = (
            f"straggler: {describe_ranks(culprits)} computes {c_ratio[lead]:.1f}x the group median "
            f"({c_med[lead]:.3f} s vs {ref:.3f} s per step over the last {cfg.window} steps)"
        )
        if victims:
            text += f"; {describe_ranks(victims)} wait for it in collectives (victims)"
        return Incident(
            kind="straggler",
            culprit_ranks=culprits,
            victims=victims,
            summary=text,
            severity="medium",
            runbook="straggler",
            category=None,
            evidence={
                "slowdown_ratio": round(float(c_ratio.max()), 4),
                "ratios": {c: round(float(x), 4) for c, x in zip(culprits, c_ratio)},
                "compute_s": {c: round(float(x), 6) for c, x in zip(culprits, c_med)},
                "group_median_compute_s": round(ref, 6),
                "group_mad_s": round(mad, 6),
                "z": {c: round(float(x), 2) for c, x in zip(culprits, z[is_culprit])},
                "window_steps": cfg.window,
                "step": int(t["step"].max()),
            },
            detected_mono=view.now,
        )
