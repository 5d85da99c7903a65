"""A steady job's own hang threshold: how soon a rank that stopped can be
called hung when the job's training steps are short and regular.

The fixed floor (`--hang-floor-s`, 5 s) is there for jobs nobody has seen
yet: slow or irregular steps, epoch starts, pauses without a phase marker.
A job whose every training step so far took about 100 ms has shown what it
does; a rank that sat still for 1.5 s there, while its peers wait on it in a
collective, is far outside anything the job did. So, once every rank has
completed `steady_min_steps` training steps, the job has a steady threshold:

    max(steady_floor_s, k x the job's step-time p99, 2 x its longest step)

where the p99 is the highest of the ranks' own p99s (agreed across the
ranks, on a multi-node job across every node: the detector runs on the
aggregator) and the longest step is every training step since the job
started, after each process's first two (so one slow step, an epoch start,
a pause under load, moves it for good). It is in force only while it is
under the floor. The hang detector holds to it only a rank outside any wait,
data fetch, slow phase (init, checkpoint, eval: a zero-code `torch.save` is
the checkpoint phase) or other work (an eval pass, a rollout), moving no I/O
(over the last STILL_WINDOW_S of its heartbeats), and only while some peer
already waits on it in a collective for longer than the threshold. A rank
spinning in Python is as hung as one asleep: in a job whose every step took
100 ms, 1.5 s of anything else while the others wait is not a step. A job
that is only slower, or busy with nobody waiting, keeps every allowance.

What was learnt (the p99, the longest step, the sample count) is kept in the
job's thresholds.json, so a restarted job is back to its steady threshold
after `SEEDED_MIN_STEPS` steps on every rank instead of `steady_min_steps`.
"""

from __future__ import annotations

import math

import numpy as np

from trainwatch.watchdog.detectors.base import ActivityTracker, RankRing, row_quantile

SEEDED_MIN_STEPS = 3
"""Training steps every rank needs, after a restart, to use a steady threshold seeded from thresholds.json."""
LONGEST_FACTOR = 2.0
"""A rank is never called hung sooner than this many times the job's longest training step (factor)."""
MIN_TIMED = 8
"""Step times (one per detector tick that saw a rank step) every rank needs for its p99 (count)."""
WARM_STEPS = 2
"""Training steps of each process left out of the longest step (its first is never timed)."""
REFRESH_S = 1.0
"""Least time between two computations of the job's p99 (s): healthy ticks never sort."""
STILL_WINDOW_S = 0.5
"""The I/O rate that tells a rank writing (a checkpoint) is taken over this much of its heartbeats (s):
the hang detector's own 2 s window would keep a rank that wrote until it hung "working" for seconds."""


class SteadyJob:
    """The job's steady hang threshold, recomputed at most every REFRESH_S."""

    def __init__(self, *, floor_s: float, steady_floor_s: float, k: float, min_steps: int):
        self.floor_s = floor_s
        self.steady_floor_s = steady_floor_s
        self.k = k
        self.min_steps = min_steps
        self.enabled = 0 < steady_floor_s < floor_s
        self.longest = 0.0
        """Longest training step seen past each process's warm-up (s): never falls."""
        self.p99 = math.nan
        """The job's step-time p99 at the last computation (s)."""
        self.samples = 0
        self._seed: tuple[float, float, int] | None = None
        self._value = math.inf
        self._at = -math.inf
        self.activity = ActivityTracker(window_s=STILL_WINDOW_S)
        self._first = np.zeros(0, dtype=np.int64)
        """Per rank: its step when its process was first seen (-1: not yet)."""

    def not_writing(self, table: np.ndarray, hb_stale: np.ndarray, active_io: float) -> np.ndarray:
        """Rows whose process moved no I/O worth the name over the last
        STILL_WINDOW_S (or whose heartbeat stopped), aligned with the table."""
        _, io = self.activity.update(table)
        return hb_stale | ~(io >= active_io)

    def seed(self, p99_s: float, longest_s: float, samples: int) -> None:
        """What a previous sidecar of the job learnt (thresholds.json)."""
        if self.enabled and p99_s > 0 and longest_s >= 0 and samples > 0:
            self._seed = (p99_s, longest_s, samples)
            self.longest = max(self.longest, longest_s)

    def observe(self, counts_before: np.ndarray, values: np.ndarray) -> None:
        """Training step times just pushed, with each rank's count of pushed
        steps before them: the warm-up steps do not move the longest step."""
        keep = values[counts_before >= WARM_STEPS - 1]
        if len(keep) and float(keep.max()) > self.longest:
            self.longest = float(keep.max())
            self._at = -math.inf

    def reset(self, ranks: np.ndarray) -> None:
        """These ranks restarted (a new process, or a step back): their history
        is gone; their steps count from here; recompute at the next call."""
        if len(ranks) and len(self._first):
            self._first[ranks[ranks < len(self._first)]] = -1
        self._at = -math.inf

    def steps_done(self, ranks: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Training steps each rank completed since its process was first seen
        (a tick may see several: the step history holds one time per tick)."""
        if len(ranks) and int(ranks.max()) >= len(self._first):
            self._first = np.concatenate([self._first, np.full(int(ranks.max()) + 1 - len(self._first), -1)])
        new = self._first[ranks] < 0
        self._first[ranks[new]] = steps[new]
        return steps - self._first[ranks]

    def threshold(self, now: float, ring: RankRing, ranks: np.ndarray, steps: np.ndarray) -> float:
        """Seconds without progress after which a rank its peers wait on is
        hung, or inf while the job is not (yet) steady."""
        if not self.enabled or len(ranks) == 0:
            return math.inf
        done = self.steps_done(ranks, steps)
        if now - self._at < REFRESH_S:
            return self._value
        self._at = now
        self._value = math.inf
        need = SEEDED_MIN_STEPS if self._seed is not None else self.min_steps
        counts = ring.counts(ranks)
        if done.min() < need or counts.min() < min(need, MIN_TIMED):
            return math.inf
        values, n = ring.window(ranks)
        p99 = float(np.nanmax(row_quantile(values, n, 0.99)))
        self.samples = int(counts.sum())
        if self._seed is not None and done.min() < self.min_steps:
            p99 = max(p99, self._seed[0])
        self.p99 = p99
        value = max(self.steady_floor_s, self.k * p99, LONGEST_FACTOR * self.longest)
        if value < self.floor_s:
            self._value = value
        return self._value

    @property
    def value(self) -> float:
        """The threshold at the last computation (inf: none in force)."""
        return self._value

    def learnt(self) -> tuple[float, float, int] | None:
        """(p99, longest, samples) worth keeping, or None."""
        if not self.enabled or not math.isfinite(self.p99) or self.samples <= 0:
            return self._seed
        return self.p99, self.longest, self.samples
