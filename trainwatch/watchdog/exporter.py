"""Prometheus exporter: a Collector that reads current state at scrape time.

Nothing is pushed per step: a scrape decodes the sidecar's last read of the
slot table into metric families, so a job that is never scraped pays nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Protocol
from wsgiref.simple_server import make_server

import numpy as np
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler
from prometheus_client.registry import Collector

from trainwatch import kinds, slots
from trainwatch.diagnostics import preemption
from trainwatch.diagnostics.goodput import CAUSES
from trainwatch.rankrow import RankRow
from trainwatch.watchdog import aggregates
from trainwatch.watchdog.aggregates import JOB_LABEL

IDLE_TIMEOUT_S = 10.0
"""A scraper connection that sends nothing for this long is closed: idle or
half-open connections never pile up threads in the exporter."""
LISTEN_BACKLOG = 256
"""Connections the kernel queues while every handler is busy (Python's default is 5)."""

INCIDENT_KINDS = tuple(kinds.KINDS)
"""Every incident kind: their counters exist from 0."""

# Step-duration buckets (seconds): from fast GPU steps to multi-minute ones.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class StepHistogram:
    """Cumulative per-rank histogram of step durations, fed from the slot table
    by the sidecar (no per-step work in ranks). Every step counts once: when a
    rank finished several steps between two reads, each is observed at their
    mean duration (the progress time they spanned over their number), so
    `_count` is the number of steps and `_sum` the time they took."""

    def __init__(self, buckets: tuple[float, ...] = STEP_BUCKETS):
        self.buckets = buckets
        self._bounds = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros((0, len(buckets) + 1), dtype=np.int64)
        """Per rank, steps per bucket (not cumulative; the last column is above every bound)."""
        self.sums = np.zeros(0)
        self._step = np.zeros(0, dtype=np.int64)
        self._pid = np.zeros(0, dtype=np.int64)
        self._progress = np.zeros(0)

    def observe(self, table) -> None:
        ranks = table["rank"]
        if len(ranks) == 0:
            return
        size = int(ranks.max()) + 1
        if size > len(self.sums):
            grow_to = max(size, 2 * len(self.sums))
            self.counts = np.vstack([self.counts, np.zeros((grow_to - len(self.counts), self.counts.shape[1]),
                                                           dtype=np.int64)])
            for name, fill in (("sums", 0.0), ("_step", 0), ("_pid", 0), ("_progress", 0.0)):
                old = getattr(self, name)
                new = np.full(grow_to, fill, dtype=old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)
        step, pid, progress = table["step"], table["pid"], table["progress_mono"]
        same = self._pid[ranks] == pid
        n = np.where(same, step - self._step[ranks], 0)
        gap = progress - self._progress[ranks]
        mean = np.where(n == 1, table["step_s"], gap / np.maximum(n, 1))
        ok = same & (n >= 1) & np.isfinite(mean) & (mean >= 0)
        if ok.any():
            r = ranks[ok]
            idx = np.searchsorted(self._bounds, mean[ok], side="left")
            np.add.at(self.counts, (r, idx), n[ok])
            np.add.at(self.sums, r, mean[ok] * n[ok])
        self._step[ranks], self._pid[ranks], self._progress[ranks] = step, pid, progress

    def node_series(self) -> tuple[list[int], float]:
        """Cumulative bucket counts (incl. +Inf) and sum over every rank: one histogram per node."""
        if not len(self.counts):
            return [0] * (len(self.buckets) + 1), 0.0
        return np.cumsum(self.counts.sum(axis=0)).tolist(), float(self.sums.sum())

    def series(self):
        """(rank, cumulative bucket counts incl. +Inf, sum) for every rank seen,
        from 0 before its first step, so increase() counts that step too."""
        for rank in np.nonzero((self._pid > 0) | (self.counts.sum(axis=1) > 0))[0].tolist():
            yield rank, np.cumsum(self.counts[rank]).tolist(), float(self.sums[rank])


class Source(Protocol):
    """What the exporter reads at scrape time (the sidecar)."""

    job: str
    node: str
    step_hist: StepHistogram
    incident_counts: dict[str, int]

    last_table: object
    """The last read of the slot table (None before the first)."""

    def clock(self) -> float: ...
    def rows(self) -> list[RankRow]: ...
    def open_incidents(self) -> list[dict]: ...
    def straggler_ratios(self) -> dict[int, float]: ...
    def restarts(self) -> int: ...
    def hardware_metrics(self) -> Iterator: ...


class TrainwatchCollector(Collector):
    def __init__(self, sidecar: Source):
        self.sidecar = sidecar

    def collect(self) -> Iterator:
        sc = self.sidecar
        job, node = sc.job, sc.node
        config = getattr(sc, "config", None)
        detail = getattr(config, "metrics_detail", "rank")
        # Aggregates from the last read's columns; rows are decoded only for the
        # per-rank series (a node's few ranks).
        table = getattr(sc, "last_table", None)
        if table is None:
            table = np.zeros(0, dtype=slots.slot_dtype())
        values = aggregates.table_values(table, sc.clock(), sc.straggler_ratios(), _loss_slopes(sc))
        if detail == "rank":
            yield from aggregates.rank_families(sc.rows(), values, job)
        if detail in ("rank", "node"):
            labels = {JOB_LABEL: job, "node": node}
            yield from aggregates.stat_families("node", labels, values)
            yield from aggregates.table_collectives("node", labels, table)
            ranks = GaugeMetricFamily("trainwatch_node_ranks", "Ranks of this node reporting.",
                                      labels=[JOB_LABEL, "node"])
            ranks.add_metric([job, node], float(len(values["step"][0])))
            yield ranks
        jobwide = getattr(sc, "jobwide", None)
        if jobwide is None:  # a single-node job: this node is the job
            yield from aggregates.stat_families("job", {JOB_LABEL: job}, values)
            yield from aggregates.table_collectives("job", {JOB_LABEL: job}, table)
        phases = getattr(sc, "phase_clock", None)
        if phases is not None:
            yield phases.family(job, node)

        hist = HistogramMetricFamily("trainwatch_step_duration_seconds", "Training step duration, every step of "
                                     "the node's ranks.", labels=[JOB_LABEL, "node"])
        h = sc.step_hist
        cumulative, total = h.node_series()
        if len(h.sums):  # from 0 once a rank was seen, so increase() counts the first step too
            buckets = [(str(b), float(c)) for b, c in zip(h.buckets, cumulative)] + [("+Inf", float(cumulative[-1]))]
            hist.add_metric([job, node], buckets, total)
        yield hist

        incidents = CounterMetricFamily(
            "trainwatch_incidents", "Incidents raised, by kind.", labels=[JOB_LABEL, "node", "kind"]
        )
        # Every known kind starts at 0, so increase() counts the first incident too.
        counts = dict.fromkeys(INCIDENT_KINDS, 0) | sc.incident_counts
        for kind, n in sorted(counts.items()):
            incidents.add_metric([job, node, kind], float(n))
        yield incidents
        yield from _open_incidents(job, sc)
        restarts = CounterMetricFamily("trainwatch_restarts", "Worker group restarts.", labels=[JOB_LABEL, "node"])
        restarts.add_metric([job, node], float(sc.restarts()))
        yield restarts
        yield _preempted(job, sc)
        yield from _goodput(job, sc)
        yield from sc.hardware_metrics()
        job_metrics = getattr(sc, "job_metrics", None)
        if job_metrics is not None:
            yield from job_metrics()


def _preempted(job: str, sc: Source) -> GaugeMetricFamily:
    """1 while the job is preempted (the launcher got the signal and wrote its
    checkpoint), by signal and whether the checkpoint was saved; 0 otherwise."""
    family = GaugeMetricFamily("trainwatch_preempted", "The job was preempted: 1 from the launcher's checkpoint "
                               "for a preemption signal until the next run.",
                               labels=[JOB_LABEL, "node", "signal", "checkpoint"])
    p = preemption.of_job({"preempted": getattr(sc, "preempted", lambda: None)()})
    if p is None:
        family.add_metric([job, sc.node, "", ""], 0.0)
    else:
        family.add_metric([job, sc.node, p.signal, "saved" if p.saved else "not_saved"], 1.0)
    return family


def _open_incidents(job: str, sc: Source) -> Iterator:
    """Open incidents by kind and severity (0 for every kind at its usual
    severity), and how long the oldest of each kind has been open: the alert
    rules page on these, so a fault pages once however long it lasts, and stops
    when it is resolved."""
    opened = GaugeMetricFamily("trainwatch_incident_open", "Incidents open now (detected, not yet resolved), by kind "
                               "and severity.", labels=[JOB_LABEL, "node", "kind", "severity"])
    age = GaugeMetricFamily("trainwatch_incident_open_age_seconds", "How long the oldest open incident of each kind "
                            "has been open (s).", labels=[JOB_LABEL, "node", "kind"])
    counts = {(k.name, k.severity): 0 for k in kinds.KINDS.values()}
    oldest: dict[str, float] = {}
    now = time.time()
    for incident in getattr(sc, "open_incidents", lambda: [])():
        kind, severity = incident.kind, incident.severity
        counts[(kind, severity)] = counts.get((kind, severity), 0) + 1
        if incident.opened_time is not None:
            oldest[kind] = max(oldest.get(kind, 0.0), now - incident.opened_time)
    for (kind, severity), n in sorted(counts.items()):
        opened.add_metric([job, sc.node, kind, severity], float(n))
    for kind, seconds in sorted(oldest.items()):
        age.add_metric([job, sc.node, kind], max(0.0, seconds))
    yield opened
    yield age


def _goodput(job: str, sc: Source) -> Iterator:
    """The job's goodput and its badput by cause (every cause from 0), from the
    node that counts it: the only node, or a multi-node job's aggregator."""
    account = getattr(sc, "goodput_now", lambda: None)()
    if account is None:
        return
    ratio = GaugeMetricFamily("trainwatch_goodput_ratio", "Productive training time over wall time since the job "
                              "started (0-1).", labels=[JOB_LABEL, "node"])
    ratio.add_metric([job, sc.node], account.ratio)
    badput = CounterMetricFamily("trainwatch_badput_seconds", "Wall time lost, by cause (startup, detection, "
                                 "capture_checkpoint, restart, recompute, hung).", labels=[JOB_LABEL, "node", "cause"])
    for cause in CAUSES:
        badput.add_metric([job, sc.node, cause], account.badput_s.get(cause, 0.0))
    yield ratio
    yield badput


def _loss_slopes(sc: Source) -> dict[int, float]:
    """{rank: loss trend slope} from the source's loss trend detector, where it runs one."""
    engine = getattr(sc, "engine", None)
    det = engine.detector("loss_trend") if engine is not None else None
    return det.current_slopes() if det is not None else {}


class _Handler(_SilentHandler):
    timeout = IDLE_TIMEOUT_S

    def handle(self):
        try:
            super().handle()
        except TimeoutError:  # idle past the timeout (a port scan, a stuck scraper)
            self.server.dropped("idle")
        except OSError:  # reset or closed by the peer mid-request
            self.server.dropped("reset")

    def send_error(self, code, message=None, explain=None):
        self.server.dropped("malformed")  # not HTTP, a line too long, a method we do not serve
        super().send_error(code, message, explain)


class _DroppedConnections(Collector):
    """Connections the exporter closed without serving them, by reason."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, reason: str) -> None:
        with self.lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1

    def collect(self):
        c = CounterMetricFamily("trainwatch_exporter_dropped_connections",
                                "Connections the exporter closed without serving (idle, malformed, reset).",
                                labels=["reason"])
        for reason in ("idle", "malformed", "reset", "error"):
            c.add_metric([reason], float(self.counts.get(reason, 0)))
        yield c


def serve_metrics(collector: Collector, host: str, port: int):
    """/metrics on host:port (loopback unless told otherwise), each connection on
    its own daemon thread, with an idle timeout and a deep listen backlog."""

    dropped = _DroppedConnections()

    class Server(ThreadingWSGIServer):
        request_queue_size = LISTEN_BACKLOG

        def dropped(self, reason: str) -> None:
            dropped.add(reason)

        def handle_error(self, request, client_address):  # counted, never a traceback in the job's log
            dropped.add("error")

    Server.address_family, addr = _get_best_family(host, port)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    registry.register(dropped)
    server = make_server(addr, port, make_wsgi_app(registry), Server, handler_class=_Handler)
    threading.Thread(target=server.serve_forever, name="trainwatch-exporter", daemon=True).start()
    return server
