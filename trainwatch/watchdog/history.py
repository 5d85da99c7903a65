"""Compact per-rank history of a job, kept by the sidecar for `trainwatch report`.

About once a second the sidecar appends one JSON line per node to
`jobs/<job>/history/<node>.jsonl`:

    {"t": <unix time>, "r": [[rank, step, loss, step_s, phase, age_s, ratio], ...]}

(COLUMNS names the fields; null where unknown). `step_s` is the mean step time
since the previous sample when the rank advanced, else its last step's time.

The file is bounded: past `max_bytes` the older three quarters are thinned to
every other sample and the file is rewritten atomically, so the whole job
stays covered, recent minutes at full resolution and older hours coarser.
Readers skip a torn last line, so a running job's history reads fine.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from trainwatch import slots

COLUMNS = ("rank", "step", "loss", "step_s", "phase", "age_s", "ratio")
SAMPLE_INTERVAL_S = 1.0
MAX_BYTES = 8 * 1024 * 1024
"""Per node. At 8 ranks a sample is ~0.5 KB: about 4 hours at full resolution."""
KEEP_RECENT = 0.25
"""Fraction of samples (the newest) that compaction never thins."""


def history_path(job_dir: Path, node: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node)[:100] or "node"
    return job_dir / "history" / f"{safe}.jsonl"


def _num(value: float, digits: int = 6) -> float | None:
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


class HistoryWriter:
    """Appends samples of the slot table; the sidecar calls maybe_sample()
    every tick and it writes at most one line per `interval_s`."""

    def __init__(self, path: Path, *, interval_s: float = SAMPLE_INTERVAL_S, max_bytes: int = MAX_BYTES,
                 clock=time.monotonic, wall=time.time):
        self.path = Path(path)
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.wall = wall
        self._last = -math.inf
        self._prev: dict[int, tuple[int, float]] = {}  # rank -> (step, progress_mono) at the last sample
        self._size: int | None = None

    def maybe_sample(self, table: Any, ratios: Callable[[], dict[int, float]] | None = None) -> bool:
        """Append a sample if one is due; `ratios` (the straggler detector's
        slowdown ratios) is only called when it is."""
        now = self.clock()
        if table is None or now - self._last < self.interval_s:
            return False
        self._last = now
        record = self.record(table, ratios() if ratios is not None else {})
        if record["r"]:
            self.append(record)
        return True

    def record(self, table: Any, ratios: dict[int, float]) -> dict:
        rows = []
        for row in table:
            if row["pid"] <= 0:
                continue
            rank, step, mono = int(row["rank"]), int(row["step"]), float(row["progress_mono"])
            step_s = _num(row["step_s"])
            prev = self._prev.get(rank)
            if prev is not None and step > prev[0] and mono > prev[1]:
                step_s = round((mono - prev[1]) / (step - prev[0]), 6)
            self._prev[rank] = (step, mono)
            code = int(row["phase"])
            ratio = ratios.get(rank)
            rows.append([
                rank, step, _num(row["loss"]), step_s,
                slots.PHASES[code] if 0 <= code < len(slots.PHASES) else "init",
                round(max(0.0, self.clock() - mono), 3) if mono > 0 else None,
                _num(ratio, 4) if ratio is not None else None,
            ])
        return {"t": round(self.wall(), 3), "r": rows}

    def append(self, record: dict) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self._size is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                self._size = self.path.stat().st_size
            except OSError:
                self._size = 0
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self._size += len(line)
        if self._size > self.max_bytes:
            self._size = compact(self.path)


def compact(path: Path, keep_recent: float = KEEP_RECENT) -> int:
    """Thin the older samples of a history file to every other one, atomically.
    Returns the new size."""
    lines = [line for line in path.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]
    cut = len(lines) - max(1, int(len(lines) * keep_recent))
    # Keep the very first sample, so the job's start stays on the plots.
    kept = lines[:cut][::2] + lines[cut:]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        data = b"".join(kept)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return len(data)


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
            if isinstance(record, dict) and isinstance(record.get("t"), (int, float)) and isinstance(record.get("r"), list):
                samples.append(record)
    samples.sort(key=lambda s: s["t"])
    return samples


def per_rank(samples: list[dict]) -> dict[int, dict[str, list]]:
    """Samples regrouped as one series per rank: {rank: {"t": [...], "step": [...], ...}}."""
    series: dict[int, dict[str, list]] = {}
    for sample in samples:
        for row in sample["r"]:
            if not isinstance(row, list) or len(row) != len(COLUMNS):
                continue
            s = series.setdefault(int(row[0]), {c: [] for c in ("t",) + COLUMNS[1:]})
            s["t"].append(sample["t"])
            for name, value in zip(COLUMNS[1:], row[1:]):
                s[name].append(value)
    return dict(sorted(series.items()))
