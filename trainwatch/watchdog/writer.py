"""The sidecar's writer thread: what the tick produced goes to disk here, so
detection never waits on a file.

At 4096 ranks a telemetry.json snapshot and a history sample take a few
hundred milliseconds each (decoding every rank, JSON, the write; seconds on a
busy or slow disk), against a tick due every 150 ms. The tick captures what a
write needs (the slot table it already copied, its clock, the detectors'
figures) and submits a job; this thread runs the jobs in order.

Coalescing and bounded: at most one job waits per key ("snapshot",
"history"). A newer job for a key replaces the waiting one, whose data is
older anyway, and is counted in `replaced`, so a disk that cannot keep up
costs resolution, never memory or the tick's period. The thread still
shares the interpreter's lock with the tick, so the sidecar spaces each kind
of write at least DUTY_FACTOR times its last duration apart (`spacing()`):
at tens of thousands of ranks the files are written less often, and
detection keeps most of the interpreter.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from trainwatch import rankrow, state
from trainwatch.watchdog.history import SAMPLE_INTERVAL_S

log = logging.getLogger("trainwatch.sidecar")

DUTY_FACTOR = 5.0
"""A kind of write waits at least this many times its last duration before the next."""


class BackgroundWriter:
    """One daemon thread running the latest job submitted under each key."""

    def __init__(self, name: str = "trainwatch-writer"):
        self._pending: dict[str, Callable[[], object]] = {}
        self._cond = threading.Condition()
        self._running: str | None = None
        self._closed = False
        self.replaced = 0
        """Jobs replaced by a newer one of their key before they ran."""
        self.done = 0
        """Jobs run (failed ones included: a failure is logged, the thread goes on)."""
        self.seconds: dict[str, float] = {}
        """How long the last job of each key took."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, job: Callable[[], object]) -> None:
        """Run `job` on the writer thread; it replaces a job of `key` still waiting."""
        with self._cond:
            if self._closed:
                return
            if key in self._pending:
                self.replaced += 1
                del self._pending[key]  # the newer one goes to the back of the queue
            self._pending[key] = job
            self._cond.notify_all()

    def pending(self, key: str) -> bool:
        """Whether a job of `key` waits or runs (the tick need not prepare another)."""
        with self._cond:
            return key in self._pending or self._running == key

    def spacing(self, key: str, interval_s: float) -> float:
        """The interval to keep between jobs of `key`: `interval_s`, or longer when
        its last job took more than 1/DUTY_FACTOR of that."""
        return max(interval_s, DUTY_FACTOR * self.seconds.get(key, 0.0))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted job has run; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> bool:
        """Run what waits, then stop the thread; False if it did not finish in time."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed and drained
                key = next(iter(self._pending))
                job = self._pending.pop(key)
                self._running = key
            started = time.monotonic()
            try:
                job()
            except Exception:  # a full disk costs a file, never the watchdog
                log.exception("trainwatch sidecar: writing %s failed", key)
            finally:
                with self._cond:
                    self.seconds[key] = time.monotonic() - started
                    self._running = None
                    self.done += 1
                    self._cond.notify_all()


class InlineWriter(BackgroundWriter):
    """Runs each job at once on the caller's thread: every submitted write is
    written (tests that count samples with an injected clock)."""

    def __init__(self) -> None:
        self.replaced, self.done, self.seconds = 0, 0, {}

    def submit(self, key: str, job: Callable[[], object]) -> None:
        job()
        self.done += 1

    def pending(self, key: str) -> bool:
        return False

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self, timeout_s: float = 30.0) -> bool:
        return True


# ---- what the sidecar writes ------------------------------------------------------------


def snapshot_job(sc: Any) -> Callable[[], None]:
    """What the sidecar's telemetry.json will say, captured now from its tick's
    state; the job returned decodes the ranks and writes the file, on any thread."""
    table, nodes, now = sc.last_table, list(sc.last_nodes), sc.clock()
    record: dict[str, Any] = {"node": sc.node, "time": time.time(), "ranks": [],
                              "hang_thresholds": sc.thresholds.describe(), "thresholds": sc.thresholds_in_force()}
    gpus = next((h.snapshot() for h in sc._hardware if hasattr(h, "snapshot")), None)
    if gpus is not None:
        record["gpus"] = gpus  # per-GPU utilisation and memory for `diagnose`
    sc.thresholds.maybe_save()  # a few phases, at most every 30 s: beside the detector state it reads
    goodput = sc.goodput_now() if hasattr(sc, "goodput_now") else None
    if goodput is not None:
        record["goodput"] = goodput.to_json()
    jobwide = sc.jobwide if sc.jobwide is not None and not sc.jobwide.store_failed else None
    path = sc.dir.telemetry_file

    pause = _pause_of(sc)

    def write() -> None:
        if table is not None:
            record["ranks"] = rankrow.rows_json(rankrow.decode(table, now, nodes, pause), pause)
        if jobwide is not None:
            try:
                record["job_ranks"] = jobwide.job_rows()
            except Exception:  # the store is gone: this node's ranks still count
                pass
        state.write_json_atomic(path, record, durable=False, pause=pause)

    return write


class TickGate:
    """The detection loop first: while a tick runs, the writer thread waits at
    its pause points (every few hundred rows it decodes or encodes). Both are
    Python threads of one process: a writer busy with thousands of ranks would
    otherwise hand the interpreter lock back to the tick only now and then,
    and a 20 ms tick took 300 ms of wall time at 4096 ranks."""

    MAX_PAUSE_S = 1.0
    """The writer never waits longer than this for one tick (a stuck tick must not stop the files)."""

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()

    @contextlib.contextmanager
    def ticking(self) -> Iterator[None]:
        self._idle.clear()
        try:
            yield
        finally:
            self._idle.set()

    def pause(self) -> None:
        """Called by the writer: returns at once unless a tick runs."""
        self._idle.wait(self.MAX_PAUSE_S)


def _pause_of(sc: Any) -> Callable[[], None] | None:
    gate = getattr(sc, "tick_gate", None)
    return gate.pause if gate is not None else None


def submit_writes(sc: Any, writer: BackgroundWriter, *, snapshot: bool, force: bool = False) -> None:
    """Hand the sidecar's history sample (when due) and snapshot (when asked) to
    the writer thread, with what they need captured now: the tick's table is
    never written to again (every read makes a new one)."""
    sc.history.interval_s = writer.spacing("history", SAMPLE_INTERVAL_S)
    now = sc.history.claim(force=force)
    if now is not None:
        table, nodes, ratios = sc.last_table, list(sc.last_nodes), sc.straggler_ratios()
        pause = _pause_of(sc)
        rows = (lambda: rankrow.decode(table, now, nodes, pause)) if table is not None else list
        writer.submit("history", lambda: sc.history.sample(rows, lambda: ratios, now, pause))
    if snapshot:
        writer.submit("snapshot", sc.snapshot_job())
