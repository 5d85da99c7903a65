"""Kinds of work in a step: which completed steps were not training steps.

Kept apart from base.py so the detectors that time steps (hang, step time)
share one definition of "a step that contained other work".
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectors.base import grow, in_phases, phase_mask

OTHER_WORK_CODES = np.array(sorted(slots.PHASE_CODES[p] for p in ("checkpoint", "eval")), dtype=np.int32)
_OTHER_WORK = phase_mask(OTHER_WORK_CODES)
FORWARD_ONLY = -1
"""OtherWork.kind of a step whose other work was forward-only progress (a no_grad rollout, an evaluation
without an eval phase marker)."""


class OtherWork:
    """Which completed steps contained work other than a training step.

    A step that contained an evaluation pass, a checkpoint or an RL rollout
    lasts as long as that work, not as a training step: kept in the training
    step history it would set every threshold and baseline drawn from it to
    the length of the evaluation. A step counts as other work when the
    sidecar saw the rank in a checkpoint or eval phase during it, or saw
    forward-only progress that was not a batch fetch (a finished no_grad
    block: the slot's `batches` count did not move with it) more than
    max(late_s, late_factor x the rank's typical step) after the step began:
    a training step's own no_grad blocks (a metric, an EMA update) finish
    well within a typical step, a rollout does not. A slow batch fetch is
    training work (a data stall), never other work.

    `update()` returns, per row that completed a step, whether the steps it
    completed since the previous tick contained other work; `kind` holds
    what that work was (a phase code, or FORWARD_ONLY)."""

    def __init__(self, late_s: float = 1.0, late_factor: float = 3.0):
        self.late_s = late_s
        self.late_factor = late_factor
        self._flag = np.zeros(0, dtype=bool)
        self._code = np.zeros(0, dtype=np.int64)
        self._progress = np.zeros(0)
        self._active = np.zeros(0)
        self._batches = np.zeros(0, dtype=np.int64)
        self.kind = np.zeros(0, dtype=np.int64)
        """Per row after update(): what the other work of the completed step(s) was (valid where flagged)."""
        self.current = np.zeros(0, dtype=bool)
        """Per row after update(): the step in progress already contains other work."""

    def update(self, table: np.ndarray, advanced: np.ndarray, restarted: np.ndarray,
               typical: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        ranks = table["rank"]
        if len(ranks) == 0:
            self.kind = np.zeros(0, dtype=np.int64)
            self.current = np.zeros(0, dtype=bool)
            return np.zeros(0, dtype=bool)
        size = int(ranks.max()) + 1
        self._flag = grow(self._flag, size, False)
        self._code = grow(self._code, size, 0)
        self._progress = grow(self._progress, size, 0.0)
        self._active = grow(self._active, size, 0.0)
        self._batches = grow(self._batches, size, -1)
        if restarted.any():
            self._flag[ranks[restarted]] = False
        progress = table["progress_mono"]
        active = table["active_mono"]
        prev = np.where(restarted, progress, self._progress[ranks])
        # Forward-only progress late in a step: measured from the step's start
        # (the previous step's end), which for a row that just advanced is
        # the progress recorded before this tick.
        start = np.where(advanced, prev, progress)
        batches = table["batches"]
        no_grad = (active != self._active[ranks]) & (batches == self._batches[ranks])
        later = no_grad & (active > 0) & (start > 0) & (active - start > self.late_s)
        if later.any() and typical is not None and self.late_factor > 0:
            rows = np.nonzero(later)[0]
            usual = np.nan_to_num(typical(ranks[rows]), nan=0.0)
            later[rows] &= active[rows] - start[rows] > np.maximum(self.late_s, self.late_factor * usual)
        ended_late = later & advanced & (active <= progress)
        in_other = in_phases(table["phase"], _OTHER_WORK)
        flag = self._flag[ranks]
        code = self._code[ranks]
        done = advanced & (flag | ended_late)
        self.kind = np.where(flag, code, FORWARD_ONLY)
        # The current phase and forward-only progress after this tick's step
        # end belong to the step now in progress.
        cur = np.where(advanced, False, flag) | in_other | (later & ~advanced)
        newcode = np.where(in_other, table["phase"].astype(np.int64), np.where(flag & ~advanced, code, FORWARD_ONLY))
        self._flag[ranks] = cur
        self._code[ranks] = newcode
        self._progress[ranks] = progress
        self._active[ranks] = active
        self._batches[ranks] = batches
        self.current = cur
        return done
