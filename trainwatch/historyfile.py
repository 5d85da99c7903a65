"""The history file format: one JSON line per sample, per node.

    {"t": <unix time>, "r": [[rank, step, loss, step_s, phase, age_s, ratio], ...]}

(COLUMNS names the fields; null where unknown, e.g. step, loss and step time
before a rank's first step). `step_s` is the mean step time since the previous
sample when the rank advanced (Δ progress time / Δ step), else its last step's
time; `age_s` is the time since its last progress; `ratio` the straggler
detector's compute slowdown vs the group median.

The sidecar writes it (trainwatch.watchdog.history); `trainwatch report` reads
it through the job directory (state.JobDir.read_history). The writer bounds
each file (watchdog.history.compact); readers skip torn and garbled lines, so a running job's history
reads fine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

COLUMNS = ("rank", "step", "loss", "step_s", "phase", "age_s", "ratio")


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
            except (ValueError, RecursionError):
                continue
            if (isinstance(record, dict) and _number(record.get("t")) is not None
                    and isinstance(record.get("r"), list)):
                samples.append(record)
    samples.sort(key=lambda s: s["t"])
    return samples


MAX_LINE_BYTES = 4 << 20
"""A history line longer than this (about 60,000 ranks) is junk, skipped unparsed."""
POINT_BUDGET = 4_000_000
"""Rank rows kept in memory by read_thinned over every file (each a few small objects)."""


def read_thinned(paths: Iterable[Path], limit: int) -> tuple[int, list[dict]]:
    """(samples in the files, at most about 2 * `limit` of them per file, evenly
    spread, oldest first): one pass, streaming, memory bounded whatever the
    files hold. Only the lines kept are parsed (every stride-th; the stride
    doubles as the file grows), so the time is linear in the bytes read."""
    paths = list(paths)
    budget = max(16, POINT_BUDGET // max(1, len(paths)))
    total, kept_all = 0, []
    for path in paths:
        try:
            f = open(path, "rb")
        except OSError:
            continue
        with f:
            n, kept = _thin_file(f, limit, budget)
        total += n
        kept_all += kept
    kept_all.sort(key=lambda s: s["t"])
    return total, kept_all


def _thin_file(f, limit: int, budget: int) -> tuple[int, list[dict]]:
    stride, cap = 1, max(2, limit)
    kept: list[tuple[int, dict]] = []
    n = 0
    for line in _bounded_lines(f):
        if not line.strip():
            continue
        i = n
        n += 1
        if i % stride:
            continue
        sample = _sample(line)
        if sample is None:
            continue
        # A wide job keeps fewer samples, so the rows kept stay within the budget.
        cap = max(2, min(limit, budget // max(1, len(sample["r"]))))
        kept.append((i, sample))
        while len(kept) > 2 * cap:
            stride *= 2
            kept = [(j, s) for j, s in kept if j % stride == 0]
    return n, [s for _j, s in kept]


def _bounded_lines(f):
    """The file's lines; one longer than MAX_LINE_BYTES is skipped without being held."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while True:
                rest = f.readline(MAX_LINE_BYTES)
                if not rest or rest.endswith(b"\n"):
                    break
            continue
        yield line


def _sample(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if isinstance(record, dict) and _number(record.get("t")) is not None and isinstance(record.get("r"), list):
        return record
    return None


def _number(value: Any) -> int | float | None:
    """A finite JSON number as it is; None for anything else (true, NaN, 1e999, a string)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:  # an integer too large for a float
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# How each column is read: a value of the wrong type reads as unknown (null).
_READERS = {"step": _int, "loss": _number, "step_s": _number, "phase": _text, "age_s": _number, "ratio": _number}


def per_rank(samples: list[dict]) -> dict[int, dict[str, list]]:
    """Samples regrouped as one series per rank, sorted by rank:
    {rank: {"t": [...], "step": [...], "loss": [...], ...}} (COLUMNS without "rank")."""
    series: dict[int, dict[str, list]] = {}
    for sample in samples:
        for row in sample["r"]:
            if not isinstance(row, list) or len(row) != len(COLUMNS) or _int(row[0]) is None:
                continue
            s = series.setdefault(row[0], {c: [] for c in ("t",) + COLUMNS[1:]})
            s["t"].append(sample["t"])
            for name, value in zip(COLUMNS[1:], row[1:]):
                s[name].append(_READERS[name](value))
    return dict(sorted(series.items()))
