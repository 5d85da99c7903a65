"""Loss trend: a loss that keeps rising, or one that stopped improving.

A healthy loss falls fast, then slowly, then flattens late in training. A
spike is one step or a few far above the rest (the loss health detector's
business); a trend moves the bulk of the curve. Each rank's losses are
averaged into buckets of consecutive steps (memory stays `points` values per
rank whatever the window), and a robust line is fitted through the buckets of
the last window: the Theil-Sen slope (the median of the slopes between every
pair of points), which a few wild points cannot move, and Kendall's tau (how
consistently later points are higher), which says whether the slope is more
than noise.

- rising: over `window_steps` the fitted line raises the loss by at least
  `rise_frac` of its level, and the points agree (tau >= `min_tau`).
- plateau: over the much longer `plateau_window_steps` the fitted line
  improves the loss by less than `plateau_frac` of its level. Expected late in
  a long run (diminishing returns), so it is reported at low severity and
  needs a long window.

Losses at or below 0 are not judged (a relative change means nothing there).
The fit costs a few hundred pairs per rank; it runs only when a rank closed a
new bucket, at most `max_ranks_per_tick` ranks a tick (the others wait their
turn: a trend is a slow signal).
"""

from __future__ import annotations

import math

import numpy as np

from trainwatch.watchdog.detectorconfig import LossTrendConfig
from trainwatch.watchdog.detectors.base import Detector, RankRing, StepTracker, TickView, step_changes, grow, row_median
from trainwatch.watchdog.detectors.loss import judged, loss_watched
from trainwatch.watchdog.incident import Incident, describe_ranks

_MAX_LISTED = 32


class _Series:
    """Per-rank bucket means of the loss over one window, with the fit's result."""

    def __init__(self, window_steps: int, points: int):
        self.window = window_steps
        self.points = points
        self.bucket = max(1, math.ceil(window_steps / points))
        depth = points + 2
        self.x = RankRing(depth)
        self.y = RankRing(depth)
        self._pairs = np.triu_indices(depth, 1)
        self.sx, self.sy, self.sn = np.zeros(0), np.zeros(0), np.zeros(0)  # per rank: sums of steps, losses; samples
        self.start = np.zeros(0, dtype=np.int64)
        self.pending = np.zeros(0, dtype=bool)
        self.cursor = 0
        self.fit = np.zeros((0, 4))  # per rank: step, slope, level, tau (NaN: not fitted)

    def grow(self, size: int) -> None:
        self.sx, self.sy, self.sn = (grow(a, size, 0.0) for a in (self.sx, self.sy, self.sn))
        self.start = grow(self.start, size, -1)
        self.pending = grow(self.pending, size, False)
        self.fit = grow(self.fit, size, np.nan)

    def reset(self, r: np.ndarray) -> None:
        self.x.reset(r)
        self.y.reset(r)
        self.sx[r] = self.sy[r] = self.sn[r] = 0.0
        self.start[r] = -1
        self.pending[r] = False
        self.fit[r] = np.nan

    def add(self, r: np.ndarray, step: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Add one loss sample per rank; return (ranks, mean step, mean loss) of the buckets this closed."""
        start = self.start[r]
        close = (start >= 0) & (step >= start + self.bucket) & (self.sn[r] > 0)
        rc = r[close]
        xm = ym = np.zeros(0)
        if len(rc):
            n = self.sn[rc]
            xm, ym = self.sx[rc] / n, self.sy[rc] / n
            self.x.push(rc, xm)
            self.y.push(rc, ym)
            self.pending[rc] = True
            self.sx[rc] = self.sy[rc] = self.sn[rc] = 0.0
        self.start[r] = np.where(close | (start < 0), step, start)
        self.sx[r] += step
        self.sy[r] += loss
        self.sn[r] += 1.0
        return rc, xm, ym

    def due(self, limit: int) -> np.ndarray:
        """Ranks with a new bucket to fit, at most `limit`, taking turns from a rotating start."""
        idx = np.nonzero(self.pending)[0]
        if len(idx) > limit:
            idx = np.roll(idx, -int(np.searchsorted(idx, self.cursor)))[:limit]
            self.cursor = int(idx[-1]) + 1
        self.pending[idx] = False
        return idx

    def refit(self, r: np.ndarray, now_step: np.ndarray) -> None:
        """Theil-Sen slope, level (median loss) and Kendall's tau of each rank's window."""
        xs, _ = self.x.window(r)
        ys, _ = self.y.window(r)
        valid = np.isfinite(xs) & np.isfinite(ys) & (xs >= (now_step - self.window)[:, None])
        n = valid.sum(axis=1)
        i, j = self._pairs
        dx, dy = xs[:, j] - xs[:, i], ys[:, j] - ys[:, i]
        ok = valid[:, i] & valid[:, j] & (dx != 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            slopes = np.where(ok, dy / dx, np.nan)
        npairs = ok.sum(axis=1)
        slope = row_median(slopes, npairs)
        level = row_median(np.where(valid, ys, np.nan), n)
        agree = np.where(ok, np.sign(dx) * np.sign(dy), 0.0).sum(axis=1)
        tau = np.where(npairs > 0, agree / np.maximum(npairs, 1), np.nan)
        span = np.where(valid, xs, -np.inf).max(axis=1) - np.where(valid, xs, np.inf).min(axis=1)
        enough = (n >= max(4, math.ceil(0.75 * self.points))) & (span >= 0.6 * self.window)
        self.fit[r] = np.where(enough[:, None], np.column_stack([now_step, slope, level, tau]), np.nan)

    def relative(self, r: np.ndarray) -> np.ndarray:
        """Fitted change over the window as a fraction of the level (NaN where not judged)."""
        f = self.fit[r]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(f[:, 2] > 0, f[:, 1] * self.window / f[:, 2], np.nan)


class LossTrendDetector(Detector):
    """Reports `loss_trend` (a rising loss, or a plateau)."""

    name = "loss_trend"

    def __init__(self, config: LossTrendConfig | None = None, *, loss_health: str = "auto"):
        self.config = config or LossTrendConfig()
        self.loss_health = loss_health
        """`--loss-health`: whose losses are judged (loss.judged): a falling-loss rule means
        nothing for a loss that honestly rises (an RL value loss)."""
        cfg = self.config
        self._steps = StepTracker()
        self._rise = _Series(cfg.window_steps, cfg.points)
        self._flat = _Series(cfg.plateau_window_steps, cfg.points) if cfg.plateau_window_steps > 0 else None
        self._series = [s for s in (self._rise, self._flat) if s is not None]
        self._rising = np.zeros(0, dtype=bool)
        self._plateau = np.zeros(0, dtype=bool)
        self._live = np.zeros(0, dtype=np.int64)

    def current_slopes(self) -> dict[int, float]:
        """{rank: fitted loss slope over the rising window, in loss units per step} for the ranks last seen."""
        live = self._live[self._live < len(self._rise.fit)]
        slope = self._rise.fit[live, 1]
        keep = np.isfinite(slope)
        return dict(zip(live[keep].tolist(), slope[keep].tolist()))

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        cfg = self.config
        ranks = t["rank"]
        size = int(ranks.max()) + 1
        for s in self._series:
            s.grow(size)
        self._rising = grow(self._rising, size, False)
        self._plateau = grow(self._plateau, size, False)
        self._live = ranks.copy()
        changes = step_changes(view, self._steps)
        advanced, restarted = changes.advanced, changes.restarted
        if restarted.any():
            gone = ranks[restarted]
            for s in self._series:
                s.reset(gone)
            self._rising[gone] = self._plateau[gone] = False
        loss = t["loss"]
        use = advanced & np.isfinite(loss) & judged(t, self.loss_health)
        if use.any():
            closed = self._rise.add(ranks[use], t["step"][use], loss[use])
            if self._flat is not None:
                # The plateau's longer buckets are made of the rising window's closed ones.
                if self._flat.bucket >= self._rise.bucket:
                    if len(closed[0]):
                        self._flat.add(*closed)
                else:
                    self._flat.add(ranks[use], t["step"][use], loss[use])
        size_steps = np.zeros(size, dtype=np.int64)
        size_steps[ranks] = t["step"]
        r = self._rise.due(cfg.max_ranks_per_tick)
        if len(r):
            self._rise.refit(r, size_steps[r])
            rel, tau = self._rise.relative(r), self._rise.fit[r, 3]
            # Hysteresis: a rise already reported lasts until it is half as steep
            # or half as consistent, so a trend at the threshold is one incident.
            k = np.where(self._rising[r], 0.5, 1.0)
            self._rising[r] = (rel >= k * cfg.rise_frac) & (tau >= k * cfg.min_tau)
        if self._flat is not None:
            r = self._flat.due(cfg.max_ranks_per_tick)
            if len(r):
                self._flat.refit(r, size_steps[r])
                k = np.where(self._plateau[r], 2.0, 1.0)
                self._plateau[r] = self._flat.relative(r) > -k * cfg.plateau_frac
        out = []
        rising = self._rising[ranks]
        if rising.any():
            out.append(self._incident(view, ranks[rising], rising=True))
        flat = self._plateau[ranks] & ~rising
        if flat.any():
            out.append(self._incident(view, ranks[flat], rising=False))
        return out

    def _incident(self, view: TickView, ranks: np.ndarray, *, rising: bool) -> Incident:
        cfg = self.config
        series = self._rise if rising else self._flat
        assert series is not None
        ranks = np.unique(ranks)
        fit = series.fit[ranks]
        rel = series.relative(ranks)
        lead = int(np.nanargmax(rel)) if np.isfinite(rel).any() else 0
        step, slope, level, tau = (float(v) for v in fit[lead])
        window = series.window
        per_rank = {int(r): {"step": int(f[0]), "slope_per_step": float(f[1]), "level": float(f[2]),
                             "tau": round(float(f[3]), 3), "relative_change": round(float(c), 4)}
                    for r, f, c in zip(ranks[:_MAX_LISTED], fit[:_MAX_LISTED], rel[:_MAX_LISTED])}
        who = describe_ranks(ranks)
        if rising:
            text = (f"loss trend: loss rising on {who}: over the last {window} steps (to step {int(step)}) the "
                    f"robust fit climbs {rel[lead]:+.0%} of its level {level:.4g} (slope {slope:.3g} per step, "
                    f"tau {tau:.2f}); not a spike: the bulk of the curve moved")
            severity, key = "", "loss_trend:rising"  # "": the kind's own severity (kinds.py)
        else:
            text = (f"loss trend: loss plateau on {who}: over the last {window} steps (to step {int(step)}) the "
                    f"loss changed {rel[lead]:+.2%} of its level {level:.4g}, under the {cfg.plateau_frac:.2%} "
                    "improvement expected; normal late in training, a problem early on")
            severity, key = "low", "loss_trend:plateau"
        return Incident(
            kind="loss_trend",
            culprit_ranks=ranks.tolist(),
            summary=text,
            severity=severity,
            category=None,
            evidence={"trend": "rising" if rising else "plateau", "step": int(step), "window_steps": window,
                      "loss_watched": loss_watched(view.table, np.nonzero(np.isin(view.table["rank"], ranks))[0]),
                      "relative_change": round(float(rel[lead]), 4), "slope_per_step": slope, "level": level,
                      "tau": round(tau, 3), "ranks": per_rank},
            key=key,
            detected_mono=view.now,
        )
