"""Prometheus exporter: a Collector that reads current state at scrape time.

Nothing is pushed per step: a scrape copies the slot table (a memcpy) and turns
it into metric families, so a job that is never scraped pays nothing.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from trainwatch import slots

if TYPE_CHECKING:
    from trainwatch.watchdog.sidecar import Sidecar

INCIDENT_KINDS = ("hang", "collective_mismatch", "straggler", "crash", "loss_nan", "loss_spike",
                  "grad_explosion", "xid", "ecc", "restart")

# Step-duration buckets (seconds): from fast GPU steps to multi-minute ones.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class StepHistogram:
    """Cumulative per-rank histogram of step durations, fed by the sidecar each
    time it sees a rank's step advance (so it needs no per-step work in ranks)."""

    def __init__(self, buckets: tuple[float, ...] = STEP_BUCKETS):
        self.buckets = buckets
        self.counts: dict[tuple[str, int], list[int]] = {}
        self.sums: dict[tuple[str, int], float] = {}

    def observe(self, node: str, rank: int, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        key = (node, rank)
        counts = self.counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        self.sums[key] = self.sums.get(key, 0.0) + value


class TrainwatchCollector(Collector):
    def __init__(self, sidecar: "Sidecar"):
        self.sidecar = sidecar

    def collect(self) -> Iterator:
        sc = self.sidecar
        job = sc.job
        labels = ["job", "node", "rank"]
        table = sc.last_table
        now = time.monotonic()
        step = GaugeMetricFamily("trainwatch_step", "Last completed training step.", labels=labels)
        loss = GaugeMetricFamily("trainwatch_loss", "Loss reported at the last step.", labels=labels)
        grad = GaugeMetricFamily("trainwatch_grad_norm", "Gradient norm reported at the last step.", labels=labels)
        age = GaugeMetricFamily(
            "trainwatch_last_progress_age_seconds", "Seconds since the rank last completed a step.", labels=labels
        )
        phase = GaugeMetricFamily(
            "trainwatch_phase", "Current phase of the rank (1 for the active phase).", labels=labels + ["phase"]
        )
        seq = GaugeMetricFamily(
            "trainwatch_collective_seq",
            "Last collective sequence number per process group.",
            labels=labels + ["pg", "state"],
        )
        hb = GaugeMetricFamily(
            "trainwatch_heartbeat_age_seconds",
            "Seconds since the rank's background thread last ran (stale: GIL held or process stopped).",
            labels=labels,
        )
        ratio = GaugeMetricFamily(
            "trainwatch_straggler_slowdown_ratio",
            "Rank compute time over the group median (1.0 = typical).",
            labels=labels,
        )
        ratios = sc.straggler_ratios()
        if table is not None:
            for row, node in zip(table, sc.last_nodes):
                if row["pid"] <= 0:
                    continue
                lv = [job, node, str(int(row["rank"]))]
                step.add_metric(lv, float(row["step"]))
                if math.isfinite(row["loss"]):
                    loss.add_metric(lv, float(row["loss"]))
                if math.isfinite(row["grad_norm"]):
                    grad.add_metric(lv, float(row["grad_norm"]))
                age.add_metric(lv, max(0.0, now - float(row["progress_mono"])))
                if row["heartbeat_mono"] > 0:
                    hb.add_metric(lv, max(0.0, now - float(row["heartbeat_mono"])))
                code = int(row["phase"])
                if 0 <= code < len(slots.PHASES):
                    phase.add_metric(lv + [slots.PHASES[code]], 1.0)
                for g in row["groups"][: max(0, min(int(row["ngroups"]), slots.MAX_GROUPS))]:
                    seq.add_metric(lv + [str(int(g["pg"])), "enqueued"], float(g["enqueued"]))
                    seq.add_metric(lv + [str(int(g["pg"])), "completed"], float(g["completed"]))
                r = ratios.get(int(row["rank"]))
                if r is not None and math.isfinite(r):
                    ratio.add_metric(lv, r)
        yield from (step, loss, grad, age, phase, seq, hb, ratio)

        hist = HistogramMetricFamily(
            "trainwatch_step_duration_seconds", "Training step duration.", labels=labels
        )
        h = sc.step_hist
        for (node, rank), counts in sorted(h.counts.items()):
            buckets = [(str(b), float(c)) for b, c in zip(h.buckets, counts)] + [("+Inf", float(counts[-1]))]
            hist.add_metric([job, node, str(rank)], buckets, h.sums[(node, rank)])
        yield hist

        incidents = CounterMetricFamily(
            "trainwatch_incidents", "Incidents raised, by kind.", labels=["job", "node", "kind"]
        )
        # Every known kind starts at 0, so increase() counts the first incident too.
        counts = dict.fromkeys(INCIDENT_KINDS, 0) | sc.incident_counts
        for kind, n in sorted(counts.items()):
            incidents.add_metric([job, sc.node, kind], float(n))
        yield incidents
        restarts = CounterMetricFamily("trainwatch_restarts", "Worker group restarts.", labels=["job", "node"])
        restarts.add_metric([job, sc.node], float(sc.restarts()))
        yield restarts
        yield from sc.hardware_metrics()
