"""One job-wide watchdog for a multi-node job, through torchelastic's own
rendezvous store (the TCPStore the c10d rendezvous already runs): no other
network protocol, no other port.

Every node's sidecar keeps watching its own ranks and, twice a second
and on every incident, publishes a summary: its slot rows, exactly as the
segment holds them (versioned by the slot layout), with its node name and the
monotonic time they were read. The sidecar of the node that hosts the store
(the rendezvous host: if it goes, the job's rendezvous goes with it) is the
aggregator. It rebases each node's monotonic times onto its own clock (the
time a summary is first seen stands for the time it was read), joins the
rows, and runs the job-scope detectors (hang, collective mismatch, straggler)
over every rank of every node, so the culprit is named once, with its node,
and the victims on other nodes are victims. A node whose summaries stop is
`node_lost`, with its name and ranks, within the hang threshold.

Job incidents are appended to the store; every sidecar (the aggregator's
too) takes each one once and responds for its own ranks: captures their
stacks, asks them for an emergency checkpoint, and asks its agent to restart,
so every node re-rendezvouses into the same new round.

The store's keys are listed in trainwatch.jobstore.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainwatch import codec, kinds, rankrow, records, slots
from trainwatch.capture import capture_ranks
from trainwatch.jobstore import JobStore
from trainwatch.watchdog import aggregates
from trainwatch.watchdog.aggregates import JOB_LABEL
from trainwatch.watchdog.detectors.base import TickView
from trainwatch.watchdog.engine import DetectorEngine
from trainwatch.watchdog.incident import Incident

JOB_INCIDENT_KINDS = kinds.JOB_SCOPE_KINDS
"""Kinds the aggregator raises for the whole job (trainwatch_job_incidents_total)."""

log = logging.getLogger("trainwatch.jobwide")

SUMMARY_VERSION = 1
JOB_SCOPE = tuple(k for k in kinds.JOB_SCOPE_KINDS if k != "node_lost")
"""Detectors (named by the kind they raise) that need every rank of the job: run by the aggregator only
(node_lost is the aggregator's own finding, not a detector's)."""
MONO_FIELDS = tuple(n for n in slots.slot_dtype().names if n.endswith("_mono"))
PUBLISH_S = 0.5
"""How often a node publishes its summary (and on every incident)."""
LOST_MARGIN_S = 1.0
"""A node is lost after the hang threshold less this margin of silence: its last
summary may be PUBLISH_S old and the aggregator looks every PUBLISH_S / 2, so the
loss is reported within the hang threshold of the node's death."""


@dataclass(slots=True)
class JobTags:
    """What the aggregator adds to a job incident in the store."""

    id: str = field(metadata=codec.check(max_len=200))
    scope: str = "job"
    nodes: list[str] = field(default_factory=list, metadata=codec.check(max_len=200))
    node: str = field(default="", metadata=codec.check(max_len=4000))


@dataclass(slots=True)
class JobResolved:
    """The aggregator's word that a job incident is over."""

    incident: str = field(metadata=codec.check(max_len=200))
    duration_s: float = field(default=0.0, metadata=codec.check(min=0))
    count: int = field(default=1, metadata=codec.check(min=1))
    reason: str = field(default="resolved", metadata=codec.check(max_len=200))
    kind: str = "resolved"


def store_record(raw: Any) -> Incident | JobResolved | None:
    """A job-store incident record checked against its declaration (an incident
    with the aggregator's tags, or a `resolved`); None when it does not fit (the
    store's secret already keeps out forgeries: this keeps out a newer or broken
    writer's records). The incident keeps the aggregator's `time` and
    `opened_time`: when it was raised, not when this node read it."""
    done = codec.decode(JobResolved, raw)
    if done is not None and done.kind == "resolved":
        return done
    incident, tags = Incident.from_json(raw), codec.decode(JobTags, raw)
    if incident is None or tags is None or incident.kind == "resolved":
        return None
    incident.id, incident.scope, incident.nodes, incident.node = tags.id, tags.scope, tags.nodes, tags.node
    incident.restart = None  # each node's gate decides its own restart
    return incident


# ---- summaries --------------------------------------------------------------------------


def encode_summary(node: str, seq: int, now: float, table: np.ndarray, *, final: bool = False,
                   causes: dict[str, list[str]] | None = None) -> bytes:
    header = {"v": SUMMARY_VERSION, "layout": slots.LAYOUT_VERSION, "node": node, "seq": seq, "now": now,
              "rows": int(len(table)), "final": final, "causes": causes or {}}
    return json.dumps(header).encode() + b"\n" + np.ascontiguousarray(table, dtype=slots.slot_dtype()).tobytes()


@dataclass(slots=True)
class Summary:
    node: str
    seq: int
    now: float
    table: np.ndarray
    final: bool = False
    causes: dict[str, frozenset] = field(default_factory=dict)
    """What the node knows explains some job-scope findings: cause -> the kinds it mutes."""


def node_causes(node: str, restarting: bool, open_here) -> dict[str, list[str]]:
    """What a node publishes beside its rows: a restart under way (its slots
    hold the stopped workers' last words) and its own open incidents that
    explain the stalls of the ranks waiting on them (a crash). The aggregator
    mutes what they explain, as this node's own engine does."""
    out = {f"a restart under way on {node}": sorted(kinds.RESTART_QUIET)} if restarting else {}
    for incident in open_here:
        if incident.scope != "job" and incident.kind in kinds.MUTES:
            out[f"the {incident.kind} on {node}"] = sorted(kinds.MUTES[incident.kind])
    return out


def _causes(raw: Any) -> dict[str, frozenset]:
    if not isinstance(raw, dict):
        return {}
    return {str(c)[:200]: frozenset(k for k in muted if isinstance(k, str) and k in kinds.RESTART_QUIET)
            for c, muted in list(raw.items())[:16] if isinstance(muted, list)}


def decode_summary(payload: bytes | None) -> Summary | None:
    """A published summary, or None for one of another version or the wrong shape."""
    if not payload:
        return None
    head, sep, body = payload.partition(b"\n")
    try:
        h = json.loads(head)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(h, dict) and sep and h.get("v") == SUMMARY_VERSION and h.get("layout") == slots.LAYOUT_VERSION
            and isinstance(h.get("node"), str) and isinstance(h.get("seq"), int)
            and isinstance(h.get("now"), (int, float)) and isinstance(h.get("rows"), int)):
        return None
    dtype = slots.slot_dtype()
    if h["rows"] < 0 or len(body) != h["rows"] * dtype.itemsize:
        return None
    table = np.frombuffer(body, dtype=dtype).copy()
    return Summary(h["node"], h["seq"], float(h["now"]), table, h.get("final") is True, _causes(h.get("causes")))


def rebase(table: np.ndarray, offset: float) -> np.ndarray:
    """Move a node's monotonic times onto this clock (0 means never: left alone)."""
    out = table.copy()
    for name in MONO_FIELDS:
        col = out[name]
        col[col > 0] += offset
    return out


# ---- the aggregator ---------------------------------------------------------------------


@dataclass
class _NodeSeen:
    seq: int
    first_seen: float
    offset: float
    table: np.ndarray
    final: bool = False
    lost: bool = False
    causes: dict[str, frozenset] = field(default_factory=dict)


@dataclass
class Aggregator:
    """Builds the job-wide table from every node's summary and runs the
    job-scope detectors and the node-loss check over it."""

    engine: DetectorEngine
    lost_after_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    nodes: dict[str, _NodeSeen] = field(default_factory=dict)

    def observe(self, summaries: list[Summary]) -> None:
        now = self.clock()
        for s in summaries:
            seen = self.nodes.get(s.node)
            # Not newer than what was seen: the same summary, or an old one
            # written back to the store (a replay must not revive a lost node).
            if seen is not None and s.seq <= seen.seq:
                continue
            self.nodes[s.node] = _NodeSeen(s.seq, now, now - s.now, s.table, s.final, causes=s.causes)

    def table(self, *, include_lost: bool = False) -> tuple[np.ndarray, list[str]]:
        parts, labels = [], []
        for name, seen in sorted(self.nodes.items()):
            if seen.lost and not include_lost:
                continue
            live = seen.table[seen.table["pid"] > 0]
            parts.append(rebase(live, seen.offset))
            labels += [name] * len(live)
        if not parts:
            return np.zeros(0, dtype=slots.slot_dtype()), []
        return np.concatenate(parts), labels

    def lost_nodes(self) -> list[Incident]:
        """A node that has stopped publishing (and had not said it was done)."""
        now = self.clock()
        out = []
        for name, seen in sorted(self.nodes.items()):
            if seen.final or seen.lost or now - seen.first_seen < self.lost_after_s:
                continue
            rows = seen.table[seen.table["pid"] > 0]
            if len(rows) and (rows["phase"] == slots.PHASE_CODES["done"]).all():
                continue
            seen.lost = True
            ranks = sorted(int(r) for r in rows["rank"])
            age = now - seen.first_seen
            out.append(Incident(
                kind="node_lost", culprit_ranks=ranks,
                summary=f"node {name} lost: no word from its watchdog for {age:.1f}s "
                        f"(ranks {', '.join(map(str, ranks)) or 'none'}); the survivors are its victims",
                evidence={"node": name, "silent_s": round(age, 2), "ranks": ranks}))
        return out

    def tick(self, summaries: list[Summary]) -> list[Incident]:
        self.observe(summaries)
        lost = self.lost_nodes()
        table, labels = self.table()
        if not (len(table) or lost):
            return []
        causes: dict[str, frozenset] = {}
        for name, seen in sorted(self.nodes.items()):
            if seen.lost:  # its peers wait for it, as for a crashed rank: that is the node_lost incident
                causes[f"node {name} lost"] = kinds.MUTES["crash"]
            else:
                causes.update(seen.causes)
        return self.engine.tick(TickView(now=self.clock(), table=table, nodes=labels), extra=lost, causes=causes)

    def nodes_of(self, ranks: list[int]) -> list[str]:
        out = []
        for name, seen in sorted(self.nodes.items()):
            if np.isin(seen.table["rank"][seen.table["pid"] > 0], ranks).any():
                out.append(name)
        return out


def job_scope(detectors: list, *, aggregator: bool) -> list:
    """The detectors a node runs: the job-scope ones on the aggregator only, the others everywhere."""
    return [d for d in detectors if (d.name in JOB_SCOPE) == aggregator]


def told_here(incident: Incident, open_here: Iterable[Incident]) -> bool:
    """A job incident this node already has open as its own: the same kind
    about the same culprits (a rank here its process state showed stopped,
    before the job's hang detector called the same stall). One fault, one
    incident: the node keeps its own, with the actions it already took."""
    culprits = incident.culprit_ranks
    return bool(culprits) and any(o.scope != "job" and o.kind == incident.kind and o.culprit_ranks == culprits
                                  for o in open_here)


# ---- one node's part in the job-wide watchdog ------------------------------------------


class JobWideNode:
    """What a node's sidecar does for the job-wide view, each round: publish its
    summary, aggregate (on the rendezvous host), answer stack capture requests
    and take the job's incidents. The store going away never stops the node's
    own watchdog: the view pauses and says so once."""

    def __init__(self, sidecar: Any, store: JobStore, aggregate: bool, detectors: list):
        self.sidecar = sidecar
        self.store = store
        self.aggregator: Aggregator | None = None
        if aggregate:
            floor_s = sidecar.config.detectors.hang.floor_s
            self.aggregator = Aggregator(DetectorEngine(job_scope(detectors, aggregator=True),
                                                        config=sidecar.config.engine),
                                         lost_after_s=max(2.0, floor_s - LOST_MARGIN_S), clock=sidecar.clock)
        # Sequence numbers start at the wall-clock millisecond: a sidecar started
        # again goes on above its predecessor's, so the aggregator takes it.
        self.published_seq = time.time_ns() // 1_000_000
        self.published_at = -1e9
        self.aggregated_at = -1e9
        # A sidecar started again mid-job takes only what comes from now on.
        try:
            self.incidents_seen, self.captures_seen = store.high_water("incidents"), store.high_water("captures")
        except Exception:  # the store is away: the first round says so
            self.incidents_seen = self.captures_seen = 0
        self.incident_counts: dict[str, int] = {}
        self.job_ids: dict[str, str] = {}
        """Aggregator: engine key -> id of the open job incident."""
        self.published_incidents = 0
        self.store_failed = False

    def round(self, urgent: bool) -> None:
        sc = self.sidecar
        try:
            now = sc.clock()
            if urgent or now - self.published_at >= PUBLISH_S:
                self.publish()
            if self.aggregator is not None and now - self.aggregated_at >= PUBLISH_S / 2:
                self.aggregated_at = now
                self.aggregate()
            self.captures_seen, requests = self.store.capture_requests(self.captures_seen, sc.node)
            for n in requests:
                threading.Thread(target=self.capture_for, args=(n,), daemon=True,
                                 name="trainwatch-remote-capture").start()
            self.incidents_seen, taken = self.store.incidents_since(self.incidents_seen)
            for record in filter(None, map(store_record, taken)):
                if isinstance(record, JobResolved):  # a job incident the aggregator saw end
                    sc.resolve(record.incident, record.duration_s, record.count, record.reason)
                elif not told_here(record, sc.open.values()):
                    sc.emit(record)
            self.store_failed = False
        except Exception as e:  # a store that went away raises torch's DistNetworkError, RuntimeError, ...
            if not self.store_failed:
                print(f"[trainwatch] job-wide view paused: the rendezvous store is unreachable ({e})",
                      file=sc.out, flush=True)
            self.store_failed = True

    def publish(self, *, final: bool = False) -> None:
        sc = self.sidecar
        table = sc.last_table if sc.last_table is not None else np.zeros(0, dtype=slots.slot_dtype())
        self.published_seq += 1
        self.published_at = sc.clock()
        causes = node_causes(sc.node, sc.last_restarting, list(sc.open.values()))
        self.store.publish(sc.node, encode_summary(sc.node, self.published_seq, self.published_at, table,
                                                   final=final, causes=causes))

    def summaries(self) -> list[Summary]:
        return [s for s in map(decode_summary, self.store.summaries(self.store.nodes())) if s is not None]

    def aggregate(self) -> None:
        sc = self.sidecar
        new = self.aggregator.tick(self.summaries())
        # Job incidents that are over: every node takes the news from the store.
        self.aggregator.engine.take_confirmed()  # a job incident restarts at detection (Revisions.gate)
        for res in self.aggregator.engine.take_resolved():
            job_id = self.job_ids.pop(res.incident.key, None)
            if job_id is not None:
                self.store.add_incident(codec.encode(JobResolved(job_id, round(res.duration_s, 3), res.count,
                                                                  res.reason)))
        for incident in new:
            nodes = self.aggregator.nodes_of(incident.culprit_ranks)
            if incident.kind == "node_lost":
                nodes = [incident.evidence["node"]]
            self.published_incidents += 1
            incident.scope, incident.nodes, incident.node = "job", nodes, ",".join(nodes) or sc.node
            incident.id = f"job-{sc.run_id or os.getpid()}-{self.published_incidents}-{incident.kind}"
            self.incident_counts[incident.kind] = self.incident_counts.get(incident.kind, 0) + 1
            self.job_ids[incident.key] = incident.id
            self.store.add_incident(incident.to_json())

    def capture_for(self, n: int) -> None:
        """Another node's `diagnose` asked for every rank's stack: this node's ranks, grouped."""
        sc = self.sidecar
        try:
            rows = [r for r in sc.rows() if r.pid]
            groups, _where, _failed, _rows = capture_ranks(rows, job=sc.dir, label="remote", timeout_s=5.0)
            self.store.publish_stacks(n, sc.node, [dataclasses.asdict(g) for g in groups])
        except Exception:  # the asking side times out and says so
            log.exception("trainwatch: remote stack capture failed")

    def job_rows(self) -> list[dict]:
        """Every other node's ranks, from their summaries (for telemetry.json and diagnose)."""
        out = []
        for s in self.summaries():
            if s.node == self.sidecar.node:
                continue
            live = s.table[s.table["pid"] > 0]
            # Ages as the node saw them when it published.
            out += rankrow.rows_json(rankrow.decode(live, s.now, [s.node] * len(live)))
        return out

    def job_metrics(self) -> Iterator:
        """Job-level series, from the aggregator only: an alert on them fires once
        per job, not once per node. Rejected store records: every node."""
        rejected = CounterMetricFamily(
            "trainwatch_store_rejected", "Records in the rendezvous store that did not open with the job's "
            "secret (forged, replayed under another key, or another job's); never acted on.", labels=[JOB_LABEL, "node"])
        rejected.add_metric([self.sidecar.job, self.sidecar.node], float(self.store.rejected))
        yield rejected
        if self.aggregator is None:
            return
        table, _labels = self.aggregator.table()
        seen = self.aggregator.nodes
        progress = table["progress_mono"][table["progress_mono"] > 0] if len(table) else np.zeros(0)
        values = {
            "trainwatch_job_nodes": ("Nodes of the job that have published a summary.", len(seen)),
            "trainwatch_job_nodes_lost": ("Nodes whose watchdog went silent (node_lost).",
                                          sum(s.lost for s in seen.values())),
            "trainwatch_job_ranks": ("Ranks of the job, every node.", len(table)),
            "trainwatch_job_min_step": ("Lowest last completed step over every rank of the job.",
                                        int(table["step"].min()) if len(table) else 0),
            "trainwatch_job_max_progress_age_seconds": ("Longest time since a rank of the job made progress.",
                                                        self.sidecar.clock() - progress.min() if len(progress) else 0.0),
        }
        job = self.sidecar.job
        for name, (doc, value) in values.items():
            g = GaugeMetricFamily(name, doc, labels=[JOB_LABEL])
            g.add_metric([job], float(value))
            yield g
        c = CounterMetricFamily("trainwatch_job_incidents", "Job-wide incidents, by kind.", labels=[JOB_LABEL, "kind"])
        for kind, n in sorted(self.incident_counts.items()):
            c.add_metric([job, kind], float(n))
        yield c
        # The job's aggregates, bounded by the signals whatever the number of
        # ranks, from the table's columns: no row decoded at thousands of ranks.
        det = self.aggregator.engine.detector("straggler")
        ratios = det.current_ratios() if det is not None else {}
        values = aggregates.table_values(table, self.sidecar.clock(), ratios, {})
        yield from aggregates.stat_families("job", {JOB_LABEL: job}, values)
        yield from aggregates.table_collectives("job", {JOB_LABEL: job}, table)
