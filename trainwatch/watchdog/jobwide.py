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

Keys, under `trainwatch/<rendezvous id>/`:
  nodes                 counter: how many node names were registered
  node/<i>              the i-th node name
  summary/<node>        the node's latest summary (header line + slot rows)
  incidents             counter: job incidents published
  incident/<n>          the n-th job incident (JSON)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from trainwatch import slots
from trainwatch.watchdog.detectors.base import TickView
from trainwatch.watchdog.engine import DetectorEngine
from trainwatch.watchdog.incident import Incident

log = logging.getLogger("trainwatch.jobwide")

SUMMARY_VERSION = 1
JOB_SCOPE = ("hang", "collective_mismatch", "straggler")
"""Detectors that need every rank of the job: run by the aggregator only."""
MONO_FIELDS = tuple(n for n in slots.slot_dtype().names if n.endswith("_mono"))
PUBLISH_S = 0.5
"""How often a node publishes its summary (and on every incident)."""
LOST_MARGIN_S = 1.0
"""A node is lost after the hang threshold less this margin of silence: its last
summary may be PUBLISH_S old and the aggregator looks every PUBLISH_S / 2, so the
loss is reported within the hang threshold of the node's death."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class JobStore:
    """trainwatch's keys in the rendezvous store (a client connection)."""

    def __init__(self, endpoint: str, namespace: str, *, timeout_s: float = 10.0, store: Any = None):
        if store is None:
            from torch.distributed import TCPStore

            host, port = parse_endpoint(endpoint)
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        self.store = store
        self.prefix = f"trainwatch/{namespace}/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def register(self, node: str) -> None:
        i = self.store.add(self.key("nodes"), 1) - 1
        self.store.set(self.key(f"node/{i}"), node)

    def nodes(self) -> list[str]:
        n = self.store.add(self.key("nodes"), 0)
        if n <= 0:
            return []
        names = self.store.multi_get([self.key(f"node/{i}") for i in range(n)])
        return list(dict.fromkeys(b.decode(errors="replace") for b in names))

    def publish(self, node: str, payload: bytes) -> None:
        self.store.set(self.key(f"summary/{node}"), payload)

    def summaries(self, nodes: list[str]) -> list[bytes | None]:
        keys = [self.key(f"summary/{n}") for n in nodes]
        if not keys:
            return []
        if self.store.check(keys):  # the usual case: every node has published (one round trip)
            return list(self.store.multi_get(keys))
        present = [self.store.check([k]) for k in keys]
        found = self.store.multi_get([k for k, ok in zip(keys, present) if ok]) if any(present) else []
        it = iter(found)
        return [next(it) if ok else None for ok in present]

    def add_incident(self, record: dict) -> int:
        n = self.store.add(self.key("incidents"), 1)
        self.store.set(self.key(f"incident/{n}"), json.dumps(record, default=str))
        return n

    def incidents_since(self, seen: int) -> tuple[int, list[dict]]:
        """(new high-water mark, job incidents after `seen`); one not yet written is taken next time."""
        n = self.store.add(self.key("incidents"), 0)
        out: list[dict] = []
        for i in range(seen + 1, n + 1):
            key = self.key(f"incident/{i}")
            if not self.store.check([key]):
                return i - 1, out
            try:
                record = json.loads(self.store.get(key))
            except ValueError:
                record = None
            if isinstance(record, dict):
                out.append(record)
        return n, out


# ---- summaries --------------------------------------------------------------------------


def encode_summary(node: str, seq: int, now: float, table: np.ndarray, *, final: bool = False) -> bytes:
    header = {"v": SUMMARY_VERSION, "layout": slots.LAYOUT_VERSION, "node": node, "seq": seq, "now": now,
              "rows": int(len(table)), "final": final}
    return json.dumps(header).encode() + b"\n" + np.ascontiguousarray(table, dtype=slots.slot_dtype()).tobytes()


@dataclass(slots=True)
class Summary:
    node: str
    seq: int
    now: float
    table: np.ndarray
    final: bool = False


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
    return Summary(h["node"], h["seq"], float(h["now"]), table, h.get("final") is True)


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
            if seen is not None and seen.seq == s.seq:
                continue
            self.nodes[s.node] = _NodeSeen(s.seq, now, now - s.now, s.table, s.final)

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
                kind="node_lost", severity="critical", culprit_ranks=ranks,
                summary=f"node {name} lost: no word from its watchdog for {age:.1f}s "
                        f"(ranks {', '.join(map(str, ranks)) or 'none'}); the survivors are its victims",
                evidence={"node": name, "silent_s": round(age, 2), "ranks": ranks}, runbook="node-lost"))
        return out

    def tick(self, summaries: list[Summary]) -> list[Incident]:
        self.observe(summaries)
        lost = self.lost_nodes()
        table, labels = self.table()
        new = list(lost)
        if len(table):
            for inc in self.engine.tick(TickView(now=self.clock(), table=table, nodes=labels)):
                # While a node is lost, its peers wait for it: that is the node_lost incident.
                if any(s.lost for s in self.nodes.values()) and inc.kind in ("hang", "collective_mismatch"):
                    continue
                new.append(inc)
        return new

    def nodes_of(self, ranks: list[int]) -> list[str]:
        out = []
        for name, seen in sorted(self.nodes.items()):
            if np.isin(seen.table["rank"][seen.table["pid"] > 0], ranks).any():
                out.append(name)
        return out


def job_scope(detectors: list, *, aggregator: bool) -> list:
    """The detectors a node runs: the job-scope ones on the aggregator only, the others everywhere."""
    return [d for d in detectors if (d.name in JOB_SCOPE) == aggregator]
