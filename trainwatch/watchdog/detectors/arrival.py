"""Stragglers from collective arrival times: the rank every other rank waits for.

In a collective nobody can leave before the last rank has entered it, so a
rank that is slow for any reason (its own compute, its GPU, its input, an
unmodified script trainwatch knows nothing about) is the rank that *enters*
each collective last, and its peers wait for it inside the collective. Each
rank's sampler publishes, from PyTorch's flight recorder, when it arrived at
recent collectives of the default process group (slots `arrivals`: sequence
number and CLOCK_REALTIME ns, comparable across ranks and, with synchronised
clocks, across nodes). `arrival_source` says what "arrived" means: the time
the rank enqueued the collective (gloo; NCCL without timing) or the time the
collective started on the device (NCCL with TORCH_NCCL_ENABLE_TIMING=1).

Ranks are compared collective by collective, as straggler.py compares compute
time step by step: each rank's arrival at collective s against the median of
its peers' arrivals at the same s (leave-one-out). A slow node moves every
rank together and cancels out. The window is the newest `arrival_window`
collectives that most ranks published, up to the frontier nearly every rank
has published (each sampler runs on its own schedule: a collective a rank
has not published yet is not one it missed); one evaluation per new
frontier. A rank is a straggler when, over the collectives of the window it
has (at least `arrival_min_collectives`),

- its median lateness is at least `arrival_min_lateness_s`,
- it arrived last at `arrival_last_fraction` of them or more, and
- its median lateness is at least `z` robust standard deviations of the
  jitter (the ranks' median MAD of their lateness over the window),

for `persist` evaluations in a row spanning at least `persist_s` seconds.

What is compared, and what is not:

- Start-up collectives (DDP's parameter broadcast, a resume's agreement)
  happen while ranks still load data and weights at their own pace: only
  collectives after a rank's first completed step count (the seq at the end
  of that step, from the slot's step ring, or the newest arrival published
  by then).
- Ranks publish a deterministic subsample (multiples of a power-of-two
  stride), so ranks meet on common sequence numbers. Each rank's arrivals
  are kept by sequence number in a small hashed table (Fibonacci hashing,
  tagged entries: a stale entry is never read).
- Enqueue and start times do not mean the same thing: only ranks of the
  most common `arrival_source` are compared.
- A restarted process (new pid or restart generation), a step going
  backwards, a new process group (sequence numbers going backwards) or a
  change of source starts that rank over.

A straggler falls behind its own baseline too (peers.OwnBaseline): a rank
that is last by role at every collective since it started (a pipeline's
first stage reaching the end-of-step broadcast, a rank that logs alone) is
never reported for it; a rank that was on time and then slowed down is.

The victims are the ranks that arrived earlier than the culprit by at least
half its lateness: they waited for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectors.base import TickView, grow, median, row_median
from trainwatch.watchdog.detectors.peers import JITTER_SAMPLE, MAD_TO_SIGMA, OwnBaseline, StepTable, peer_median
from trainwatch.watchdog.incident import Incident, describe_ranks

_FIB = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: consecutive multiples spread evenly
_MAX_SEQ = 1 << 62
_MAD_FLOOR_S = 0.002
"""The jitter's MAD is floored at 2 ms: on a quiet node enqueue times agree to
microseconds, and a MAD of 0 would make any difference infinitely significant."""
_CANDIDATES = 64
"""Recent sequence numbers (published by a sample of the ranks) the window is chosen from."""
SOURCE_NAMES = {slots.ARRIVAL_ENQUEUED: "enqueued", slots.ARRIVAL_STARTED: "started"}


class ArrivalTable(StepTable):
    """Each rank's arrival times (s, CLOCK_REALTIME) by collective sequence
    number: column hash(seq) of `depth`, tagged with its seq. Published seqs
    are multiples of a power-of-two stride, which `seq % depth` would pile
    into a few columns; Fibonacci hashing spreads them."""

    def __init__(self, bits: int = 6):
        super().__init__(1 << bits)
        self._shift = np.uint64(64 - bits)

    def column(self, seqs: np.ndarray) -> np.ndarray:
        return ((seqs.astype(np.uint64) * _FIB) >> self._shift).astype(np.intp)


class ArrivalEvaluator:
    """The arrival-order half of the straggler detector (see the module doc).

    `config` is the detector's StragglerConfig (its arrival_* fields, z,
    persist and persist_s). After each `check`, `active` says whether arrivals
    judged at least two ranks (the detector then prefers this evidence) and
    `covered` which ranks they judged."""

    def __init__(self, config: Any):
        self.config = config
        self._table = ArrivalTable()
        self._pid = np.zeros(0, dtype=np.int64)
        self._gen = np.zeros(0, dtype=np.int64)
        self._src = np.zeros(0, dtype=np.int64)
        self._top = np.zeros(0, dtype=np.int64)  # highest seq published (restart detection)
        self._floor = np.zeros(0, dtype=np.int64)  # start-up collectives: seq <= floor; -1 not known yet
        self._streak = np.zeros(0, dtype=np.int64)
        self._late = np.zeros(0, dtype=bool)  # late at the last evaluation, baseline or not
        self._since = np.zeros(0)
        self._cand = np.zeros(0, dtype=np.int64)
        self._baseline = OwnBaseline()
        self._frontier = -1
        self._current: Incident | None = None
        self._taken = False  # arrivals taken between rounds, not evaluated yet
        self.active = False
        self.covered = np.zeros(0, dtype=np.int64)
        self.judgement: tuple[np.ndarray, ...] = ()
        """The last evaluation's (ranks, median lateness s, fraction last, z) of the judged ranks."""

    def slow(self, ranks: np.ndarray) -> np.ndarray:
        """Which of these ranks the last evaluation found late (reported or still persisting), or
        late by as much as their own baseline: arrivals that never saw a rank on time (it was slow
        before the flight recorder came up) do not clear what compute time says of it."""
        inside = (ranks >= 0) & (ranks < len(self._streak))
        at = np.where(inside, ranks, 0)
        return inside & ((self._streak[at] > 0) | self._late[at])

    def streaking(self) -> bool:
        """Whether some rank is late and building its streak."""
        return bool(self._streak.any())

    def confirming(self, ranks: np.ndarray) -> np.ndarray:
        """Which of these ranks the arrivals are persisting on (behind their own baseline): their
        own incident is coming. A rank late by role or since it started has no streak."""
        inside = (ranks >= 0) & (ranks < len(self._streak))
        return inside & (self._streak[np.where(inside, ranks, 0)] > 0)

    def _grow(self, size: int) -> None:
        self._pid = grow(self._pid, size, 0)
        self._gen = grow(self._gen, size, 0)
        self._src = grow(self._src, size, 0)
        self._top = grow(self._top, size, 0)
        self._floor = grow(self._floor, size, -1)
        self._streak = grow(self._streak, size, 0)
        self._late = grow(self._late, size, False)
        self._since = grow(self._since, size, 0.0)

    def _reset(self, ranks: np.ndarray) -> None:
        self._frontier = -1
        self._table.reset(ranks)
        self._top[ranks] = 0
        self._floor[ranks] = -1
        self._streak[ranks] = 0
        self._baseline.reset(ranks)

    def sample(self, view: TickView) -> None:
        """Between rounds: take the arrivals published since the last (the ring
        wraps); the next check() evaluates them."""
        if self._take(view, np.zeros(0, dtype=np.int64)):
            self._taken = True

    def check(self, view: TickView, restarted: np.ndarray,
              ratios: Callable[[], dict[int, float]] | None = None) -> Incident | None:
        """One tick. `restarted`: the ranks whose step went backwards or whose
        process changed (the compute path's StepTracker); `ratios`: the
        compute slowdown ratios, quoted in the evidence where known."""
        if not self._take(view, restarted) and not self._taken:
            return self._current if self.active else None
        self._taken = False
        t = view.table
        ranks = t["rank"].astype(np.int64)
        src = t["arrival_source"].astype(np.int64)
        publishing = (src == slots.ARRIVAL_ENQUEUED) | (src == slots.ARRIVAL_STARTED)
        # Compare ranks of the most common source only, once past their start-up.
        source = int(np.argmax(np.bincount(src[publishing], minlength=3)))
        judged = publishing & (src == source) & (self._floor[ranks] >= 0)
        if int(judged.sum()) < 2:
            self._current = self._inactive(ranks)
            return None
        # Up to where (nearly) every rank has published: a rank's sampler runs on
        # its own schedule, and a collective it has not published yet is not one
        # it missed. The 10th percentile, so a few silent ranks of a big job do
        # not hold the window back. One evaluation per new frontier, as the
        # compute path evaluates once per new step.
        tops = self._top[ranks[judged]]
        k = len(tops) // 10
        frontier = int(np.partition(tops, k)[k])
        if frontier == self._frontier:
            return self._current if self.active else None
        self._frontier = frontier
        self._current = self._evaluate(view, ranks, judged, frontier, SOURCE_NAMES.get(source, str(source)), ratios)
        return self._current

    def _take(self, view: TickView, restarted: np.ndarray) -> bool:
        """Put the arrivals published since the last take into the table; True
        when some rank published new ones (an evaluation is due)."""
        t = view.table
        src = t["arrival_source"].astype(np.int64)
        publishing = (src == slots.ARRIVAL_ENQUEUED) | (src == slots.ARRIVAL_STARTED)
        if len(t) == 0 or not publishing.any():
            self.active, self._current, self._taken = False, None, False
            self.covered = np.zeros(0, dtype=np.int64)
            return False
        ranks = t["rank"].astype(np.int64)
        self._grow(int(ranks.max()) + 1)
        arr = t["arrivals"]
        seqs, tns = np.ascontiguousarray(arr["seq"]), np.ascontiguousarray(arr["t_ns"])
        valid = (seqs > 0) & (seqs < _MAX_SEQ) & (tns > 0)
        if not publishing.all():
            valid &= publishing[:, None]
        top = np.where(valid, seqs, 0).max(axis=1)
        gen = t["restart"].astype(np.int64)
        fresh = ((self._pid[ranks] != t["pid"]) | (self._gen[ranks] != gen)
                 | (np.isin(ranks, restarted) if len(restarted) else False)
                 | (publishing & (self._src[ranks] != src) & (self._src[ranks] != 0))
                 | ((top > 0) & (top < self._top[ranks])))
        if fresh.any():
            self._reset(ranks[fresh])
            self._current = None  # judged again from the next evaluation
        self._pid[ranks], self._gen[ranks] = t["pid"], gen
        self._src[ranks] = np.where(publishing, src, self._src[ranks])
        # The start-up boundary, once per process: its first completed step.
        unknown = (self._floor[ranks] < 0) & (t["step"] >= 1) & publishing
        if unknown.any():
            ring = t["ring"][unknown]
            first = np.argmin(np.where(ring["step"] > 0, ring["step"], np.iinfo(np.int64).max), axis=1)
            ring_seq = ring["seq"][np.arange(len(first)), first]
            # Published before it: in the table already, never compared.
            self._floor[ranks[unknown]] = np.maximum(top[unknown], np.maximum(ring_seq, 0))
            self._top[ranks[unknown]] = np.maximum(top[unknown], self._top[ranks[unknown]])
        before = self._top[ranks]
        advanced = (top > before) & (self._floor[ranks] >= 0)
        if not advanced.any():
            return False
        self._top[ranks] = np.maximum(top, before)
        # Only entries newer than the rank's last: the older ones are in the table.
        newer = np.where(advanced, np.maximum(before, self._floor[ranks]), _MAX_SEQ)
        i, j = np.nonzero(valid & (seqs > newer[:, None]))
        self._table.put(ranks[i], seqs[i, j], tns[i, j] * 1e-9)
        # Candidate sequence numbers from a sample of the ranks that published:
        # in a synchronous job every rank passes through the same ones.
        rows = np.nonzero(advanced)[0]
        picked = np.zeros(len(t), dtype=bool)
        picked[rows[:: max(1, len(rows) // JITTER_SAMPLE)]] = True
        picked = picked[i]
        # Numbers beyond every rank's newest are an old process group's.
        cand = self._cand[self._cand <= int(self._top[ranks].max())]
        if len(i):
            cand = np.unique(np.concatenate([cand, seqs[i[picked], j[picked]]]))[-_CANDIDATES:]
        self._cand = cand
        return True

    def _inactive(self, ranks: np.ndarray) -> None:
        self.active = False
        self.covered = np.zeros(0, dtype=np.int64)
        self.judgement = ()
        self._streak[ranks] = 0
        self._late[ranks] = False

    def _evaluate(self, view: TickView, ranks: np.ndarray, judged: np.ndarray, frontier: int, source: str,
                  ratios: Callable[[], dict[int, float]] | None) -> Incident | None:
        cfg = self.config
        window = max(1, int(cfg.arrival_window))
        cols = self._cand[self._cand <= frontier][-3 * window:]
        # The collectives most ranks published (ranks subsampling with different
        # strides meet on the multiples of the larger one), the newest `window`;
        # in big jobs as a sample of the ranks sees them.
        rows = np.nonzero(judged)[0]
        sample = rows[:: max(1, len(rows) // JITTER_SAMPLE)]
        present = np.isfinite(self._table.matrix(ranks[sample], cols)).sum(axis=0)
        cols = cols[np.nonzero(present >= max(2, (int(present.max(initial=0)) + 1) // 2))[0][-window:]]
        m = self._table.matrix(ranks, cols)
        if not judged.all():
            m[~judged] = np.nan
        late = m - peer_median(m)
        counts = np.isfinite(late).sum(axis=1)
        ok = counts >= max(1, int(cfg.arrival_min_collectives))
        if int(ok.sum()) < 2:
            return self._inactive(ranks)
        self.active = True
        rows = np.nonzero(ok)[0]
        self.covered = ranks[rows]
        lat_all = row_median(late, counts)  # NaN for ranks without any
        lat = lat_all[ok]
        filled = np.where(np.isfinite(m), m, -np.inf)
        last = (filled == filled.max(axis=0)[None, :]) & np.isfinite(late)
        frac = last[ok].sum(axis=1) / counts[ok]
        every = max(1, len(rows) // JITTER_SAMPLE)
        spread = row_median(np.abs(late[rows[::every]] - lat[::every, None]), counts[rows[::every]])
        mad = max(median(spread), _MAD_FLOOR_S)
        z = MAD_TO_SIGMA * lat / mad
        r = ranks[rows]
        # Behind its own baseline too: a rank last by role (a pipeline's first
        # stage at the end-of-step broadcast) is where it always is.
        behind = lat - self._baseline.update(r, lat)
        late = (lat >= cfg.arrival_min_lateness_s) & (frac >= cfg.arrival_last_fraction) & (z >= cfg.z)
        self._late[ranks] = False
        self._late[r] = late
        slow = late & (behind >= cfg.arrival_min_lateness_s) & (MAD_TO_SIGMA * behind / mad >= cfg.z)
        self.judgement = (r, lat, frac, z)
        old = self._streak[r]
        self._streak[ranks] = 0  # a rank not judged this time loses its streak
        streak = np.where(slow, old + 1, 0)
        self._streak[r] = streak
        self._since[r] = np.where(slow & (old == 0), view.now, self._since[r])
        is_culprit = (streak >= cfg.persist) & (view.now - self._since[r] >= cfg.persist_s)
        if not is_culprit.any():
            return None
        culprits = r[is_culprit].tolist()
        c_lat, c_frac, c_n = lat[is_culprit], frac[is_culprit], counts[rows[is_culprit]]
        # Victims: the ranks that arrived earlier by at least half the culprits' lateness.
        waited = lat_all <= 0.5 * float(c_lat.min())  # NaN (not compared) is no victim
        waited[rows[is_culprit]] = False
        victims = ranks[waited].tolist()
        lead = int(np.argmax(c_lat))
        text = (f"straggler: {describe_ranks(culprits)} enters collectives last, {c_lat[lead]:.3f} s after its "
                f"peers (median over {int(c_n[lead])} collectives of the default group, last at "
                f"{c_frac[lead]:.0%} of them; {source} times)")
        if victims:
            text += f"; {describe_ranks(victims)} wait for it in collectives (victims)"
        evidence = {
            "source": "collective_arrival",
            "arrival_source": source,
            "lateness_s": {c: round(float(x), 6) for c, x in zip(culprits, c_lat)},
            "fraction_last": {c: round(float(x), 3) for c, x in zip(culprits, c_frac)},
            "collectives_compared": {c: int(x) for c, x in zip(culprits, c_n)},
            "jitter_mad_s": round(mad, 6),
            "z": {c: round(float(x), 2) for c, x in zip(culprits, z[is_culprit])},
            "baseline_lateness_s": {c: round(float(x), 6) for c, x in zip(culprits, (lat - behind)[is_culprit])},
            "slow_for_s": round(float(view.now - self._since[r[is_culprit]].min()), 3),
            "window_collectives": window,
            "seq": int(cols[-1]),
        }
        known = {c: v for c, v in (ratios() if ratios is not None else {}).items() if c in culprits}
        if known:
            # The compute path's view of the same ranks, where it has one.
            evidence["slowdown_ratio"] = max(known.values())
            evidence["ratios"] = known
        return Incident(kind="straggler", culprit_ranks=culprits, victims=victims, summary=text,
                        evidence=evidence, detected_mono=view.now)
