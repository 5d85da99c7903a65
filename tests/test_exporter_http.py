"""End-to-end: the sidecar's Prometheus endpoint, scraped over HTTP during a
real 2-rank `trainwatch launch`, parsed with prometheus_client's own parser."""

from __future__ import annotations


import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from util import running_plain_job, wait_for

pytestmark = pytest.mark.slow

JOB = "exporter-e2e"
RANKS = {"0", "1"}


@pytest.fixture(scope="module")
def live_job(tmp_path_factory):
    """Yields job.json of a running 2-rank job once its exporter address is recorded."""
    with running_plain_job(tmp_path_factory.mktemp("twhome"), JOB) as job:
        yield job


def scrape(address: str) -> dict:
    """name -> metric family, as Prometheus would read it."""
    r = requests.get(f"http://{address}/metrics", timeout=5)
    r.raise_for_status()
    assert r.headers["Content-Type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(r.text)}


def per_rank(family, sample_name: str | None = None) -> dict[str, float]:
    name = sample_name or family.name
    return {s.labels["rank"]: s.value for s in family.samples if s.name == name}


def scrape_until(address: str, predicate, what: str, timeout: float = 60):
    """Scrape repeatedly until predicate(families) holds; returns the families."""

    def attempt():
        families = scrape(address)
        return families if predicate(families) else None

    return wait_for(attempt, timeout, interval=0.2, what=what)


def test_exporter_binds_loopback_only(live_job):
    host, port = live_job["metrics"].rsplit(":", 1)
    assert host == "127.0.0.1"
    listening = [
        c.laddr for c in psutil.Process(live_job["sidecar_pid"]).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening


def test_step_is_per_rank_and_increases(live_job):
    address = live_job["metrics"]

    def both_ranks_stepping(families):
        step = families.get("trainwatch_step")
        return step is not None and set(per_rank(step)) == RANKS and min(per_rank(step).values()) >= 1

    first = scrape_until(address, both_ranks_stepping, "both ranks to report a step")
    step = first["trainwatch_step"]
    assert step.type == "gauge"
    assert len(step.samples) == 2
    for sample in step.samples:
        assert set(sample.labels) == {"trainwatch_job", "node", "rank"}  # `job` is Prometheus' own
        assert sample.labels["trainwatch_job"] == JOB and sample.labels["node"] == live_job["node"]
    before = per_rank(step)
    scrape_until(
        address,
        lambda f: all(per_rank(f["trainwatch_step"]).get(r, -1) > before[r] for r in RANKS),
        "every rank's step to increase between scrapes",
    )


def test_step_duration_histogram_is_one_per_node(live_job):
    def observed(families):
        hist = families.get("trainwatch_step_duration_seconds")
        counts = [s.value for s in hist.samples if s.name.endswith("_count")] if hist is not None else []
        return counts and counts[0] >= 2

    hist = scrape_until(live_job["metrics"], observed, "step durations of both ranks")["trainwatch_step_duration_seconds"]
    assert hist.type == "histogram"
    assert all("rank" not in s.labels for s in hist.samples)  # every rank's steps, one set of buckets
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    bounds = [s.labels["le"] for s in buckets]
    assert "+Inf" in bounds and len(bounds) > 5
    counts = [s.value for s in buckets]
    assert counts == sorted(counts), "bucket counts must be cumulative"
    [count] = [s.value for s in hist.samples if s.name.endswith("_count")]
    [total] = [s.value for s in hist.samples if s.name.endswith("_sum")]
    assert counts[-1] == count and total > 0


def test_progress_age_is_small_while_training(live_job):
    families = scrape_until(
        live_job["metrics"],
        lambda f: set(per_rank(f["trainwatch_last_progress_age_seconds"])) == RANKS,
        "progress age for both ranks",
    )
    ages = per_rank(families["trainwatch_last_progress_age_seconds"])
    # Steps take ~0.05 s; a few seconds leaves room for a loaded CI machine.
    assert all(0 <= age < 10 for age in ages.values()), ages


def test_collective_seq_is_the_lowest_and_highest_rank_per_group(live_job):
    def both_states(families):
        seq = families.get("trainwatch_node_collective_seq")
        if seq is None:
            return False
        seen = {(s.labels["state"], s.labels["stat"]) for s in seq.samples}
        return seen >= {(state, stat) for state in ("enqueued", "completed") for stat in ("min", "max")}

    seq = scrape_until(live_job["metrics"], both_states, "collective counters of the node's ranks")
    seq = seq["trainwatch_node_collective_seq"]
    for sample in seq.samples:
        assert {"trainwatch_job", "node", "pg", "state", "stat"} <= set(sample.labels) and "rank" not in sample.labels
        assert sample.value >= 0
    completed = [s.value for s in seq.samples if s.labels["state"] == "completed"]
    assert max(completed) >= 1, "DDP's gradient all_reduces were not counted"


def test_incident_and_restart_counters_are_exported(live_job):
    families = scrape(live_job["metrics"])
    # prometheus_client's parser names counter families without "_total".
    incidents = families["trainwatch_incidents"]
    assert incidents.type == "counter"
    # No incident in a healthy run, so the family may have no sample yet;
    # any sample present is labelled by kind.
    assert all({"trainwatch_job", "node", "kind"} <= set(s.labels) for s in incidents.samples)
    restarts = families["trainwatch_restarts"]
    assert restarts.type == "counter"
    totals = [s for s in restarts.samples if s.name == "trainwatch_restarts_total"]
    assert [(s.labels["trainwatch_job"], s.value) for s in totals] == [(JOB, 0.0)]
