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
from trainwatch.watchdog.detectorconfig import LEARNT_PHASES
from trainwatch.watchdog.detectors.hang import HangDetector

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
    return _phases(path, _load(path))


def read_steady(path: Path) -> tuple[float, float, int] | None:
    """(step p99 s, longest step s, samples) of the job's steady threshold, or
    None: absent, or out of range (skipped; the job learns it again)."""
    return _steady(_load(path, quiet=True))


def _load(path: Path, *, quiet: bool = False) -> dict | None:
    """The file's object, or None (logged unless quiet) when it is unreadable
    or not a thresholds file of this version."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        if not quiet:
            log.warning("trainwatch: learnt hang thresholds skipped: cannot read %s (%s)", path, e.strerror or e)
        return None
    why = None
    data = None
    if len(raw) > _MAX_BYTES:
        why = "too large"
    else:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            why = "not JSON"
    if why is None and (not isinstance(data, dict) or state.nested_too_deep(data)):
        why = "not an object"
    elif why is None and (data.get("version") != VERSION or not state.is_int(data.get("version"))):
        why = "unknown version"
    if why is not None:
        if not quiet:
            _skip(path, why)
        return None
    return data


def _steady(data: dict | None) -> tuple[float, float, int] | None:
    entry = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(entry, dict):
        return None
    p99, longest = state.finite_number(entry.get("p99_s")), state.finite_number(entry.get("longest_s"))
    samples = entry.get("samples")
    if (p99 is None or longest is None or not state.is_int(samples) or not 0 < p99 <= MAX_SECONDS
            or not 0 <= longest <= MAX_SECONDS or not 0 < samples <= MAX_SAMPLES):
        return None
    return p99, longest, samples


def _phases(path: Path, data: dict | None) -> dict[str, tuple[float, int]]:
    if data is None:
        return {}
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


def write(path: Path, learnt: dict[str, tuple[float, int]], steady: tuple[float, float, int] | None = None) -> None:
    phases = {name: {"p99_s": round(value, 6), "samples": int(n)} for name, (value, n) in sorted(learnt.items())
              if math.isfinite(value) and value > 0}
    data: dict[str, Any] = {"version": VERSION, "updated": time.time(), "phases": phases}
    if steady is not None and all(math.isfinite(v) for v in steady[:2]):
        data["steps"] = {"p99_s": round(steady[0], 6), "longest_s": round(steady[1], 6), "samples": int(steady[2])}
    state.write_json_atomic(path, data)


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
        self._steady_saved: tuple[float, float, int] | None = None
        if self.detector is not None:
            data = _load(path)
            self._saved = _phases(path, data)
            self.detector.phases.seed(self._saved)
            self._steady_saved = _steady(data)
            if self._steady_saved is not None:
                self.detector.steady.seed(*self._steady_saved)

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
        steady = self.detector.steady.learnt()
        if not _changed(self._saved, learnt) and not _steady_changed(self._steady_saved, steady):
            return False
        try:
            write(self.path, learnt, steady)
        except OSError as e:
            if not self._failed:
                log.warning("trainwatch: cannot save learnt hang thresholds to %s (%s)", _shown(self.path),
                            e.strerror or e)
            self._failed = True
            return False
        self._saved, self._steady_saved, self._saved_at, self._failed = learnt, steady, self.clock(), False
        return True


def _steady_changed(old: tuple[float, float, int] | None, new: tuple[float, float, int] | None) -> bool:
    """A steady threshold now learnt, or its p99 or longest step moved by more than 1%."""
    if new is None:
        return False
    if old is None:
        return True
    return abs(new[0] - old[0]) > 0.01 * old[0] or abs(new[1] - old[1]) > 0.01 * max(old[1], 1e-9)


def _changed(old: dict[str, tuple[float, int]], new: dict[str, tuple[float, int]]) -> bool:
    """New phases, a length moved by more than 1%, or a sample count that grew by a tenth."""
    for name, (value, n) in new.items():
        if name not in old:
            return True
        v0, n0 = old[name]
        if abs(value - v0) > 0.01 * v0 or n > n0 * 1.1:
            return True
    return False
