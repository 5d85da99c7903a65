"""The job-wide view of a multi-node job: summaries through a real TCPStore,
the aggregator's job table and detectors, node loss on an injected clock."""

from __future__ import annotations


import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwatch import slots
from trainwatch.jobstore import JobStore
from trainwatch.records import Incident
from trainwatch.watchdog.detectors import default_detectors
from trainwatch.watchdog.engine import DetectorEngine, _SyntheticJob
from trainwatch.watchdog.jobwide import (
    JOB_SCOPE,
    Aggregator,
    decode_summary,
    encode_summary,
    job_scope,
    node_causes,
    rebase,
)


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now



def test_a_summary_round_trips_and_anything_else_is_none():
    table = _SyntheticJob(4).advance().table
    s = decode_summary(encode_summary("n1", 7, 123.5, table))
    assert s is not None and s.node == "n1" and s.seq == 7 and s.now == 123.5
    for name in ("rank", "step", "pid", "progress_mono", "phase", "ring"):
        assert s.table[name].tobytes() == table[name].tobytes(), name
    for name in ("enqueued", "completed", "last_op"):  # (not the padding between them)
        assert (s.table["groups"][name] == table["groups"][name]).all(), name
    assert decode_summary(encode_summary("n1", 1, 1.0, table)[:-1]) is None  # truncated
    assert decode_summary(b'{"v": 99}\n') is None and decode_summary(None) is None


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_any_bytes_from_the_store_are_a_summary_or_none(data):
    s = decode_summary(data)
    assert s is None or s.table.dtype == slots.slot_dtype()


def test_rebase_moves_monotonic_times_and_keeps_never():
    t = _SyntheticJob(2).advance().table
    t["active_mono"] = 0.0
    moved = rebase(t, 50.0)
    assert np.allclose(moved["progress_mono"], t["progress_mono"] + 50.0)
    assert (moved["active_mono"] == 0.0).all()


def test_job_scope_detectors_run_once_on_the_aggregator():
    every = default_detectors()
    assert {d.name for d in job_scope(every, aggregator=True)} == set(JOB_SCOPE)
    assert not {d.name for d in job_scope(every, aggregator=False)} & set(JOB_SCOPE)


def _stalled_job(store, causes_until: int = 0, causes: dict | None = None) -> tuple[Aggregator, list]:
    """Four ranks on two nodes through a real store; from tick 60 rank 3 (node 1)
    computes and never ends its step while the others wait for it. Node 1
    publishes `causes` with its summaries until tick `causes_until`."""
    endpoint, _server = store
    clock = Clock(1000.0)
    agg = Aggregator(DetectorEngine(job_scope(default_detectors(), aggregator=True)), clock=clock)
    pub, reader = JobStore(endpoint, "j"), JobStore(endpoint, "j")
    for n in ("n0", "n1"):
        pub.register(n)
    job = _SyntheticJob(4)
    bases = {"n0": 0.0, "n1": -700.0}  # node 1's monotonic clock started elsewhere
    seq = 0
    found = []
    frozen = None
    for tick in range(200):
        view = job.advance()
        clock.now = view.now
        if tick == 60:  # every rank stops: rank 3 (node 1) computes, the others wait for it
            frozen = job.table.copy()
            frozen["phase"][:3] = slots.PHASE_CODES["collective"]
            frozen["phase"][3] = slots.PHASE_CODES["compute"]
        if frozen is not None:
            frozen["heartbeat_mono"] = view.now  # alive, not progressing
            job.table[:] = frozen
        seq += 1
        for i, n in enumerate(("n0", "n1")):
            part = rebase(job.table[2 * i: 2 * i + 2], bases[n])
            said = causes if n == "n1" and tick < causes_until else None
            pub.publish(n, encode_summary(n, seq, view.now + bases[n], part, causes=said))
        summaries = [s for s in map(decode_summary, reader.summaries(reader.nodes())) if s is not None]
        found += [(tick, i) for i in agg.tick(summaries)]
    return agg, found


def test_the_aggregator_names_a_culprit_on_another_node_once(store):
    agg, found = _stalled_job(store)
    hangs = [i for _, i in found if i.kind == "hang"]
    assert len(hangs) == 1 and hangs[0].culprit_ranks == [3], [i.summary for _, i in found]
    assert agg.nodes_of(hangs[0].culprit_ranks) == ["n1"]


def test_what_a_node_says_explains_its_stall_mutes_the_job_hang(store):
    """A node restarting its workers (its slots hold the stopped workers' last
    words), or with its own crash open, says so in its summary: the stall the
    aggregator sees is muted there, never opened (the same stall without that
    word is the hang of the test above)."""
    restarting = node_causes("n1", True, [])
    assert restarting == {"a restart under way on n1": ["collective_mismatch", "hang", "straggler"]}
    crash = node_causes("n1", False, [Incident("crash", [3])])
    assert crash == {"the crash on n1": ["collective_mismatch", "hang"]}
    for causes in (restarting, crash):
        agg, found = _stalled_job(store, causes_until=200, causes=causes)
        assert not [i for _, i in found if i.kind in ("hang", "collective_mismatch")], found
        assert not agg.engine.open_incidents()


def test_a_node_says_only_its_own_open_causes():
    open_here = [Incident("crash", [], scope="job"), Incident("straggler", []), Incident("loss_nan", []),
                 Incident("hang", [1])]
    assert node_causes("n0", False, open_here) == {"the hang on n0": ["collective_mismatch"]}
    # What another writer put in a summary's causes is kept only where it names kinds the aggregator judges.
    table = _SyntheticJob(2).advance().table
    payload = encode_summary("n0", 1, 1.0, table, causes={"x": ["hang", "node_lost", 3], "y": "hang"})
    assert decode_summary(payload).causes == {"x": frozenset({"hang"})}


def test_a_silent_node_is_lost_after_the_threshold_and_a_finished_one_is_not():
    clock = Clock(10.0)
    agg = Aggregator(DetectorEngine([]), lost_after_s=5.0, clock=clock)
    table = _SyntheticJob(4).advance().table
    done = table[2:].copy()
    done["phase"] = slots.PHASE_CODES["done"]
    from trainwatch.watchdog.jobwide import Summary

    agg.tick([Summary("n0", 1, 1.0, table[:2].copy()), Summary("n1", 1, 1.0, done),
              Summary("n2", 1, 1.0, table[:1].copy(), final=True)])
    clock.now = 14.9
    assert agg.tick([Summary("n0", 1, 1.0, table[:2].copy())]) == []
    clock.now = 15.1
    lost = agg.tick([])
    assert [i.kind for i in lost] == ["node_lost"] and lost[0].evidence["node"] == "n0"
    assert lost[0].culprit_ranks == sorted(int(r) for r in table[:2]["rank"])
    assert agg.tick([]) == []  # once per loss


def test_job_incidents_are_taken_once_by_every_node(store):
    endpoint, _server = store
    a, b = JobStore(endpoint, "k"), JobStore(endpoint, "k")
    a.add_incident({"kind": "hang", "id": "job-1"})
    a.add_incident({"kind": "node_lost", "id": "job-2"})
    seen, got = b.incidents_since(0)
    assert seen == 2 and [r["id"] for r in got] == ["job-1", "job-2"]
    assert b.incidents_since(seen) == (2, [])
    # Garbage under an incident key is skipped, not a traceback.
    b.store.add(b.key("incidents"), 1)
    b.store.set(b.key("incident/3"), b"\xff{")
    assert b.incidents_since(2) == (3, [])


def test_a_job_incident_a_node_already_has_open_is_not_a_second_one():
    from trainwatch.watchdog.jobwide import told_here

    local = Incident("hang", [1], id="n0-1", node="n0")  # its process state: stopped
    job = Incident("hang", [1], id="job-7", scope="job")
    assert told_here(job, [local])
    assert not told_here(job, [])  # the other node records the job's
    assert not told_here(dataclasses.replace(job, culprit_ranks=[2]), [local])
    assert not told_here(dataclasses.replace(job, kind="collective_mismatch"), [local])
    assert not told_here(dataclasses.replace(job, culprit_ranks=[]), [dataclasses.replace(local, culprit_ranks=[])])
    assert not told_here(job, [dataclasses.replace(local, scope="job")])  # a job incident is not this node's own

