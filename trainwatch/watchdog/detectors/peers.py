"""Comparing each rank with its peers: what both straggler evidences share
(compute time per step in straggler.py, collective arrival times in arrival.py).

Kept apart from both so neither imports the other's module.
"""

from __future__ import annotations

import numpy as np

from trainwatch.watchdog.detectors.base import grow

MAD_TO_SIGMA = 0.6745
"""Multiplying a MAD by 1 / 0.6745 makes it a standard-deviation estimate for normal data."""
JITTER_SAMPLE = 256
"""Ranks whose spread (MAD over the window) is computed to estimate the jitter
in big jobs: the median of 256 is as good an estimate as of 4096."""


def peer_median(m: np.ndarray) -> np.ndarray:
    """Per entry of a (ranks, steps) matrix: the median of the other ranks' values
    in the same column (NaN values are absent; NaN where fewer than one peer).

    Leave-one-out from one partial sort per column: the median of the k peers
    sorted r[0..k-1] is (r[(k-1)//2] + r[k//2]) / 2, and the peers' i-th value
    is the column's i-th if the entry's own value sorts above it, else the
    (i+1)-th (with ties either gives the same value)."""
    n_rows, n_cols = m.shape
    if n_rows == 0 or n_cols == 0:
        return np.full(m.shape, np.nan)
    present = np.isfinite(m)
    peers = present.sum(axis=0) - 1  # values left once the entry's own is removed
    picks = (np.maximum(peers - 1, 0) // 2, np.maximum(peers, 0) // 2)
    # Only these order statistics are read: a partition (NaN last, as in a
    # sort) per step, linear in the ranks where a sort is not.
    kth = np.unique(np.concatenate([np.minimum(i + d, n_rows - 1) for i in picks for d in (0, 1)]))
    s = np.partition(m.T, kth, axis=1)
    cols = np.arange(n_cols)
    ref = np.zeros(m.shape)
    both = np.array_equal(*picks)  # an odd number of peers: one middle value
    for i in picks[:1] if both else picks:
        here = s[cols, i]
        above = s[cols, np.minimum(i + 1, n_rows - 1)]
        ref += (1.0 if both else 0.5) * np.where(m <= here[None, :], above[None, :], here[None, :])
    return np.where(present & (peers >= 1)[None, :], ref, np.nan)


class StepTable:
    """Each rank's values by an integer key (a step number, a collective's
    sequence number), the last `depth` keys: entry `column(key)`, tagged with
    its key so a stale entry is never read."""

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"history depth must be >= 1; got {depth}")
        self.depth = depth
        self.value = np.full((0, depth), np.nan)
        self.step = np.zeros((0, depth), dtype=np.int64)

    def column(self, keys: np.ndarray) -> np.ndarray:
        return keys % self.depth

    def _ensure(self, size: int) -> None:
        if size > len(self.value):
            self.value = grow(self.value, size, np.nan)
            self.step = grow(self.step, size, 0)

    def put(self, ranks: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        if len(ranks):
            self._ensure(int(ranks.max()) + 1)
            col = self.column(keys)
            self.value[ranks, col] = values
            self.step[ranks, col] = keys

    def reset(self, ranks: np.ndarray) -> None:
        if len(ranks):
            self._ensure(int(ranks.max()) + 1)
            self.value[ranks] = np.nan
            self.step[ranks] = 0

    def matrix(self, ranks: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """(len(ranks), len(keys)) values, NaN where a rank has none for that key."""
        self._ensure(int(ranks.max()) + 1 if len(ranks) else 0)
        at = (ranks[:, None], self.column(keys)[None, :])
        return np.where(self.step[at] == keys[None, :], self.value[at], np.nan)


class OwnBaseline:
    """Each rank's own usual standing against its peers: the lowest window
    median of its excess (extra compute, lateness at collectives) seen since
    the rank (re)started.

    A straggler is a rank that falls behind its own baseline. Some ranks are
    behind by role, every step of the job: the first stage of a pipeline
    reaches the end-of-step broadcast last, a rank that logs or evaluates
    alone computes more. Their window median starts where it stays, so their
    baseline is their role and they are never reported for it; a rank that
    was on time and then slows down keeps the low baseline it showed before.
    The lowest value, not an average, so a straggler that persists never
    becomes its own baseline."""

    def __init__(self) -> None:
        self._low = np.zeros(0)

    def reset(self, ranks: np.ndarray) -> None:
        self._low = grow(self._low, int(ranks.max()) + 1 if len(ranks) else 0, np.inf)
        self._low[ranks] = np.inf

    def update(self, ranks: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Take this evaluation's window medians; the baseline per rank (this one included)."""
        if len(ranks) == 0:
            return np.zeros(0)
        self._low = grow(self._low, int(ranks.max()) + 1, np.inf)
        finite = np.isfinite(values)
        self._low[ranks[finite]] = np.minimum(self._low[ranks[finite]], values[finite])
        low = self._low[ranks]
        return np.where(np.isfinite(low), low, 0.0)
