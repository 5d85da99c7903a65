"""The one validating codec: what a record's declaration says is written is
what is read back; anything else is a skipped record or a named error, never
a traceback."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainwatch import codec
from trainwatch.codec import check
from trainwatch.watchdog.rankexit import RankExit, rank_exit_from_line
from trainwatch.launcher.failures import RankFailure


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    n: int = field(metadata=check(min=0))


@dataclass(frozen=True)
class Record:
    rank: int = field(metadata=check(min=0))
    name: str = field(metadata=check(max_len=5))
    ratio: float = 1.0
    ranks: list[int] = field(default_factory=list)
    colour: Colour = Colour.RED
    inner: Inner | None = None
    note: str | None = None
    flag: bool = False


def test_a_record_round_trips():
    r = Record(rank=3, name="abc", ratio=0.5, ranks=[1, 2], colour=Colour.BLUE, inner=Inner(4), note="x", flag=True)
    data = json.loads(json.dumps(codec.encode(r)))
    assert data["colour"] == "blue" and data["inner"] == {"n": 4}
    assert codec.decode(Record, data) == r


def test_required_fields_make_a_record_unreadable_and_optional_ones_fall_back():
    assert codec.decode(Record, {"name": "a"}) is None
    assert codec.decode(Record, {"rank": True, "name": "a"}) is None  # true is not rank 1
    assert codec.decode(Record, {"rank": -1, "name": "a"}) is None  # below its bound
    with pytest.raises(codec.CodecError, match=r"Record\.rank: not a int|Record\.rank: not an int|Record\.rank"):
        codec.decode(Record, {"rank": "1", "name": "a"}, strict=True)
    got = codec.decode(Record, {"rank": 1, "name": "abcdefgh", "ratio": float("nan"), "ranks": [1, "x", True, 2],
                                "colour": "green", "inner": {"n": -3}, "note": 5, "flag": "yes", "extra": 1})
    assert got == Record(rank=1, name="abcde", ranks=[1, 2])


def test_the_declared_records_read_their_own_writers_output():
    from trainwatch.launcher.agent import exit_line

    line = json.dumps(exit_line(2, 0, 77, -9, node="n1", run="r", first=True)).encode()
    e = rank_exit_from_line(line, "other", run="r")
    assert e == RankExit(rank=2, local_rank=0, pid=77, exitcode=-9, signal_name="SIGKILL", node="n1", first=True)
    assert rank_exit_from_line(line, "n", run="another run") is None
    f = RankFailure.from_json({"run": "r", "rank": 0, "generation": 1, "step": 3, "stepped": True, "type": "E" * 300,
                               "message": "m", "where": ""})
    assert f is not None and len(f.type) == 200 and f.generation == 1


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
                    max_leaves=20)
FIELDS = st.sampled_from(["rank", "name", "ratio", "ranks", "colour", "inner", "note", "flag", "local_rank", "pid",
                          "exitcode", "signal_name", "node", "first", "generation", "step", "stepped", "type",
                          "message", "where"])


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(FIELDS, JSON, max_size=10) | JSON)
def test_any_json_reads_as_a_record_or_nothing(data):
    for cls in (Record, RankExit, RankFailure):
        got = codec.decode(cls, data)
        assert got is None or isinstance(got, cls)
        try:
            codec.decode(cls, data, strict=True)
        except codec.CodecError:
            pass


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200))
def test_any_bytes_in_exits_jsonl_read_as_an_exit_or_nothing(raw):
    got = rank_exit_from_line(raw, "n")
    assert got is None or isinstance(got, RankExit)


# ---- incidents, verdicts, rank rows, job-store records, job status ----------------------

INCIDENT_FIELDS = st.sampled_from(["kind", "culprit_ranks", "victims", "summary", "severity", "runbook", "category",
                                   "evidence", "key", "detected_mono", "id", "scope", "nodes", "node", "time",
                                   "opened_time", "incident", "duration_s", "count", "reason", "confidence"])


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(INCIDENT_FIELDS, JSON, max_size=12) | JSON)
def test_any_json_reads_as_an_incident_a_verdict_or_a_store_record_or_nothing(data):
    from trainwatch.records import Verdict
    from trainwatch.watchdog.incident import Incident
    from trainwatch.watchdog.jobwide import JobResolved, store_record

    inc = Incident.from_json(data)
    assert inc is None or (isinstance(inc, Incident) and all(r >= 0 for r in inc.culprit_ranks + inc.victims))
    v = codec.decode(Verdict, data)
    assert v is None or isinstance(v, Verdict)
    rec = store_record(data)
    if rec is not None:
        json.dumps(codec.encode(rec) if isinstance(rec, JobResolved) else rec.to_json(), allow_nan=False)
        assert isinstance(rec, JobResolved) or (isinstance(rec.id, str) and rec.scope is not None)


ACTION_FIELDS = st.sampled_from(["verdict", "capture", "checkpoint", "in_process", "restart", "stack_groups",
                                  "category", "culprit_ranks", "requested", "why", "ok", "step", "written", "failed",
                                  "revised", "from_kind", "runbook", "summary"])
EVENT = st.dictionaries(INCIDENT_FIELDS | ACTION_FIELDS, JSON | st.dictionaries(ACTION_FIELDS, JSON, max_size=4),
                        max_size=10)
EVENT_LINE = st.binary(max_size=80) | EVENT.map(lambda d: json.dumps(d).encode()) | st.builds(
    lambda kind, ref, d: json.dumps(d | {"kind": kind, "incident": ref}).encode(),
    st.sampled_from(["hang", "action", "resolved", "restart"]), st.sampled_from(["a", "b", 1]), EVENT)


@given(lines=st.lists(EVENT_LINE, max_size=8))
def test_any_bytes_in_events_jsonl_read_as_typed_incidents_or_nothing(lines, tmp_path_factory):
    """Whatever events.jsonl holds, its reader gives typed incidents whose every
    field has its declared type, or skips the record; strict decoding names
    the field instead. Never a traceback."""
    from trainwatch import records, state
    from trainwatch.records import Incident

    jd = state.JobDir("hostile", tmp_path_factory.mktemp("home"))
    jd.path.mkdir(parents=True)
    jd.events_file.write_bytes(b"\n".join(lines))
    for incident in jd.incidents():
        assert isinstance(incident, Incident) and incident.severity in records.SEVERITIES
        assert all(type(r) is int and r >= 0 for r in incident.culprit_ranks + incident.victims)
        assert isinstance(incident.evidence, dict) and isinstance(incident.summary, str)
        assert incident.restart is None or type(incident.restart.requested) is bool
        assert incident.verdict is None or (isinstance(incident.verdict.category, str)
                                            and all(type(r) is int for r in incident.verdict.culprit_ranks))
        assert incident.resolution is None or incident.status == "resolved" or incident.kind == "restart"
        json.dumps(incident.view(), allow_nan=False)
    for line in lines:
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            continue
        try:
            got = codec.decode(Incident, data, strict=True)
        except codec.CodecError as e:
            assert str(e).startswith("Incident")  # names the record (and the field) that does not fit
        else:
            assert isinstance(got, Incident)


def test_incidents_and_verdicts_round_trip_through_their_json():
    from trainwatch.records import RestartDecision, Verdict
    from trainwatch.watchdog.incident import Incident

    inc = Incident(kind="hang", culprit_ranks=[3], victims=[0, 1], summary="s", severity="high", runbook="hang",
                   evidence={"step": 4}, detected_mono=12.5, id="n-1-1", node="n", restart=RestartDecision(True))
    line = json.loads(json.dumps(inc.to_json()))
    assert line["restart"] == {"requested": True} and "verdict" not in line and "resolution" not in line
    assert Incident.from_json(line) == inc
    assert Incident.from_json({"kind": "hang", "culprit_ranks": [1], "severity": "urgent"}).severity == "high"  # the kind's declared one
    assert Incident.from_json({"kind": "hang", "culprit_ranks": [-1, 2, "x"]}).culprit_ranks == [2]
    v = Verdict("dataloader", [1], "rank 1 waits for data", "hang", 0.8, ["2 ranks idle"])
    assert codec.decode(Verdict, json.loads(json.dumps(v.to_json()))) == v


def test_a_job_store_record_is_its_declaration_and_nothing_else():
    from trainwatch.watchdog.incident import Incident
    from trainwatch.watchdog.jobwide import store_record

    raw = Incident(kind="collective_mismatch", culprit_ranks=[3], severity="high").to_json() | {
        "id": "job-1-1-collective_mismatch", "scope": "job", "nodes": ["n1", 7], "node": "n1",
        "opened_time": 5.0, "restart": {"requested": True}}
    rec = store_record(raw)
    assert rec.id == raw["id"] and rec.nodes == ["n1"] and rec.time == raw["time"]
    assert rec.opened_time == 5.0 and rec.restart is None  # each node's gate decides its own restart
    assert store_record({k: v for k, v in raw.items() if k != "id"}) is None
    done = store_record({"kind": "resolved", "incident": "job-1", "duration_s": -1, "count": 2})
    assert codec.encode(done) == {"incident": "job-1", "duration_s": 0.0, "count": 2, "reason": "resolved",
                                  "kind": "resolved"}
    assert store_record({"kind": "resolved"}) is None


def test_rank_rows_and_the_job_status_are_written_by_the_codec(tmp_path):
    from trainwatch import rankrow, state
    from trainwatch.records import JobStatus

    row = rankrow.from_json({"rank": 2, "step": "9", "phase_times": {"data": 0.5, "x": 1, "backward": "slow"},
                             "groups": [{"pg": 0, "enqueued": 3, "completed": 2}, {"pg": "1"}] * 9})
    assert row.step == 0 and row.phase_times == {"data": 0.5} and len(row.groups) == 4
    assert row.to_json()["collectives"] == {"enqueued": 3, "completed": 2, "last_op": None}
    jd = state.JobDir("j-status", tmp_path)
    jd.own.mkdir(parents=True)
    jd.update_job(status=JobStatus.RESTARTING)
    assert json.loads(jd.job_file.read_text())["status"] == "restarting"
    assert f"job {JobStatus.SUCCEEDED}" == "job succeeded"


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | st.builds(lambda d: json.dumps(d).encode(),
                                                 st.dictionaries(st.sampled_from(["op", "id", "pid", "code", "args",
                                                                                  "env", "cwd", "error"]), JSON)))
def test_any_line_on_the_warm_start_socket_reads_as_a_message_or_nothing(raw):
    from trainwatch import messages

    got = codec.decode_line(messages.ZYGOTE_MESSAGES, raw)
    assert got is None or type(got) in messages.ZYGOTE_MESSAGES.values()


def test_zygote_messages_and_restart_requests_round_trip():
    from trainwatch import messages

    for msg in (messages.ZygoteReady(7, ["torch"], 1.5, False),
                messages.ZygoteFork(1, ["python", "-c", "0"], {"A": "b"}, "/"),
                messages.ZygoteForked(1, pid=9), messages.ZygoteForked(2, error="bad"), messages.ZygoteExit(9, -9)):
        assert codec.decode_line(messages.ZYGOTE_MESSAGES, json.dumps(codec.encode(msg))) == msg
    assert codec.decode_line(messages.ZYGOTE_MESSAGES, b'{"op": "exit", "pid": "9", "code": 0}') is None
    assert codec.decode_line(messages.ZYGOTE_MESSAGES, b'{"op": "fork", "id": 1, "args": ["x", 5], "env": {"A": 1}, '
                                                       b'"cwd": "/"}') == messages.ZygoteFork(1, ["x"], {}, "/")
    req = messages.RestartRequest(run="r", generation=2, reason="hang", kind="hang", incident="n-1-3", time=5.0)
    assert codec.decode(messages.RestartRequest, json.loads(json.dumps(codec.encode(req)))) == req
    assert codec.decode(messages.RestartRequest, {"run": "r", "generation": True}) is None


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=120) | st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(
    st.sampled_from(["run", "generation", "reason", "kind", "incident", "time"]), JSON)))
def test_any_restart_request_file_is_taken_or_ignored(tmp_path_factory, raw):
    from types import SimpleNamespace

    from trainwatch import records, state
    from trainwatch.launcher.agent import TrainwatchAgent

    job = state.JobDir("req", root=tmp_path_factory.mktemp("req")).create()
    job.restart_request_file.parent.mkdir(parents=True, exist_ok=True)
    job.restart_request_file.write_bytes(raw)
    agent = SimpleNamespace(dir=job, run_id="r", restart_count=0)
    got = TrainwatchAgent._take_restart_request(agent)
    assert got is None or (isinstance(got, messages.RestartRequest) and got.run == "r" and got.generation == 0)
    assert not job.restart_request_file.exists()
