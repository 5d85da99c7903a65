"""Bounded metrics: what a scrape says about many ranks without one series per
rank for everything.

A 4096-rank job with ~30 series per rank is 130k series and megabytes per
scrape. So only what a person drills into is per rank (step, last-progress
age, step time, loss, straggler ratio: RANK_SIGNALS); every signal is also a
node aggregate (`trainwatch_node_<signal>{stat="min|median|p99|max"}`, plus
the worst rank's number in `trainwatch_node_worst_rank{signal}`) and a job
aggregate (`trainwatch_job_<signal>{stat}`, `trainwatch_job_worst_rank`) from
the job-wide aggregator, or from the node itself in a single-node job. How
much a node exports is `--metrics-detail`:

  rank  per-rank drill-down series, node aggregates, job aggregates (default)
  node  node and job aggregates
  job   job aggregates (and the counters and GPU series every level has)

Every level has the incident and restart counters, the time per phase
(`trainwatch_phase_seconds_total`, every phase always present) and the GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainwatch import rankrow, slots
from trainwatch.rankrow import RankRow

JOB_LABEL = "trainwatch_job"
"""The job's name as a label: `job` is Prometheus' own (the scrape job), so trainwatch never sets it."""
STATS = ("min", "median", "p99", "max")


@dataclass(frozen=True, slots=True)
class Signal:
    """One per-rank signal and how it is exported."""

    name: str
    """Its name in the `signal` label of the worst-rank series."""
    metric: str
    """The metric name after the `trainwatch_`, `trainwatch_node_` or `trainwatch_job_` prefix."""
    help: str
    worst: str
    """Which end is the worst rank's: "max" (an age, a loss) or "min" (a step, a loss scale)."""


SIGNALS = (
    Signal("step", "step", "Last completed training step.", "min"),
    Signal("last_progress_age", "last_progress_age_seconds",
           "Seconds since the rank last made progress (a step, a batch, an evaluation forward).", "max"),
    Signal("step_time", "step_time_seconds", "Duration of the rank's last step (s).", "max"),
    Signal("loss", "loss", "Loss reported at the last step.", "max"),
    Signal("straggler_ratio", "straggler_slowdown_ratio", "Rank compute time over the group median (1.0 = typical).",
           "max"),
    Signal("grad_norm", "grad_norm", "Gradient norm reported at the last step.", "max"),
    Signal("heartbeat_age", "heartbeat_age_seconds",
           "Seconds since the rank's background thread last ran (stale: GIL held or process stopped).", "max"),
    Signal("learning_rate", "learning_rate", "Learning rate of the optimizer's first param group at the last step.",
           "max"),
    Signal("loss_scale", "loss_scale", "Mixed-precision loss scale (GradScaler) after the last step.", "min"),
    Signal("zero_grad_fraction", "zero_grad_fraction", "Fraction of gradient elements exactly zero at the last step.",
           "max"),
    Signal("loss_trend_slope", "loss_trend_slope",
           "Robust (Theil-Sen) slope of the loss over the trend window, loss units per step (above 0: rising).", "max"),
)
RANK_SIGNALS = ("step", "last_progress_age", "step_time", "loss", "straggler_ratio")
"""The per-rank drill-down series (`--metrics-detail rank`)."""


def table_values(table, now: float, ratios: dict[int, float], slopes: dict[int, float]) -> dict[str, tuple]:
    """signal name -> (ranks, finite values), straight from a slot table's
    columns: the job-wide aggregator computes them at every scrape over
    thousands of ranks, so no row is decoded."""
    live = table[table["pid"] > 0] if len(table) else table
    ranks = live["rank"].astype(np.int64)
    step = live["step"]

    def pairs(values, keep=None):
        values = np.asarray(values, dtype=float)
        ok = np.isfinite(values) if keep is None else np.isfinite(values) & keep
        return ranks[ok], values[ok]

    def mapped(d: dict[int, float]):
        return pairs(np.array([d.get(int(r), np.nan) for r in ranks.tolist()]) if d else np.full(len(ranks), np.nan))

    heartbeat = live["heartbeat_mono"]
    return {
        "step": pairs(step),
        "last_progress_age": pairs(np.maximum(0.0, now - rankrow.progress_mono(live))),
        "step_time": pairs(live["step_s"], step >= 1),
        "loss": pairs(live["loss"]),
        "straggler_ratio": mapped(ratios),
        "grad_norm": pairs(live["grad_norm"]),
        "heartbeat_age": pairs(np.maximum(0.0, now - heartbeat), heartbeat > 0),
        "learning_rate": pairs(live["lr"]),
        "loss_scale": pairs(live["loss_scale"]),
        "zero_grad_fraction": pairs(live["zero_grad_frac"]),
        "loss_trend_slope": mapped(slopes),
    }


def table_collectives(scope: str, labels: dict[str, str], table) -> Iterator:
    """Per process group, the lowest and highest sequence number the ranks
    enqueued and completed: the skew is max - min, a rank behind shows as min."""
    names, lv = list(labels), list(labels.values())
    family = GaugeMetricFamily(f"trainwatch_{scope}_collective_seq", f"Collective sequence numbers over the "
                               f"{scope}'s ranks, per process group (min: the rank furthest behind).",
                               labels=names + ["pg", "state", "stat"])
    live = table[table["pid"] > 0] if len(table) else table
    if len(live):
        groups, ngroups = live["groups"], np.clip(live["ngroups"], 0, slots.MAX_GROUPS)
        used = np.arange(slots.MAX_GROUPS)[None, :] < ngroups[:, None]
        pgs = groups["pg"][used]
        for state in ("enqueued", "completed"):
            seqs = groups[state][used]
            for pg in np.unique(pgs).tolist():
                mine = seqs[pgs == pg]
                family.add_metric(lv + [str(pg), state, "min"], float(mine.min()))
                family.add_metric(lv + [str(pg), state, "max"], float(mine.max()))
    yield family


def rank_families(rows: list[RankRow], values: dict[str, tuple], job: str) -> Iterator:
    """The per-rank drill-down series."""
    node_of = {r.rank: r.node for r in rows}
    for signal in SIGNALS:
        if signal.name not in RANK_SIGNALS:
            continue
        family = GaugeMetricFamily("trainwatch_" + signal.metric, signal.help, labels=[JOB_LABEL, "node", "rank"])
        ranks, vals = values[signal.name]
        for rank, value in zip(ranks.tolist(), vals.tolist()):
            family.add_metric([job, node_of[rank], str(rank)], value)
        yield family


def stat_families(scope: str, labels: dict[str, str], values: dict[str, tuple]) -> Iterator:
    """`trainwatch_<scope>_<signal>{stat}` for every signal some rank reports,
    and `trainwatch_<scope>_worst_rank{signal}`: bounded by the signals, not the ranks."""
    names, lv = list(labels), list(labels.values())
    worst = GaugeMetricFamily(f"trainwatch_{scope}_worst_rank", f"Rank number of the {scope}'s worst rank per "
                              "signal (the highest age, loss, ratio; the lowest step, loss scale).",
                              labels=names + ["signal"])
    for signal in SIGNALS:
        ranks, vals = values[signal.name]
        if not len(vals):
            continue
        family = GaugeMetricFamily(f"trainwatch_{scope}_{signal.metric}",
                                   f"{signal.help.rstrip('.')}: over the {scope}'s ranks, by statistic.",
                                   labels=names + ["stat"])
        for stat, value in zip(STATS, (vals.min(), np.median(vals), np.quantile(vals, 0.99), vals.max())):
            family.add_metric(lv + [stat], float(value))
        yield family
        at = int(np.argmax(vals) if signal.worst == "max" else np.argmin(vals))
        worst.add_metric(lv + [signal.name], float(ranks[at]))
    yield worst


class PhaseClock:
    """Rank-seconds spent in each phase, summed over a node's ranks: a counter
    per phase that exists from 0, so a phase's share is a rate() and no series
    appears or vanishes when ranks change phase. Fed by the sidecar's reads."""

    def __init__(self):
        self.seconds = np.zeros(len(slots.PHASES))
        self._last: float | None = None

    def observe(self, table, now: float) -> None:
        if self._last is not None and len(table) and now > self._last:
            codes = np.clip(table["phase"], 0, len(slots.PHASES) - 1)
            self.seconds += np.bincount(codes, minlength=len(slots.PHASES)) * (now - self._last)
        self._last = now

    def family(self, job: str, node: str) -> CounterMetricFamily:
        c = CounterMetricFamily("trainwatch_phase_seconds", "Rank-seconds the node's ranks spent in each phase "
                                "(rate: how many ranks are in it).", labels=[JOB_LABEL, "node", "phase"])
        for name, seconds in zip(slots.PHASES, self.seconds.tolist()):
            c.add_metric([job, node, name], seconds)
        return c
