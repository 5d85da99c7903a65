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
