"""The sidecar's writer of a job's compact per-rank history, for `trainwatch report`.

About once a second it appends one sample line per node to the job's
history file (the format: trainwatch.historyfile).

The file is bounded: past `max_bytes` the older three quarters are thinned to
half as many samples, evenly over their time span, and the file is rewritten
atomically (tmp + rename), so the whole job stays covered at a coarser
resolution and the recent minutes at full resolution. Readers skip a torn
last line, so a running job's history reads fine.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Callable

from trainwatch import env, state
from trainwatch.rankrow import PAUSE_EVERY, RankRow

log = logging.getLogger("trainwatch.history")

SAMPLE_INTERVAL_S = 1.0
MAX_BYTES = 8 * 1024 * 1024
"""Per node. At 8 ranks a sample is ~0.3 KB (~50 µs to write): about 7 hours
at full resolution, then older samples thin out (see compact()). A compaction
(reading and rewriting the file, tens of ms) comes every ~3 hours at that rate."""
KEEP_RECENT = 0.25
"""Fraction of samples (the newest) that a compaction leaves untouched."""


def default_max_bytes() -> int:
    try:
        return max(4096, int(os.environ.get(env.HISTORY_MAX_BYTES, "")))
    except ValueError:
        return MAX_BYTES


def _num(value: float, digits: int = 6) -> float | None:
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


class HistoryWriter:
    """Appends samples of every rank, at most one line per `interval_s`; it
    never raises: a full disk costs the history, never the watchdog. The
    sidecar's tick claims a due sample (one clock read) and its writer thread
    decodes and appends it (trainwatch.watchdog.writer)."""

    def __init__(self, path: Path, *, interval_s: float = SAMPLE_INTERVAL_S, max_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.path = Path(path)
        self.interval_s = interval_s
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.clock = clock
        self.wall = wall
        self.samples = 0
        self.compactions = 0
        self._last = -math.inf
        # (rank, restart) -> (step, progress_mono) at the previous sample
        self._prev: dict[tuple[int, int], tuple[int, float]] = {}
        self._size: int | None = None
        self._warned = False

    def maybe_sample(self, rows: Callable[[], list[RankRow]], ratios: Callable[[], dict[int, float]] | None = None,
                     *, force: bool = False) -> bool:
        """Append a sample if one is due (or `force`: the sidecar's last round).
        `rows` (the sidecar's decoded ranks) and `ratios` (the straggler
        detector's slowdown ratios) are only called then."""
        now = self.claim(force=force)
        return now is not None and self.sample(rows, ratios, now)

    def claim(self, *, force: bool = False) -> float | None:
        """The time of the sample due now, marked as taken; None when none is due.
        The sidecar's tick claims; its writer thread then takes the sample."""
        now = self.clock()
        if not force and now - self._last < self.interval_s:
            return None
        self._last = now
        return now

    def sample(self, rows: Callable[[], list[RankRow]], ratios: Callable[[], dict[int, float]] | None,
               now: float, pause: Callable[[], object] | None = None) -> bool:
        """Append the sample claimed at `now`; never raises. pause: called now
        and then on the way (a writer thread giving way to the detection loop)."""
        try:
            record = self.record(rows(), ratios() if ratios is not None else {}, now, pause)
            if record["r"]:
                self.append(record, pause)
        except Exception as e:  # noqa: BLE001 - the watchdog loop must go on
            if not self._warned:
                self._warned = True
                log.warning("trainwatch: history sample to %s failed (%s); `trainwatch report` may miss data",
                            self.path, e)
            return False
        return True

    def record(self, rows: list[RankRow], ratios: dict[int, float], now: float | None = None,
               pause: Callable[[], object] | None = None) -> dict:
        """One sample of the ranks (RankRows decoded at `now`)."""
        now = self.clock() if now is None else now
        out = []
        for i, r in enumerate(rows):
            if pause is not None and i and not i % PAUSE_EVERY:
                pause()
            ratio = ratios.get(r.rank)
            ratio = _num(ratio, 4) if ratio is not None else None
            if r.step < 1:
                # No step of this worker generation yet: no step, loss or step
                # time to show (a restarted rank's fresh slot says step 0, not
                # its resume step).
                out.append([r.rank, None, None, None, r.phase, r.last_progress_s, ratio])
                continue
            mono = now - r.last_step_s  # when its last step completed
            step_s = _num(r.step_s) if r.step_s is not None else None
            prev = self._prev.get((r.rank, r.restart))
            if prev is not None and r.step > prev[0] and mono > prev[1]:
                step_s = round((mono - prev[1]) / (r.step - prev[0]), 6)
            self._prev[(r.rank, r.restart)] = (r.step, mono)
            out.append([r.rank, r.step, _num(r.loss) if r.loss is not None else None, step_s, r.phase,
                        r.last_progress_s, ratio])
        return {"t": round(self.wall(), 3), "r": out}

    def append(self, record: dict, pause: Callable[[], object] | None = None) -> None:
        line = (state.dumps_compact(record, pause=pause, allow_nan=False) + "\n").encode()
        if self._size is None:
            # The job directory is the launcher's (0700); only history/ is ours.
            self.path.parent.mkdir(mode=0o700, exist_ok=True)
            try:
                self._size = self.path.stat().st_size
            except OSError:
                self._size = 0
        # One O_APPEND write per line: a reader sees whole lines, or a torn last one.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self.samples += 1
        self._size += len(line)
        if self._size > self.max_bytes:
            self._size = compact(self.path)
            self.compactions += 1


_T_PREFIX = re.compile(rb'^\{"t":(-?[0-9.eE+-]+),')


def compact(path: Path, keep_recent: float = KEEP_RECENT) -> int:
    """Halve the older samples of a history file, atomically (tmp + rename);
    returns the new size (~5/8 of the old one).

    The newest `keep_recent` fraction is kept as is. The older part is thinned
    to half as many samples spread evenly over its time span (the first sample
    always stays): not "every other line", which, repeated at every
    compaction, would thin the job's oldest hours away exponentially. So after
    any number of compactions the whole job stays covered at an even, coarser
    resolution (8 ranks for a week: ~1000 samples a day), the recent hours at
    full resolution."""
    lines, times = [], []
    for line in Path(path).read_bytes().splitlines(keepends=True):
        m = _T_PREFIX.match(line)
        if line.endswith(b"\n") and m:  # a torn or garbled line is dropped
            try:
                times.append(float(m.group(1)))
            except ValueError:
                continue
            lines.append(line)
    cut = len(lines) - max(1, int(len(lines) * keep_recent))
    old = list(zip(times[:cut], lines[:cut]))
    target = max(1, len(old) // 2)
    spacing = (old[-1][0] - old[0][0]) / target if old else 0.0
    if spacing > 0:
        # Greedy: keep a sample once `spacing` has passed since the last kept
        # one; that keeps at most target + 1 of them.
        kept = [old[0]]
        for sample in old[1:]:
            if sample[0] - kept[-1][0] >= spacing:
                kept.append(sample)
    else:  # no time span to spread over (clock trouble): every other one
        kept = old[::2]
    data = b"".join(line for _, line in kept) + b"".join(lines[cut:])
    state.write_atomic(Path(path), data)  # a full disk leaves the old file, not a stray copy
    return len(data)
