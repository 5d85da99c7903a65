"""trainwatch's records in the rendezvous store are sealed with the job secret:
a record from anyone without it is counted and never acted on, and neither
losses nor stack frames are readable from the store without it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwatch import env, netbind
from trainwatch.jobstore import HOLE_GRACE_S, MAX_BACKLOG, JobStore, RecordSeal, SecretError, read_secret
from trainwatch.watchdog.jobwide import Aggregator, Summary, decode_summary, encode_summary
from trainwatch.watchdog.engine import DetectorEngine, _SyntheticJob
from trainwatch.launcher.options import LaunchError, parse


SECRET = b"0123456789abcdef0123456789abcdef"
SEAL = RecordSeal(SECRET)
keys = st.text(min_size=1, max_size=80)


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now



@settings(max_examples=200, deadline=None)
@given(keys, st.binary(max_size=4000))
def test_a_sealed_record_opens_under_its_key_only(key, payload):
    blob = SEAL.seal(key, payload)
    assert SEAL.open(key, blob) == payload
    assert payload not in blob[15:] or len(payload) < 4  # encrypted, not merely signed
    assert SEAL.open(key + "/", blob) is None  # moved to another key
    assert RecordSeal(b"another secret of 32 bytes......").open(key, blob) is None


@settings(max_examples=300, deadline=None)
@given(keys, st.binary(max_size=4000))
def test_any_bytes_from_the_store_open_to_nothing(key, data):
    assert SEAL.open(key, data) is None


@settings(max_examples=200, deadline=None)
@given(keys, st.binary(min_size=1, max_size=500), st.data())
def test_a_tampered_record_opens_to_nothing(key, payload, data):
    blob = bytearray(SEAL.seal(key, payload))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= data.draw(st.integers(1, 255))
    assert SEAL.open(key, bytes(blob)) is None
    assert SEAL.open(key, bytes(blob[:-1])) is None


def test_without_a_secret_records_pass_as_they_are():
    plain = RecordSeal(None)
    assert not plain.authenticated and plain.seal("k", b"x") == b"x" and plain.open("k", b"x") == b"x"


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    assert read_secret(secret_file=str(f), environ={}) == SECRET
    assert read_secret(environ={env.JOB_SECRET: SECRET.decode()}) == SECRET
    assert read_secret(environ={}) is None
    with pytest.raises(SecretError, match="16 to 4096 bytes"):
        read_secret(environ={env.JOB_SECRET: "short"})
    with pytest.raises(SecretError, match="cannot read it"):
        read_secret(secret_file=str(tmp_path / "missing"), environ={})


def test_forged_records_are_counted_and_never_taken(store):
    endpoint, _server = store
    node, outsider = JobStore(endpoint, "j", seal=SEAL), JobStore(endpoint, "j")  # the outsider has no secret
    node.register("n0")
    outsider.register("evil")
    outsider.add_incident({"kind": "hang", "id": "forged", "scope": "job"})
    outsider.request_capture("evil")
    outsider.publish("n0", b"forged summary")
    assert node.nodes() == ["n0"]
    assert node.incidents_since(0)[1] == [] and node.capture_requests(0, "n0")[1] == []
    assert node.summaries(["n0"]) == [None]
    assert node.rejected == 4  # the name, the incident, the request, the summary
    # A record sealed for one key and copied under another does not open either.
    node.add_incident({"kind": "hang", "id": "real"})
    real = node.store.get(node.key("incident/2"))
    node.store.add(node.key("incidents"), 1)
    node.store.set(node.key("incident/3"), real)
    _n, got = node.incidents_since(0)
    assert [r["id"] for r in got] == ["real"]


def test_the_secret_keeps_losses_and_frames_from_the_store(store):
    endpoint, _server = store
    node = JobStore(endpoint, "j", seal=SEAL)
    table = _SyntheticJob(2).advance().table
    node.publish("n0", encode_summary("n0", 1, 1.0, table))
    node.publish_stacks(1, "n0", [{"frames": ["train.py:42 secret_function"], "ranks": [0]}])
    raw = node.store.get(node.key("summary/n0"))
    assert decode_summary(raw) is None and b"secret_function" not in node.store.get(node.key("capture/1/stacks/n0"))
    assert decode_summary(node.summaries(["n0"])[0]).table["loss"].tobytes() == table["loss"].tobytes()
    assert node.stacks(1, ["n0"])["n0"][0]["frames"] == ["train.py:42 secret_function"]


def test_a_bumped_counter_neither_floods_nor_stalls_the_reader(store):
    endpoint, _server = store
    clock = Clock()
    node = JobStore(endpoint, "j", seal=SEAL, clock=clock)
    writer = JobStore(endpoint, "j", seal=SEAL)
    node.store.add(node.key("incidents"), 10**9)  # numbers with no record behind them
    writer.add_incident({"kind": "hang", "id": "after"})
    seen, got = node.incidents_since(0)
    assert [r["id"] for r in got] == ["after"] and seen == 10**9 + 1
    assert len(node._pending["incidents"]) <= MAX_BACKLOG
    clock.now += HOLE_GRACE_S + 1
    node.incidents_since(seen)
    assert node._pending["incidents"] == {}
    # A hole (a writer between its add and its set) is taken once it is filled.
    n = node.store.add(node.key("incidents"), 1)
    writer.add_incident({"kind": "hang", "id": "later"})
    seen, got = node.incidents_since(seen)
    assert [r["id"] for r in got] == ["later"]
    node.store.set(node.key(f"incident/{n}"), SEAL.seal(node.key(f"incident/{n}"), json.dumps({"id": "late"}).encode()))
    assert [r["id"] for r in node.incidents_since(seen)[1]] == ["late"]


def test_an_old_summary_written_back_does_not_revive_a_lost_node():
    clock = Clock(10.0)
    agg = Aggregator(DetectorEngine([]), lost_after_s=5.0, clock=clock)
    table = _SyntheticJob(2).advance().table
    agg.tick([Summary("n0", 5, 1.0, table.copy())])
    clock.now = 14.0
    agg.tick([Summary("n0", 4, 1.0, table.copy())])  # replayed: older than the one seen
    clock.now = 15.5
    assert [i.kind for i in agg.tick([])] == ["node_lost"]


SCRIPT = "tests/scripts/plain_ddp.py"


def test_a_multi_node_launch_without_a_secret_refuses_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv(env.JOB_SECRET, raising=False)
    argv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999", SCRIPT]
    with pytest.raises(LaunchError) as e:
        parse(argv)
    assert "--job-secret-file" in str(e.value) and "--insecure-store" in str(e.value) and "\n" not in str(e.value)
    assert parse(["--insecure-store", *argv])[1].insecure_store
    monkeypatch.setenv(env.JOB_SECRET, SECRET.decode())
    assert parse(argv)[1].job_secret == SECRET
    assert parse(argv[2:])[1].job_secret == SECRET  # single node: taken when given, never required


def test_listeners_beyond_loopback_are_named_once_each():
    assert netbind.exposure_warnings(metrics_host="127.0.0.1", store="127.0.0.1:1", rank_store_bind="127.0.0.1",
                                     sealed=True) == []
    lines = netbind.exposure_warnings(metrics_host="0.0.0.0", store="10.1.2.3:29400", rank_store_bind=None,
                                      sealed=True)
    assert len(lines) == 3 and "exporter" in lines[0] and "10.1.2.3:29400" in lines[1] and "rank 0" in lines[2]
