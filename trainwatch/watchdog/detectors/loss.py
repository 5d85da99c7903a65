"""Loss health: non-finite values, loss spikes and exploding gradients.

Follows the usual loss-health reading of a training log: loss should trend
down, a NaN/Inf loss or grad norm is fatal, small spikes (10-20% above trend)
are normal noise, and grad norms far above their usual range (> 100 where
0.1-10 is healthy) mean gradients are exploding. Each rank is judged against
its own robust baseline (median and median absolute deviation of its last
steps), because ranks see different data and their losses differ.

Which loss is judged, and how (`--loss-health`): the loss the script
declares (`tw.step(loss=...)`) or the integrated trainer reports is a training
loss and gets every rule (`full`). An unmodified script's loss is whatever
backward() ran on: an RL value loss, a sum of losses, a loss that honestly
rises as returns grow; it gets the NaN/Inf rule only (`nan-only`) unless the
user asks for `full`. `auto` (the default) picks per rank from where its
steps come from; `off` judges no loss. Every loss incident says which loss
it watched (evidence `loss_watched`).

A rank is evaluated only when its step advanced, so one step's value is never
counted twice. The verdict for that step is held until its next step, so a
fault that lasts several steps is one continuing condition, not a new one
per step.
"""

from __future__ import annotations

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectorconfig import LossHealthConfig
from trainwatch.watchdog.detectors.base import (
    Detector,
    RankRing,
    StepTracker,
    step_changes,
    TickView,
    grow,
    robust_spread,
    row_median,
)
from trainwatch.watchdog.incident import Incident, describe_ranks

_MAX_LISTED = 32


LOSS_WATCHED = {
    slots.STEP_REPORTED: "the loss passed to tw.step() (declared)",
    slots.STEP_COUNTED: "the loss backward() ran on (unmodified script)",
}


def judged(t: np.ndarray, mode: str, *, nan: bool = False) -> np.ndarray:
    """Rows whose loss the rules of `--loss-health` judge: the NaN/Inf rule
    (`nan=True`) or the rest (spikes, explosions, the trend)."""
    if mode == "off":
        return np.zeros(len(t), dtype=bool)
    if mode == "full" or nan:
        return np.ones(len(t), dtype=bool)
    if mode == "nan-only":
        return np.zeros(len(t), dtype=bool)
    return t["step_source"] == slots.STEP_REPORTED


def loss_watched(t: np.ndarray, rows: np.ndarray) -> str:
    """Which loss the incident's ranks publish, in words."""
    sources = {int(x) for x in t["step_source"][rows]}
    return "; ".join(LOSS_WATCHED.get(s, "the rank's loss") for s in sorted(sources)) or "the rank's loss"


def _worst(t: np.ndarray, rows: np.ndarray, field: str, peak: str, peak_step: str,
           *, nan_wins: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the worst value since the sidecar's previous read (the rank keeps
    it, so a one-step spike between two reads is not lost) and its step; the
    current value and step where the rank reports no peak."""
    cur, step = t[field][rows], t["step"][rows]
    if peak not in (t.dtype.names or ()):
        return cur, step
    pk, at = t[peak][rows], t[peak_step][rows]
    has = at > 0
    if nan_wins:
        use = has & (~np.isfinite(pk) | (pk > cur))
    else:
        use = has & np.isfinite(pk) & ~(pk <= cur)
    return np.where(use, pk, cur), np.where(use, at, step)


_SOURCE_GRACE_S = 2.0
"""How long a grad-only NaN waits for a lagging rank to publish its own (NaN) loss (s)."""


class LossHealthDetector(Detector):
    """Reports `loss_nan`, `loss_spike` and `grad_explosion`."""

    name = "loss_health"

    def __init__(self, config: LossHealthConfig | None = None):
        self.config = config or LossHealthConfig()
        self._steps = StepTracker()
        self._loss = RankRing(self.config.history)
        self._grad = RankRing(self.config.history)
        self._grad_only_since: float | None = None
        # A slot holds NaN for "not reported": a NaN only counts as a fault
        # from a rank that has reported a finite value before (Inf always does).
        self._seen_loss = np.zeros(0, dtype=bool)
        self._seen_grad = np.zeros(0, dtype=bool)
        # Verdicts of each rank's last evaluated step: (step, value, median, mad).
        self._spike = np.zeros((0, 4))
        self._spiking = np.zeros(0, dtype=bool)
        self._explode = np.zeros((0, 3))
        self._exploding = np.zeros(0, dtype=bool)

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        ranks = t["rank"]
        size = int(ranks.max()) + 1
        self._seen_loss = grow(self._seen_loss, size, False)
        self._seen_grad = grow(self._seen_grad, size, False)
        self._spike = grow(self._spike, size, np.nan)
        self._spiking = grow(self._spiking, size, False)
        self._explode = grow(self._explode, size, np.nan)
        self._exploding = grow(self._exploding, size, False)
        changes = step_changes(view, self._steps)
        advanced, restarted = changes.advanced, changes.restarted
        if restarted.any():
            gone = ranks[restarted]
            self._loss.reset(gone)
            self._grad.reset(gone)
            for arr in (self._seen_loss, self._seen_grad, self._spiking, self._exploding):
                arr[gone] = False
        mode = self.config.health
        if advanced.any():
            # Every rank's finite values make its later NaN a fault (the NaN rule);
            # spikes and explosions are judged where the mode says.
            rows = np.nonzero(advanced)[0]
            r = ranks[rows]
            self._seen_loss[r[np.isfinite(t["loss"][rows])]] = True
            self._seen_grad[r[np.isfinite(t["grad_norm"][rows])]] = True
            rows = np.nonzero(advanced & judged(t, mode))[0]
            self._judge_loss(t, rows)
            self._judge_grad(t, rows)

        out = []
        bad = self._non_finite(view)
        # Busy while a NaN grad waits for its source's loss, and while a rank that
        # reports its loss has fewer than min_steps of it seen (a baseline is learnt
        # from the steps the rounds see).
        min_steps = self.config.min_steps
        learning = ((self._loss.counts(ranks) < min_steps) & self._seen_loss[ranks]).any() or (
            (self._grad.counts(ranks) < min_steps) & self._seen_grad[ranks]).any()
        self.busy = self._grad_only_since is not None or bool(learning)
        if bad is not None:
            out.append(bad)
        spiking = self._spiking[ranks]
        if spiking.any():
            out.append(self._spike_incident(view, np.nonzero(spiking)[0]))
        exploding = self._exploding[ranks]
        if exploding.any():
            out.append(self._explode_incident(view, np.nonzero(exploding)[0]))
        return out

    def _judge_loss(self, t: np.ndarray, rows: np.ndarray) -> None:
        cfg = self.config
        r = t["rank"][rows]
        loss, at = _worst(t, rows, "loss", "peak_loss", "peak_loss_step")
        finite = np.isfinite(loss)
        self._seen_loss[r[finite]] = True
        self._spiking[r] = False
        cand = finite & (self._loss.counts(r) >= cfg.min_steps)
        if cand.any():
            rc, lc = r[cand], loss[cand]
            values, counts = self._loss.window(rc)
            # Cheap pre-filter: exceeding factor x median needs exceeding
            # factor x minimum (for positive losses), so a falling loss never
            # pays for the sort.
            pre = lc > cfg.spike_factor * np.nanmin(values, axis=1)
            if pre.any():
                rp, lp = rc[pre], lc[pre]
                med, mad = robust_spread(values[pre], counts[pre])
                spike = (med > 0) & (lp > med + cfg.spike_mad_k * mad) & (lp > cfg.spike_factor * med)
                if spike.any():
                    hit = rp[spike]
                    self._spiking[hit] = True
                    steps = at[cand][pre][spike]
                    self._spike[hit] = np.column_stack([steps, lp[spike], med[spike], mad[spike]])
        # Record after judging: a spike must not raise its own baseline.
        self._loss.push(r[finite], loss[finite])

    def _judge_grad(self, t: np.ndarray, rows: np.ndarray) -> None:
        cfg = self.config
        r = t["rank"][rows]
        grad, at = _worst(t, rows, "grad_norm", "peak_grad", "peak_grad_step")
        finite = np.isfinite(grad)
        self._seen_grad[r[finite]] = True
        self._exploding[r] = False
        cand = finite & (grad > cfg.grad_norm_floor) & (self._grad.counts(r) >= cfg.min_steps)
        if cand.any():
            rc, gc = r[cand], grad[cand]
            values, counts = self._grad.window(rc)
            med = row_median(values, counts)
            boom = gc > np.fmax(cfg.grad_norm_floor, cfg.grad_norm_factor * med)
            if boom.any():
                hit = rc[boom]
                self._exploding[hit] = True
                steps = at[cand][boom]
                self._explode[hit] = np.column_stack([steps, gc[boom], med[boom]])
        self._grad.push(r[finite], grad[finite])

    def _non_finite(self, view: TickView) -> Incident | None:
        t = view.table
        ranks = t["rank"]
        started = (t["step"] >= 1) & judged(t, self.config.health, nan=True)
        all_rows = np.arange(len(t))
        loss, loss_at = _worst(t, all_rows, "loss", "peak_loss", "peak_loss_step", nan_wins=True)
        grad, _grad_at = _worst(t, all_rows, "grad_norm", "peak_grad", "peak_grad_step", nan_wins=True)
        bad_loss = started & ~np.isfinite(loss) & (self._seen_loss[ranks] | np.isinf(loss))
        bad_grad = started & ~np.isfinite(grad) & (self._seen_grad[ranks] | np.isinf(grad))
        if "loss_scale" in (t.dtype.names or ()):
            # With an fp16 loss scaler, gradients that overflow are routine: the scaler
            # skips that step and halves its scale (loss_scale_collapse watches the scale).
            scale = t["loss_scale"]
            bad_grad &= ~(np.isfinite(scale) & (scale > 0))
        if not (bad_loss.any() or bad_grad.any()):
            return None
        if bad_loss.sum() > 1:
            # In data parallel training a NaN from one rank reaches every rank's
            # weights within a step: the ranks whose loss went bad first are the source.
            first = loss_at[bad_loss].min()
            bad_grad |= bad_loss & (loss_at > first)
            bad_loss &= loss_at == first
        step = int(t["step"][bad_loss | bad_grad].max())
        if not bad_loss.any() and (t["step"][started] < step).any():
            # Grad norms are all-reduced: every rank sees NaN once one rank's loss
            # went bad. If some rank has not published that step yet, it may be
            # the source: give it a moment before blaming the grads alone.
            if self._grad_only_since is None:
                self._grad_only_since = view.now
            if view.now - self._grad_only_since < _SOURCE_GRACE_S:
                return None
        else:
            self._grad_only_since = None
        if bad_loss.any():
            # The rank whose own loss went bad is the source; in data parallel
            # training the all-reduce then spreads NaN into every rank's grads.
            c_rows = np.nonzero(bad_loss)[0]
            v_rows = np.nonzero(bad_grad & ~bad_loss)[0]
            value = float(loss[c_rows[0]])
            text = f"loss_nan: {describe_ranks(ranks[c_rows])} reported loss {value} at step {step}"
            if len(v_rows):
                text += f"; {describe_ranks(ranks[v_rows])} have a non-finite grad norm (victims)"
        else:
            c_rows = np.nonzero(bad_grad)[0]
            v_rows = np.zeros(0, dtype=np.int64)
            value = float(grad[c_rows[0]])
            text = f"loss_nan: {describe_ranks(ranks[c_rows])} reported grad norm {value} at step {step} (loss finite)"
        return Incident(
            kind="loss_nan",
            key="loss_nan",  # one episode per kind, however many ranks join it (the NaN spreads)
            culprit_ranks=ranks[c_rows].tolist(),
            victims=ranks[v_rows].tolist(),
            summary=text,
            category=None,
            evidence={
                "step": step,
                "loss": {int(ranks[i]): float(loss[i]) for i in c_rows[:_MAX_LISTED]},
                "grad_norm": {int(ranks[i]): float(grad[i]) for i in c_rows[:_MAX_LISTED]},
                "non_finite_loss_ranks": int(bad_loss.sum()),
                "non_finite_grad_ranks": int(bad_grad.sum()),
                "loss_watched": loss_watched(t, c_rows),
            },
            detected_mono=view.now,
        )

    def _spike_incident(self, view: TickView, rows: np.ndarray) -> Incident:
        ranks = view.table["rank"][rows]
        info = self._spike[ranks]
        lead = int(np.argmax(info[:, 1] / info[:, 2]))
        step, value, med, mad = info[lead]
        text = (
            f"loss spike: {describe_ranks(ranks)} loss {value:.4g} at step {int(step)} is "
            f"{value / med:.1f}x the median {med:.4g} of the last {self.config.history} steps (MAD {mad:.3g})"
        )
        return Incident(
            kind="loss_spike",
            key="loss_spike",  # one episode per kind, however many ranks join it (the NaN spreads)
            culprit_ranks=ranks.tolist(),
            summary=text,
            category=None,
            evidence={
                "step": int(step),
                "loss_watched": loss_watched(view.table, rows),
                "spikes": {
                    int(r): {"step": int(s), "loss": float(v), "baseline_median": float(m), "baseline_mad": float(d),
                             "ratio": round(float(v / m), 4)}
                    for r, (s, v, m, d) in zip(ranks[:_MAX_LISTED], info[:_MAX_LISTED])
                },
            },
            detected_mono=view.now,
        )

    def _explode_incident(self, view: TickView, rows: np.ndarray) -> Incident:
        ranks = view.table["rank"][rows]
        info = self._explode[ranks]
        lead = int(np.argmax(info[:, 1]))
        step, value, med = info[lead]
        cfg = self.config
        text = (
            f"grad explosion: {describe_ranks(ranks)} grad norm {value:.4g} at step {int(step)} exceeds "
            f"max({cfg.grad_norm_floor:g}, {cfg.grad_norm_factor:g} x its median {med:.4g})"
        )
        return Incident(
            kind="grad_explosion",
            key="grad_explosion",  # one episode per kind, however many ranks join it (the NaN spreads)
            culprit_ranks=ranks.tolist(),
            summary=text,
            category=None,
            evidence={
                "step": int(step),
                "loss_watched": loss_watched(view.table, rows),
                "grad_norms": {
                    int(r): {"step": int(s), "grad_norm": float(v), "baseline_median": float(m)}
                    for r, (s, v, m) in zip(ranks[:_MAX_LISTED], info[:_MAX_LISTED])
                },
            },
            detected_mono=view.now,
        )
