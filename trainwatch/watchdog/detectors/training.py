"""Training health: dead and vanishing gradients, a stuck learning rate, a
collapsing fp16 loss scale.

The signals a training log prints next to the loss, judged per rank from what
each rank publishes at every step (slot fields `grad_norm`, `zero_grad_frac`,
`lr`, `loss_scale`; NaN means the rank does not report it, and a value that is
not reported never counts as a fault):

- dead_grad: a gradient norm of exactly 0 (or every gradient element exactly
  zero) for several steps in a row, on a rank that had real gradients before.
  Nothing learns any more: a detached loss, frozen or disconnected parameters,
  an optimizer that holds different tensors than the model.
- vanishing_grad: more than half of the gradient elements exactly zero for
  many steps (healthy is a few percent): dying activations, saturated gates,
  an input pipeline feeding constants.
- lr_stuck: the learning rate stays at exactly 0 past the first steps, or,
  after a warmup, stays exactly at its peak far longer than the warmup took.
  The second is how a scheduler that stopped being stepped looks, and also how
  a constant or warmup-stable-decay schedule looks: it is reported at low
  severity and only after a long time (`lr_max_ratio` 0 turns it off).
- loss_scale_collapse: the GradScaler's scale fell by 2^k within a window of
  steps and stayed down, or fell below a floor: fp16 gradients keep
  overflowing, so steps are skipped and the scale keeps halving.

Each condition is reported on every tick while it lasts, under one key per
kind, so the engine makes one incident per episode however many ranks join it.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from trainwatch.watchdog.detectorconfig import TrainingHealthConfig
from trainwatch.watchdog.detectors.base import Detector, StepTracker, TickView, step_changes, grow
from trainwatch.watchdog.detectors.loss import _worst
from trainwatch.watchdog.incident import Incident, describe_ranks

_MAX_LISTED = 32
_SCALE_CHANGES = 16
"""Loss-scale changes kept per rank (a scale changes only on overflow or growth)."""


def _runs(since: np.ndarray, r: np.ndarray, hit: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Update the run starts of ranks `r` (step a condition began, -1 when not
    holding) from this sample; return the run lengths in steps (0: none)."""
    start = since[r]
    start = np.where(hit, np.where(start < 0, step, start), -1)
    since[r] = start
    return np.where(start >= 0, step - start + 1, 0)


class TrainingHealthDetector(Detector):
    """Reports `dead_grad`, `vanishing_grad`, `lr_stuck` and `loss_scale_collapse`."""

    name = "training_health"

    def __init__(self, config: TrainingHealthConfig | None = None):
        self.config = config or TrainingHealthConfig()
        self._steps = StepTracker()
        n = 0
        self._seen_grad = np.zeros(n, dtype=bool)
        self._dead_since = np.zeros(n, dtype=np.int64)
        self._vanish_since = np.zeros(n, dtype=np.int64)
        self._zero_since = np.zeros(n, dtype=np.int64)
        self._lr_first = np.zeros(n)
        self._lr_first_step = np.zeros(n, dtype=np.int64)
        self._lr_max = np.zeros(n)
        self._lr_max_step = np.zeros(n, dtype=np.int64)
        self._flat_since = np.zeros(n, dtype=np.int64)
        self._first_step = np.zeros(n, dtype=np.int64)
        self._scale_seen = np.zeros(n)
        self._scale_ref = np.zeros(n)
        self._ch_step = np.zeros((n, _SCALE_CHANGES), dtype=np.int64)
        self._ch_val = np.zeros((n, _SCALE_CHANGES))
        self._ch_pos = np.zeros(n, dtype=np.int64)
        self._ch_last = np.zeros(n)
        # Held verdicts of each rank's last judged step: (step, value, run length or reference).
        self._flags = {kind: np.zeros(n, dtype=bool) for kind in ("dead", "vanish", "zero", "max", "scale")}
        self._info = {kind: np.zeros((n, 3)) for kind in self._flags}

    _FILL: ClassVar[dict] = {"_seen_grad": False, "_dead_since": -1, "_vanish_since": -1, "_zero_since": -1,
                             "_lr_first": np.nan,
                             "_lr_first_step": 0, "_lr_max": np.nan, "_lr_max_step": 0, "_flat_since": -1,
                             "_first_step": 0, "_scale_seen": np.nan, "_scale_ref": np.nan, "_ch_step": 0,
                             "_ch_val": np.nan, "_ch_pos": 0, "_ch_last": np.nan}

    def _grow(self, size: int) -> None:
        if size <= len(self._seen_grad):
            return
        for name, fill in self._FILL.items():
            setattr(self, name, grow(getattr(self, name), size, fill))
        for kind in self._flags:
            self._flags[kind] = grow(self._flags[kind], size, False)
            self._info[kind] = grow(self._info[kind], size, np.nan)

    def _reset(self, ranks: np.ndarray) -> None:
        for name, fill in self._FILL.items():
            getattr(self, name)[ranks] = fill
        for kind in self._flags:
            self._flags[kind][ranks] = False

    def check(self, view: TickView) -> list[Incident]:
        t = view.table
        if len(t) == 0:
            return []
        ranks = t["rank"]
        self._grow(int(ranks.max()) + 1)
        changes = step_changes(view, self._steps)
        advanced, restarted = changes.advanced, changes.restarted
        if restarted.any():
            self._reset(ranks[restarted])
        if advanced.any():
            rows = np.nonzero(advanced)[0]
            self._judge_grads(t, rows)
            self._judge_lr(t, rows)
            self._judge_scale(t, rows)
        return [inc for kind in self._flags if (inc := self._incident(view, kind)) is not None]

    # ---- judging one step per advanced rank -------------------------------------------

    def _judge_grads(self, t: np.ndarray, rows: np.ndarray) -> None:
        cfg = self.config
        r, step = t["rank"][rows], t["step"][rows]
        # The largest norm since the previous read: 0 means every step in between had none.
        grad, _ = _worst(t, rows, "grad_norm", "peak_grad", "peak_grad_step")
        frac = t["zero_grad_frac"][rows]
        self._seen_grad[r] |= (np.isfinite(grad) & (grad > 0)) | (np.isfinite(frac) & (frac < 1.0))
        all_zero = frac >= 1.0
        dead = ((grad == 0.0) & self._seen_grad[r]) | all_zero
        n = _runs(self._dead_since, r, dead, step)
        self._hold("dead", r, n >= cfg.dead_grad_steps, step, np.where(all_zero, frac, grad), n)
        vanish = (frac > cfg.vanishing_frac) & ~all_zero
        n = _runs(self._vanish_since, r, vanish, step)
        self._hold("vanish", r, n >= cfg.vanishing_steps, step, frac, n)

    def _judge_lr(self, t: np.ndarray, rows: np.ndarray) -> None:
        cfg = self.config
        r, step = t["rank"][rows], t["step"][rows]
        lr = t["lr"][rows]
        ok = np.isfinite(lr) & (lr >= 0)
        # Stuck at 0: counted from the later of the run's start and the grace steps.
        zero = ok & (lr == 0.0)
        _runs(self._zero_since, r, zero, step)
        since = self._zero_since[r]
        n = np.where(since >= 0, step - np.maximum(since, cfg.lr_grace_steps), 0)
        self._hold("zero", r, zero & (n >= cfg.lr_zero_steps), step, since, n)
        # Stuck at the peak: the first value, the peak and since when it is held exactly.
        first = ok & np.isnan(self._lr_first[r])
        self._lr_first[r[first]] = lr[first]
        self._lr_first_step[r[first]] = step[first]
        peak = self._lr_max[r]
        higher = ok & ~(lr <= peak)  # NaN peak: the first value
        at_peak = ok & (lr == peak)
        self._lr_max[r[higher]] = lr[higher]
        self._lr_max_step[r[higher]] = step[higher]
        flat = self._flat_since[r]
        flat = np.where(higher, step, np.where(at_peak, np.where(flat < 0, step, flat), -1))
        self._flat_since[r] = flat
        long = ok & (flat >= 0) & (step - flat >= cfg.lr_max_min_steps) & (cfg.lr_max_ratio > 0)
        self._flags["max"][r] = False
        if long.any():
            r, step, flat = r[long], step[long], flat[long]
            top = self._lr_max[r]
            warmup = self._lr_max_step[r] - self._lr_first_step[r]
            rose = (self._lr_first[r] <= 0.5 * top) & (top > 0) & (warmup > 0)
            self._hold("max", r, rose & (step - flat > cfg.lr_max_ratio * warmup), step, top, warmup)

    def _judge_scale(self, t: np.ndarray, rows: np.ndarray) -> None:
        cfg = self.config
        scale = t["loss_scale"][rows]
        ok = np.isfinite(scale) & (scale >= 0)
        self._flags["scale"][t["rank"][rows[~ok]]] = False
        rows, scale = rows[ok], scale[ok]
        r, step = t["rank"][rows], t["step"][rows]
        if len(r) == 0:
            return
        self._first_step[r] = np.where(self._first_step[r] > 0, self._first_step[r], step)
        self._scale_seen[r] = np.fmax(self._scale_seen[r], scale)
        changed = ~(scale == self._ch_last[r])
        if changed.any():
            rc = r[changed]
            pos = self._ch_pos[rc]
            self._ch_step[rc, pos] = step[changed]
            self._ch_val[rc, pos] = scale[changed]
            self._ch_pos[rc] = (pos + 1) % _SCALE_CHANGES
            self._ch_last[rc] = scale[changed]
        factor = 2.0 ** cfg.scale_halvings
        below = (scale < cfg.scale_floor) & (self._scale_seen[r] >= cfg.scale_floor)
        # Still collapsed against the reference of a fall already reported ...
        ref = self._scale_ref[r]
        fallen = scale * factor <= ref
        # ... or newly: the highest scale in effect within the window (after the grace steps).
        start = np.maximum(step - cfg.scale_window_steps, self._first_step[r] + cfg.scale_grace_steps)
        cand = ~fallen & (step >= start) & (scale * factor <= self._scale_seen[r])
        if cand.any():
            ch_s, ch_v = self._ch_step[r[cand]], self._ch_val[r[cand]]
            s0 = start[cand][:, None]
            inside = np.where((ch_s > s0) & np.isfinite(ch_v), ch_v, -np.inf).max(axis=1)
            # The value in effect at the window's start: the latest change at or before it.
            before = np.where((ch_s <= s0) & np.isfinite(ch_v), ch_s, -1)
            at = np.argmax(before, axis=1)
            at_start = np.where(before.max(axis=1) >= 0, ch_v[np.arange(len(at)), at], -np.inf)
            window_ref = np.maximum(inside, at_start)
            new = scale[cand] * factor <= window_ref
            ref[np.nonzero(cand)[0][new]] = window_ref[new]
            fallen[np.nonzero(cand)[0][new]] = True
        self._scale_ref[r] = np.where(fallen, ref, np.nan)
        self._hold("scale", r, below | fallen, step, scale, np.where(fallen, ref, self._scale_seen[r]))

    def _hold(self, kind: str, r: np.ndarray, on: np.ndarray, *info: np.ndarray) -> None:
        """Keep the verdict of each rank's latest step, and the facts of those that are on."""
        self._flags[kind][r] = on
        if on.any():
            self._info[kind][r[on]] = np.column_stack([np.asarray(x)[on] for x in info])

    # ---- incidents -----------------------------------------------------------------------

    def _incident(self, view: TickView, kind: str) -> Incident | None:
        ranks = view.table["rank"]
        on = self._flags[kind][ranks]
        if not on.any():
            return None
        hit = np.unique(ranks[on])
        info = self._info[kind][hit]
        cfg = self.config
        who = describe_ranks(hit)
        lead = info[np.argmax(info[:, 2])] if kind != "scale" else info[np.argmin(info[:, 1])]
        step, value, extra = float(lead[0]), float(lead[1]), float(lead[2])
        per_rank = {int(r): {"step": int(s), "value": float(v), "detail": float(x)}
                    for r, (s, v, x) in zip(hit[:_MAX_LISTED], info[:_MAX_LISTED])}
        if kind == "dead":
            what = "every gradient element is zero" if value >= 1.0 else "the gradient norm is exactly 0"
            text = (f"dead gradients: on {who} {what} for {int(extra)} steps in a row (step {int(step)}); "
                    "the model is not learning")
            return self._make(view, "dead_grad", "dead_grad", hit, text,
                              evidence={"step": int(step), "steps_in_a_row": int(extra), "ranks": per_rank})
        if kind == "vanish":
            text = (f"vanishing gradients: on {who} {value:.0%} of gradient elements are exactly zero "
                    f"(over {cfg.vanishing_frac:.0%}) for {int(extra)} steps in a row (step {int(step)})")
            return self._make(view, "vanishing_grad", "vanishing_grad", hit, text,
                              evidence={"step": int(step), "zero_fraction": value,
                                        "steps_in_a_row": int(extra), "ranks": per_rank})
        if kind == "zero":
            text = (f"learning rate stuck at 0: {who} trained {int(extra)} steps past step {cfg.lr_grace_steps} "
                    f"with a learning rate of exactly 0 (since step {max(int(value), 1)}, now step {int(step)})")
            return self._make(view, "lr_stuck", "lr_stuck:zero", hit, text,
                              evidence={"step": int(step), "lr": 0.0, "zero_since_step": int(value),
                                        "ranks": per_rank})
        if kind == "max":
            held = int(step - self._flat_since[hit].min())
            text = (f"learning rate stuck at its peak: on {who} it rose to {value:.4g} over a {int(extra)}-step "
                    f"warmup, then stayed exactly there for {held} steps (step {int(step)}); expected only with a "
                    "constant or warmup-stable-decay schedule")
            return self._make(view, "lr_stuck", "lr_stuck:max", hit, text, severity="low",
                              evidence={"step": int(step), "lr": value, "warmup_steps": int(extra),
                                        "held_steps": held, "ranks": per_rank})
        text = (f"loss scale collapse: on {who} the fp16 loss scale is {value:.4g} at step {int(step)}, down from "
                f"{extra:.4g} ({extra / value if value > 0 else float('inf'):.3g}x): gradients keep overflowing "
                "and steps are being skipped")
        return self._make(view, "loss_scale_collapse", "loss_scale_collapse", hit, text,
                          severity="high" if value < cfg.scale_floor else "",
                          evidence={"step": int(step), "loss_scale": value, "reference": extra, "ranks": per_rank})

    @staticmethod
    def _make(view: TickView, kind: str, key: str, ranks: np.ndarray, text: str, *, severity: str = "",
              evidence: dict) -> Incident:
        """The incident of `kind`; `severity` "" is the kind's own (kinds.py), its runbook always is."""
        return Incident(kind=kind, culprit_ranks=ranks.tolist(), summary=text, severity=severity,
                        category=None, evidence=evidence, key=key, detected_mono=view.now)
