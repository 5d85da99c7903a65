"""The detector plug-in interface and the per-rank bookkeeping detectors share.

A detector is pure logic over one tick's data: it reads a `TickView` (the slot
table of all live ranks, their node labels, the exits seen since the last tick
and the tick's monotonic time) and returns incidents. It may remember history
across ticks but never reads a clock: time comes only from `view.now`, so
tests drive it with made-up times and never sleep.

History lives in numpy arrays indexed by global rank, not in per-rank Python
objects: a 4096-rank tick must stay within a few milliseconds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.incident import Incident
from trainwatch.watchdog.rankexit import RankExit, rank_exit_from_line  # noqa: F401 (the sidecar reads exits.jsonl)

WAIT_CODES = np.array(sorted(slots.PHASE_CODES[p] for p in slots.WAIT_PHASES), dtype=np.int32)
SLOW_CODES = np.array(sorted(slots.PHASE_CODES[p] for p in slots.SLOW_PHASES), dtype=np.int32)


phase_name = slots.phase_name


@dataclass(slots=True)
class TickView:
    """Everything a detector sees in one tick."""

    now: float
    """CLOCK_MONOTONIC seconds of this tick (same clock as the slots' *_mono fields)."""
    table: np.ndarray
    """Live slot rows (pid > 0), dtype `slots.slot_dtype()`, possibly from several nodes."""
    nodes: list[str] = field(default_factory=list)
    """Node label of each row of `table` (same order)."""
    exits: list[RankExit] = field(default_factory=list)
    """Rank exits first observed since the previous tick."""
    proc_state: Callable[[int], str | None] | None = None
    """Optional probe of a pid's process state ('stopped', 'running', ...): asked only
    about culprits at incident time, so a stopped process is named as such."""
    steps: StepChanges | None = None
    """Which rows completed a step since the previous view, worked out once for every
    detector of an engine (DetectorEngine sets it); None: each detector's own tracker."""

    @classmethod
    def from_table(
        cls, now: float, table: np.ndarray, nodes: Sequence[str] | None = None, exits: Sequence[RankExit] = ()
    ) -> TickView:
        """Keep only written slots (pid > 0, rank >= 0) and their node labels."""
        live = (table["pid"] > 0) & (table["rank"] >= 0)
        labels = list(nodes) if nodes is not None else [""] * len(table)
        if len(labels) != len(table):
            raise ValueError(f"nodes must label every table row; got {len(labels)} labels for {len(table)} rows")
        idx = np.nonzero(live)[0]
        return cls(now=now, table=table[idx], nodes=[labels[i] for i in idx], exits=list(exits))


class Detector(ABC):
    """One fault detector. Register new ones in `trainwatch.watchdog.detectors`."""

    name: ClassVar[str] = ""
    busy: bool = False
    """Set by check(): something is developing that the next rounds must follow
    closely (a rank near its threshold, a state or a timer to confirm). While no
    detector is busy and nothing is open, the sidecar runs its rounds less often."""

    @abstractmethod
    def check(self, view: TickView) -> list[Incident]:
        """Return the faults present in this tick (empty list when healthy)."""

    def sample(self, view: TickView) -> None:
        """A tick without a round (the sidecar's quiet cadence): keep what the
        next round could no longer read, such as a per-step value the rank has
        overwritten by then. Never reports; most detectors need nothing here."""


# ---- per-rank state in rank-indexed arrays -----------------------------------------


def grow(arr: np.ndarray, size: int, fill) -> np.ndarray:
    """`arr` extended along axis 0 to at least `size` rows filled with `fill`.
    Doubles capacity so a job growing rank by rank does not copy every tick."""
    if len(arr) >= size:
        return arr
    new = np.full((max(size, 2 * len(arr)),) + arr.shape[1:], fill, dtype=arr.dtype)
    new[: len(arr)] = arr
    return new


@dataclass(frozen=True, slots=True)
class StepChanges:
    """StepTracker.update()'s answer for one view."""

    advanced: np.ndarray
    restarted: np.ndarray
    first: np.ndarray
    """Rows whose advance is the first step seen from that process."""


def step_changes(view: TickView, tracker: StepTracker) -> StepChanges:
    """The view's step changes: the engine's (worked out once per round for all
    its detectors, which all see every view), else `tracker`'s (a detector used
    on its own, as tests do)."""
    if view.steps is not None:
        return view.steps
    advanced, restarted = tracker.update(view.table)
    return StepChanges(advanced, restarted, tracker.first)


def phase_mask(codes: np.ndarray) -> np.ndarray:
    """A boolean table over phase codes, True at `codes` (for in_phases)."""
    mask = np.zeros(len(slots.PHASES), dtype=bool)
    mask[codes] = True
    return mask


def in_phases(phase: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Which of `phase` (slot phase codes) the mask marks; an unknown code is in none.
    What np.isin answers, without its sort: this runs every round."""
    known = (phase >= 0) & (phase < len(mask))
    return mask[np.where(known, phase, 0)] & known


class StepTracker:
    """Which rows completed a new step since the previous tick.

    A rank whose pid changed (restarted process) or whose step went backwards
    (resumed from a checkpoint) starts over: callers drop its history."""

    def __init__(self) -> None:
        self._step = np.zeros(0, dtype=np.int64)
        self._pid = np.zeros(0, dtype=np.int64)
        self.first = np.zeros(0, dtype=bool)
        """After update(): rows whose advance is the first step seen from that process."""

    def update(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(advanced, restarted) boolean masks aligned with the table rows."""
        ranks = table["rank"]
        if len(ranks) == 0:
            self.first = np.zeros(0, dtype=bool)
            return np.zeros(0, dtype=bool), np.zeros(0, dtype=bool)
        size = int(ranks.max()) + 1
        self._step = grow(self._step, size, 0)
        self._pid = grow(self._pid, size, 0)
        steps = table["step"]
        pids = table["pid"]
        prev = self._step[ranks]
        restarted = (self._pid[ranks] != pids) | (steps < prev)
        prev = np.where(restarted, 0, prev)
        # step 0 means "no step finished yet": it is never an advance.
        advanced = steps > prev
        self.first = advanced & (prev == 0)
        self._step[ranks] = steps
        self._pid[ranks] = pids
        return advanced, restarted


class ActivityTracker:
    """CPU and I/O rates per rank from the heartbeat samples (cpu_s, io_bytes),
    each over at least `window_s` of heartbeats, so one sampler round's jitter
    is not a rate. NaN until a rank has two samples that far apart."""

    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._t = np.zeros(0)
        self._cpu = np.zeros(0)
        self._io = np.zeros(0)
        self._pid = np.zeros(0, dtype=np.int64)
        self.cpu_rate = np.zeros(0)
        self.io_rate = np.zeros(0)

    def update(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cpu cores, io bytes/s) aligned with the table rows."""
        ranks = table["rank"]
        if len(ranks) == 0:
            return np.zeros(0), np.zeros(0)
        size = int(ranks.max()) + 1
        self._t = grow(self._t, size, 0.0)
        self._cpu = grow(self._cpu, size, np.nan)
        self._io = grow(self._io, size, np.nan)
        self._pid = grow(self._pid, size, 0)
        self.cpu_rate = grow(self.cpu_rate, size, np.nan)
        self.io_rate = grow(self.io_rate, size, np.nan)
        hb = table["heartbeat_mono"]
        cpu = table["cpu_s"]
        io = np.where(table["io_bytes"] >= 0, table["io_bytes"].astype(np.float64), np.nan)
        new = self._pid[ranks] != table["pid"]
        if new.any():
            r = ranks[new]
            self._pid[r] = table["pid"][new]
            self._t[r], self._cpu[r], self._io[r] = hb[new], cpu[new], io[new]
            self.cpu_rate[r] = self.io_rate[r] = np.nan
        dt = hb - self._t[ranks]
        due = ~new & (hb > 0) & (dt >= self.window_s)
        if due.any():
            r = ranks[due]
            self.cpu_rate[r] = (cpu[due] - self._cpu[r]) / dt[due]
            self.io_rate[r] = (io[due] - self._io[r]) / dt[due]
            self._t[r], self._cpu[r], self._io[r] = hb[due], cpu[due], io[due]
        return self.cpu_rate[ranks], self.io_rate[ranks]


class RankRing:
    """Last `depth` values per rank (NaN where not yet filled)."""

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"history depth must be >= 1; got {depth}")
        self.depth = depth
        self.buf = np.full((0, depth), np.nan)
        self.pos = np.zeros(0, dtype=np.int64)
        self.count = np.zeros(0, dtype=np.int64)

    def _ensure(self, ranks: np.ndarray) -> None:
        if len(ranks):
            size = int(ranks.max()) + 1
            if size > len(self.pos):
                self.buf = grow(self.buf, size, np.nan)
                self.pos = grow(self.pos, size, 0)
                self.count = grow(self.count, size, 0)

    def push(self, ranks: np.ndarray, values: np.ndarray) -> None:
        if len(ranks) == 0:
            return
        self._ensure(ranks)
        pos = self.pos[ranks]
        self.buf[ranks, pos] = values
        self.pos[ranks] = (pos + 1) % self.depth
        self.count[ranks] += 1

    def reset(self, ranks: np.ndarray) -> None:
        if len(ranks) == 0:
            return
        self._ensure(ranks)
        self.buf[ranks] = np.nan
        self.pos[ranks] = 0
        self.count[ranks] = 0

    def counts(self, ranks: np.ndarray) -> np.ndarray:
        """Number of values pushed per rank since its last reset."""
        self._ensure(ranks)
        return self.count[ranks]

    def window(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values (m, depth), number of filled values per row) for these ranks."""
        self._ensure(ranks)
        return self.buf[ranks], np.minimum(self.count[ranks], self.depth)


def row_quantile(values: np.ndarray, counts: np.ndarray, q: float) -> np.ndarray:
    """Per-row quantile (linear interpolation) of the first `counts` non-NaN
    values of each row; NaN for empty rows. Sorting pushes NaN to the end, so
    one sort serves rows of every fill level (np.nanquantile loops in Python)."""
    m = len(values)
    if m == 0:
        return np.zeros(0)
    s = np.sort(values, axis=1)
    counts = np.asarray(counts)
    pos = np.maximum(counts - 1, 0) * q
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(counts - 1, 0))
    rows = np.arange(m)
    frac = pos - lo
    out = s[rows, lo] * (1.0 - frac) + s[rows, hi] * frac
    return np.where(counts > 0, out, np.nan)


def median(values: np.ndarray) -> float:
    """float(np.median(values)) of a 1-D array, NaN in, NaN out, without numpy's
    overhead on the handful of values one node has (it runs every round)."""
    if len(values) > 64:
        return float(np.median(values))
    v = values.tolist()
    if not v or any(x != x for x in v):
        return math.nan
    v.sort()
    mid = len(v) // 2
    return float(v[mid]) if len(v) % 2 else (v[mid - 1] + v[mid]) / 2.0


def row_median(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return row_quantile(values, counts, 0.5)


def robust_spread(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(median, median absolute deviation) per row."""
    med = row_median(values, counts)
    mad = row_median(np.abs(values - med[:, None]), counts)
    return med, mad


def op_name(raw: bytes) -> str:
    return bytes(raw).rstrip(b"\0").decode("ascii", "replace")


# ---- learnt phase durations ------------------------------------------------------------

SAME_PHASE_TOLERANCE_S = 1.0
"""A phase start that moves by less than this without a change of phase is the
same stretch of the phase, not a new one: the multi-node aggregator rebases
each node's times with a fresh offset on every summary, so a phase start seen
there jitters by a fraction of a second. Stretches re-entered within this
interval are merged, which only makes a learnt duration longer (safer)."""
MAX_SAMPLES = 10**9


class PhaseLearner:
    """How long each phase lasts, learnt from phase changes in the slots.

    A rank's phase and phase start (`phase`, `phase_mono`) change when it
    enters a new phase; the stretch that ended lasted from its own start to
    the next one's. The sidecar samples, so a stretch it saw may contain
    short phases it missed in between: each observation is an upper bound of
    the phase's length, which can only make a learnt threshold more lenient.

    Per phase in `phases`, each rank keeps its last `depth` durations; the
    learnt value of a phase is the highest of the ranks' `quantile`s (agreed
    across every rank the detector sees: a node's, or the whole job's on the
    multi-node aggregator) and its sample count the most any rank observed.
    A process that restarted (new pid) starts no duration across the restart,
    but the durations learnt before it stay: the job is the same.

    `seed()` takes what an earlier sidecar of the job learnt (thresholds.json);
    it is used until the live observations reach `min_samples` on their own.
    """

    def __init__(self, phases: Sequence[str], depth: int, *, min_samples: int = 1, quantile: float = 0.99):
        self.names = tuple(phases)
        self.min_samples = min_samples
        self.quantile = quantile
        self._slot = np.full(len(slots.PHASES), -1, dtype=np.int64)
        for i, name in enumerate(self.names):
            self._slot[slots.PHASE_CODES[name]] = i
        self._rings = [RankRing(depth) for _ in self.names]
        self._q = [np.zeros(0) for _ in self.names]
        self._fresh = [np.zeros(0, dtype=bool) for _ in self.names]
        self._phase = np.zeros(0, dtype=np.int64)
        self._since = np.zeros(0)
        self._pid = np.zeros(0, dtype=np.int64)
        self.prior: dict[str, tuple[float, int]] = {}
        """{phase: (seconds, samples)} learnt by an earlier sidecar of the job."""

    def seed(self, learnt: dict[str, tuple[float, int]]) -> None:
        """Start from what an earlier sidecar learnt (phases not learnt here are ignored)."""
        self.prior = {name: value for name, value in learnt.items() if name in self.names}

    def update(self, table: np.ndarray) -> None:
        """Record the durations of the phase stretches that ended since the last tick."""
        ranks = table["rank"]
        if len(ranks) == 0:
            return
        size = int(ranks.max()) + 1
        self._phase = grow(self._phase, size, -1)
        self._since = grow(self._since, size, 0.0)
        self._pid = grow(self._pid, size, 0)
        phase = table["phase"].astype(np.int64)
        since = table["phase_mono"]
        pid = table["pid"]
        prev = self._since[ranks]
        moved = since - prev
        changed = (phase != self._phase[ranks]) | (moved > SAME_PHASE_TOLERANCE_S)
        ended = changed & (self._pid[ranks] == pid) & (prev > 0) & (moved > 0) & np.isfinite(moved)
        if ended.any():
            code = self._phase[ranks][ended]
            known = (code >= 0) & (code < len(self._slot))
            slot = np.where(known, self._slot[np.clip(code, 0, len(self._slot) - 1)], -1)
            r, d = ranks[ended], moved[ended]
            for i in np.unique(slot[slot >= 0]):
                sel = slot == i
                self._rings[i].push(r[sel], d[sel])
                self._fresh[i] = grow(self._fresh[i], size, False)
                self._fresh[i][r[sel]] = False
        # A stretch is restarted only when it ended (or the process changed), so
        # a start that jitters within the tolerance keeps its first value.
        reset = changed | (self._pid[ranks] != pid)
        rows = ranks[reset]
        self._phase[rows] = phase[reset]
        self._since[rows] = since[reset]
        self._pid[ranks] = pid

    def live(self, i: int) -> tuple[float, int]:
        """(highest per-rank quantile, most samples of one rank) of phase `names[i]` as observed here."""
        ring = self._rings[i]
        if len(ring.count) == 0 or ring.count.max() == 0:
            return math.nan, 0
        n = len(ring.count)
        self._q[i] = grow(self._q[i], n, math.nan)
        self._fresh[i] = grow(self._fresh[i], n, False)
        need = np.nonzero(~self._fresh[i][:n] & (ring.count > 0))[0]
        if len(need):
            values, counts = ring.window(need)
            self._q[i][need] = row_quantile(values, counts, self.quantile)
            self._fresh[i][need] = True
        seen = ring.count > 0
        return float(np.nanmax(self._q[i][:n][seen])), int(ring.count.max())

    def learnt(self) -> dict[str, tuple[float, int]]:
        """{phase: (seconds, samples)} for every phase observed here or before.
        Live observations replace the earlier sidecar's once they reach
        `min_samples` themselves; until then both count, and the longer wins."""
        out = {}
        for i, name in enumerate(self.names):
            value, n = self.live(i)
            prior = self.prior.get(name)
            if prior is not None and n < self.min_samples:
                value = prior[0] if n == 0 else max(prior[0], value)
                n = min(n + prior[1], MAX_SAMPLES)
            if n > 0:
                out[name] = (value, n)
        return out

    def limits(self, floor_s: float, factor: float) -> np.ndarray:
        """Per phase code: max(floor_s, factor x the learnt duration) where learnt
        from at least `min_samples` observations, else +inf (no learnt limit)."""
        out = np.full(len(slots.PHASES), np.inf)
        for name, (value, n) in self.learnt().items():
            if n >= self.min_samples and math.isfinite(value):
                out[slots.PHASE_CODES[name]] = max(floor_s, factor * value)
        return out
