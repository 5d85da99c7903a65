"""Compact per-rank history of a job, kept by the sidecar for `trainwatch report`.

About once a second the sidecar appends one JSON line per node to
`jobs/<job>/history/<node>.jsonl`:

    {"t": <unix time>, "r": [[rank, step, loss, step_s, phase, age_s, ratio], ...]}

(COLUMNS names the fields; null where unknown, e.g. step, loss and step time
before a rank's first step). `step_s` is the mean step time since the previous
sample when the rank advanced (Δ progress time / Δ step), else its last step's
time; `age_s` is the time since its last progress; `ratio` the straggler
detector's compute slowdown vs the group median.

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
from typing import Any, Callable, Iterable

from trainwatch import slots, state

log = logging.getLogger("trainwatch.history")

COLUMNS = ("rank", "step", "loss", "step_s", "phase", "age_s", "ratio")
SAMPLE_INTERVAL_S = 1.0
MAX_BYTES = 8 * 1024 * 1024
"""Per node. At 8 ranks a sample is ~0.3 KB (~50 µs to write): about 7 hours
at full resolution, then older samples thin out (see compact()). A compaction
(reading and rewriting the file, tens of ms) comes every ~3 hours at that rate."""
MAX_BYTES_ENV = "TRAINWATCH_HISTORY_MAX_BYTES"
KEEP_RECENT = 0.25
"""Fraction of samples (the newest) that a compaction leaves untouched."""


def history_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "history"


def history_path(job_dir: Path, node: str) -> Path:
    """One file per node; a hostname never escapes the directory."""
    return history_dir(job_dir) / f"{state.safe_filename(node)}.jsonl"


def default_max_bytes() -> int:
    try:
        return max(4096, int(os.environ.get(MAX_BYTES_ENV, "")))
    except ValueError:
        return MAX_BYTES


def _num(value: float, digits: int = 6) -> float | None:
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


class HistoryWriter:
    """Appends samples of the slot table. The sidecar calls maybe_sample()
    every tick; it costs one clock read unless a sample is due (at most one
    line per `interval_s`), and it never raises: a full disk costs the
    history, never the watchdog."""

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

    def maybe_sample(self, table: Any, ratios: Callable[[], dict[int, float]] | None = None, *,
                     force: bool = False) -> bool:
        """Append a sample if one is due (or `force`: the sidecar's last round).
        `ratios` (the straggler detector's slowdown ratios) is only called then."""
        now = self.clock()
        if table is None or (not force and now - self._last < self.interval_s):
            return False
        self._last = now
        try:
            record = self.record(table, ratios() if ratios is not None else {}, now)
            if record["r"]:
                self.append(record)
        except Exception as e:  # noqa: BLE001 - the watchdog loop must go on
            if not self._warned:
                self._warned = True
                log.warning("trainwatch: history sample to %s failed (%s); `trainwatch report` may miss data",
                            self.path, e)
            return False
        return True

    def record(self, table: Any, ratios: dict[int, float], now: float | None = None) -> dict:
        """One sample of the live rows of a slot table."""
        now = self.clock() if now is None else now
        rows = []
        for row in table:
            if row["pid"] <= 0:
                continue
            rank, step, restart = int(row["rank"]), int(row["step"]), int(row["restart"])
            mono = float(row["progress_mono"])
            phase = slots.phase_name(row["phase"])
            ratio = ratios.get(rank)
            ratio = _num(ratio, 4) if ratio is not None else None
            progress = max(mono, float(row["active_mono"]))  # a batch or an eval forward is progress too
            age = round(max(0.0, now - progress), 3) if progress > 0 else None
            # progress_mono equals start_mono until the first step of this
            # worker generation ends: no step, loss or step time to show yet
            # (a restarted rank's fresh slot says step 0, not its resume step).
            if step < 1 or mono <= float(row["start_mono"]):
                rows.append([rank, None, None, None, phase, age, ratio])
                continue
            step_s = _num(row["step_s"])
            prev = self._prev.get((rank, restart))
            if prev is not None and step > prev[0] and mono > prev[1]:
                step_s = round((mono - prev[1]) / (step - prev[0]), 6)
            self._prev[(rank, restart)] = (step, mono)
            rows.append([rank, step, _num(row["loss"]), step_s, phase, age, ratio])
        return {"t": round(self.wall(), 3), "r": rows}

    def append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
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


# ---- reading ----------------------------------------------------------------------


def read_samples(paths: Iterable[Path]) -> list[dict]:
    """Every readable sample of the given history files, oldest first. A torn
    or garbled line (a running writer, a crash mid-write) is skipped."""
    samples = []
    for path in paths:
        try:
            data = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for line in data.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if (isinstance(record, dict) and isinstance(record.get("t"), (int, float))
                    and isinstance(record.get("r"), list)):
                samples.append(record)
    samples.sort(key=lambda s: s["t"])
    return samples


def per_rank(samples: list[dict]) -> dict[int, dict[str, list]]:
    """Samples regrouped as one series per rank, sorted by rank:
    {rank: {"t": [...], "step": [...], "loss": [...], ...}} (COLUMNS without "rank")."""
    series: dict[int, dict[str, list]] = {}
    for sample in samples:
        for row in sample["r"]:
            if not isinstance(row, list) or len(row) != len(COLUMNS) or not isinstance(row[0], int):
                continue
            s = series.setdefault(row[0], {c: [] for c in ("t",) + COLUMNS[1:]})
            s["t"].append(sample["t"])
            for name, value in zip(COLUMNS[1:], row[1:]):
                s[name].append(value)
    return dict(sorted(series.items()))


def read_history(job_dir: Path) -> tuple[int, dict[int, dict[str, list]]]:
    """All nodes' history of a job: (number of samples, per-rank series)."""
    samples = read_samples(sorted(history_dir(job_dir).glob("*.jsonl")))
    return len(samples), per_rank(samples)
