"""Learnt hang thresholds, kept in the job directory across restarts.

The hang detector learns how long each phase of the job lasts
(`trainwatch.watchdog.detectors.base.PhaseLearner`). A sidecar started again
for the same job (a relaunch, a requeue, a new sidecar after a crash) would
start cold and fall back to the fixed allowances for as long as it takes to
see every phase end `phase_min_samples` times again: for checkpoints, hours.
So the sidecar writes what it learnt to `jobs/<job>/thresholds.json`
(atomically, at most every SAVE_S and when it stops) and seeds the detector
from it when it starts:

    {"version": 1, "updated": 1700000000.0,
     "phases": {"checkpoint": {"p99_s": 1.2, "samples": 14}, ...}}

The file is read as untrusted: anything that is not that shape is skipped
with a logged warning (the job starts cold), never a traceback. A wrong
value can only tighten a phase down to the floor, for a rank that is not
visibly working, or leave the fixed allowance in force.

On a multi-node job the hang detector runs on the aggregator over every rank,
so what it learns is agreed across the job; the other nodes learn nothing and
write nothing.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainwatch import state
from trainwatch.watchdog.detectors.hang import LEARNT_PHASES, HangDetector

log = logging.getLogger("trainwatch.thresholds")

VERSION = 1
SAVE_S = 30.0
"""Least time between two writes of thresholds.json while the job runs (s)."""
MAX_SECONDS = 1e7
"""Longest phase length a file may state (s); beyond is junk."""
MAX_SAMPLES = 10**9
_MAX_BYTES = 1 << 20


def read(path: Path) -> dict[str, tuple[float, int]]:
    """{phase: (p99 seconds, samples)} from a thresholds file; {} (with a
    logged warning) for a file that is unreadable or of the wrong shape.
    Entries of unknown phases or with values out of range are skipped."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("trainwatch: learnt hang thresholds skipped: cannot read %s (%s)", path, e.strerror or e)
        return {}
    if len(raw) > _MAX_BYTES:
        return _skip(path, "too large")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return _skip(path, "not JSON")
    if not isinstance(data, dict) or state.nested_too_deep(data):
        return _skip(path, "not an object")
    if data.get("version") != VERSION or not state.is_int(data.get("version")):
        return _skip(path, "unknown version")
    phases = data.get("phases")
    if not isinstance(phases, dict):
        return _skip(path, "no phases")
    out: dict[str, tuple[float, int]] = {}
    dropped = 0
    for name, entry in phases.items():
        value = state.finite_number(entry.get("p99_s")) if isinstance(entry, dict) else None
        samples = entry.get("samples") if isinstance(entry, dict) else None
        if (name in LEARNT_PHASES and value is not None and 0 < value <= MAX_SECONDS and state.is_int(samples)
                and 0 < samples <= MAX_SAMPLES):
            out[name] = (value, samples)
        else:
            dropped += 1
    if dropped:
        log.warning("trainwatch: %d entr%s of %s skipped (unknown phase or value out of range)", dropped,
                    "y" if dropped == 1 else "ies", _shown(path))
    return out


def _skip(path: Path, why: str) -> dict:
    log.warning("trainwatch: learnt hang thresholds skipped: %s is %s; the job starts from the fixed thresholds",
                _shown(path), why)
    return {}


def _shown(path: Path) -> str:
    return repr(str(path))[1:-1]  # one line, whatever the name holds


def write(path: Path, learnt: dict[str, tuple[float, int]]) -> None:
    phases = {name: {"p99_s": round(value, 6), "samples": int(n)} for name, (value, n) in sorted(learnt.items())
              if math.isfinite(value) and value > 0}
    state.write_json_atomic(path, {"version": VERSION, "updated": time.time(), "phases": phases})


class Persisted:
    """The sidecar's link between the hang detector's learner and the job's
    thresholds.json: seeds it at start, saves it now and then, describes it."""

    def __init__(self, path: Path, detectors: list, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.clock = clock
        self.detector: HangDetector | None = next((d for d in detectors if isinstance(d, HangDetector)), None)
        self._saved: dict[str, tuple[float, int]] = {}
        self._saved_at = -math.inf
        self._failed = False
        if self.detector is not None:
            self._saved = read(path)
            self.detector.phases.seed(self._saved)

    def learnt(self) -> dict[str, tuple[float, int]]:
        return self.detector.phases.learnt() if self.detector is not None else {}

    def describe(self) -> dict[str, dict[str, Any]]:
        """Per phase: the learnt p99 length, its samples, and the threshold in
        force for a rank not visibly working (None: the fixed one, still learning)."""
        if self.detector is None:
            return {}
        cfg = self.detector.config
        out = {}
        for name, (value, n) in self.learnt().items():
            ready = n >= cfg.phase_min_samples and math.isfinite(value)
            out[name] = {"p99_s": round(value, 3), "samples": n,
                         "threshold_s": round(max(cfg.floor_s, cfg.phase_factor * value), 3) if ready else None}
        return out

    def maybe_save(self, *, force: bool = False) -> bool:
        """Write thresholds.json when what was learnt changed, at most every
        SAVE_S (force: whenever it changed). A failed write is logged once."""
        if self.detector is None or (not force and self.clock() - self._saved_at < SAVE_S):
            return False
        learnt = self.learnt()
        if not learnt or not _changed(self._saved, learnt):
            return False
        try:
            write(self.path, learnt)
        except OSError as e:
            if not self._failed:
                log.warning("trainwatch: cannot save learnt hang thresholds to %s (%s)", _shown(self.path),
                            e.strerror or e)
            self._failed = True
            return False
        self._saved, self._saved_at, self._failed = learnt, self.clock(), False
        return True


def _changed(old: dict[str, tuple[float, int]], new: dict[str, tuple[float, int]]) -> bool:
    """New phases, a length moved by more than 1%, or a sample count that grew by a tenth."""
    for name, (value, n) in new.items():
        if name not in old:
            return True
        v0, n0 = old[name]
        if abs(value - v0) > 0.01 * v0 or n > n0 * 1.1:
            return True
    return False
