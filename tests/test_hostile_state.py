"""Readers of files trainwatch did not just write, fed anything: arbitrary
bytes, invalid UTF-8, truncated files, deep nesting, and valid JSON of the
wrong shape or with the right keys holding values of the wrong types.

Each reader must skip the bad record (or read it as missing) or raise its one
documented error; each command that reads a job directory must succeed or say
one `error:` line and exit 2. Never a traceback, never a lost file.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from trainwatch import checkpoint, historyfile, rankrow, slots, state
from trainwatch.views import diagnose, jobs, report, summary
from trainwatch.watchdog import sidecar, thresholds
from trainwatch.watchdog.config import SidecarConfig
from trainwatch.watchdog.detectors.base import RankExit
from trainwatch.watchdog.detectorconfig import LEARNT_PHASES
from trainwatch.watchdog.detectors.hang import HangDetector


HOSTILE = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                         HealthCheck.data_too_large])
"""Hypothesis' default example count: the strategies below already aim at the odd values (wrong types,
non-finite numbers, deep nesting, invalid UTF-8) that a blind search would take many more examples to hit."""


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# ---- strategies ------------------------------------------------------------------------

T0 = 1_700_000_000.0
DEAD_PID = 4_194_305  # above the kernel's largest pid_max: never a live process
JOB = "j"

ODD_TEXT = st.sampled_from(["", "\udcff", "a\ud800b", "\x00", "\u202e", "\U0001f600", "</script>", "x" * 300,
                            "running", "hang", "0", "-1", "1e999"])
texts = st.one_of(st.text(max_size=12), ODD_TEXT)
ODD_NUMBERS = st.sampled_from([-1, 0, 1, 2**31, 2**63, -(2**63) - 1, 10**30, -(10**30), 10**400, 1e30, -1e30, 1e308,
                               -1e308, math.inf, -math.inf, math.nan, -0.0, 0.5, True, False])
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ODD_NUMBERS, texts)


class Raw(str):
    """JSON text put into a document verbatim (nesting too deep to build as objects)."""


@st.composite
def deep(draw) -> Raw:
    n = draw(st.integers(30, 3000))
    if draw(st.booleans()):
        return Raw("[" * n + "]" * n)
    return Raw('{"a":' * n + "1" + "}" * n)


leaves = st.one_of(scalars, deep())
json_values = st.recursive(
    leaves, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=8)


def dump(value, *, ascii_only: bool = True) -> bytes:
    """value as JSON bytes: NaN/Infinity tokens, lone surrogates as \\udcff escapes
    (or, not ascii_only, as their invalid UTF-8 bytes), Raw text verbatim."""
    raws: list[str] = []

    def swap(v):
        if isinstance(v, Raw):
            raws.append(v)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), ensure_ascii=ascii_only)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw, 1)
    return text.encode("utf-8", "surrogatepass")


def shaped(base: dict) -> st.SearchStrategy[dict]:
    """The right keys, each holding its valid value or anything at all."""
    return st.fixed_dictionaries({k: st.one_of(v if isinstance(v, st.SearchStrategy) else st.just(v), json_values)
                                  for k, v in base.items()})


def as_bytes(values: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """A document as bytes: whole, truncated, or with invalid UTF-8 spliced in."""
    whole = st.tuples(values, st.booleans()).map(lambda vb: dump(vb[0], ascii_only=vb[1]))

    def cut(b: bytes):
        return st.integers(0, len(b)).map(lambda i: b[:i])

    def spliced(b: bytes):
        return st.tuples(st.integers(0, len(b)), st.sampled_from([b"\xff", b"\xc3", b"\xed\xb3\xbf", b"\x00"])).map(
            lambda p: b[:p[0]] + p[1] + b[p[0]:])

    return st.one_of(whole, whole.flatmap(cut), whole.flatmap(spliced))


def file_bytes(base: st.SearchStrategy | None = None) -> st.SearchStrategy[bytes]:
    options = [st.binary(max_size=300), as_bytes(json_values)]
    if base is not None:
        options.append(as_bytes(base))
    return st.one_of(options)


def jsonl_bytes(record: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    line = st.one_of(as_bytes(record), st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")),
                     as_bytes(json_values))
    return st.lists(line, max_size=6).map(b"\n".join)


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).isoformat()


PIDS = st.sampled_from([DEAD_PID, True, False, "12", -1, 0, 1e30, 10**30, 2**63, None, [1], {"pid": 1}])

JOB_RECORD = shaped({
    "job": JOB, "status": st.sampled_from(["running", "starting", "restarting", "succeeded", "failed", "lost"]),
    "launcher_pid": st.one_of(PIDS, st.just(os.getpid())), "start_time": T0, "end_time": T0 + 60,
    "workers_started_time": T0 + 1, "restarts": 1, "nproc_per_node": 2, "world_size": 2, "ranks": [0, 1],
    "entrypoint": st.sampled_from(["train.py --lr 1", "train.py \udcff\ud800 \U0001f600"]),
    "slots": "/nonexistent/trainwatch-segment", "node": "n0", "run_id": "r",
})
LAUNCH_RECORD = shaped({"job": JOB, "launcher_pid": st.one_of(PIDS, st.just(os.getpid())),
                        "start_time": T0 + 100, "created_dir": False})
EVIDENCE = shaped({"step": 3, "gpu": 0, "xid": 79, "meaning": "fell off the bus", "action": "reset the GPU",
                   "line": "NVRM: Xid 79"})
VERDICT = shaped({"category": "hang", "culprit_ranks": [1], "summary": "rank 1 stopped", "runbook": "hang",
                  "confidence": 0.8, "evidence": ["rank 1 idle 30 s"]})
INCIDENT = shaped({
    "kind": st.sampled_from(["hang", "xid", "ecc", "crash", "restart", "collective_mismatch", "action", "straggler",
                             "loss_nan"]),
    "id": "n0-1-1", "incident": "n0-1-1", "time": st.sampled_from([iso(T0 + 10), iso(T0 + 20), "0001-01-01T00:00:00",
                                                                   "9999-12-31T23:59:59+14:00"]),
    "culprit_ranks": [1], "victims": [0], "summary": "rank 1 hangs", "runbook": "hang", "category": "hang",
    "severity": "high", "evidence": EVIDENCE, "verdict": VERDICT, "restart": shaped({"requested": True}),
})
GROUP = shaped({"pg": 0, "enqueued": 5, "completed": 4, "last_op": "allreduce"})
RANK_ROW = shaped({
    "rank": st.sampled_from([0, 1]), "local_rank": 0, "node": "n0", "pid": DEAD_PID, "restart": 0, "step": 10,
    "step_source": "counted", "loss": 2.5, "grad_norm": 1.0, "step_s": 0.1, "compute_s": 0.08, "phase": "forward",
    "last_progress_s": 0.5, "last_step_s": 0.5, "phase_s": 0.1, "heartbeat_age_s": 0.2, "cpu_s": 3.0,
    "py_collectives": 4, "batches": 10, "groups": st.lists(st.one_of(GROUP, json_values), max_size=2),
})
TELEMETRY = shaped({"time": T0, "ranks": st.lists(st.one_of(RANK_ROW, json_values), max_size=3)})
HISTORY_ROW = st.tuples(*[st.one_of(st.just(v), json_values) for v in (0, 10, 2.0, 0.5, "data", 0.0, 1.0)]).map(list)
HISTORY_SAMPLE = shaped({"t": st.sampled_from([T0 + 1, T0 + 2]),
                         "r": st.lists(st.one_of(HISTORY_ROW, json_values), max_size=3)})

JOB_FILES = {
    "job.json": file_bytes(JOB_RECORD),
    "launch.json": file_bytes(LAUNCH_RECORD),
    "events.jsonl": jsonl_bytes(INCIDENT),
    "telemetry.json": file_bytes(TELEMETRY),
    "history/n0.jsonl": jsonl_bytes(HISTORY_SAMPLE),
}
VALID = {
    "job.json": JOB_RECORD.map(dump), "launch.json": LAUNCH_RECORD.map(dump),
    "events.jsonl": st.lists(INCIDENT.map(dump), max_size=4).map(b"\n".join),
    "telemetry.json": TELEMETRY.map(dump), "history/n0.jsonl": st.lists(HISTORY_SAMPLE.map(dump), max_size=4).map(b"\n".join),
}
job_files = st.fixed_dictionaries({name: st.one_of(st.none(), VALID[name], strategy)
                                   for name, strategy in JOB_FILES.items()})


def write_job(home: Path, files: dict[str, bytes | None]) -> Path:
    path = home / "jobs" / JOB
    shutil.rmtree(home, ignore_errors=True)
    (path / "history").mkdir(parents=True)
    for name, data in files.items():
        if data is not None:
            (path / name).write_bytes(data)
    return path


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- state.py ----------------------------------------------------------------------------


@HOSTILE
@given(data=st.one_of(file_bytes(JOB_RECORD), file_bytes(TELEMETRY)))
def test_read_json_is_an_object_or_none(home, data):
    home.mkdir(exist_ok=True)
    (home / "f.json").write_bytes(data)
    assert state.read_json(home / "f.json") is None or isinstance(state.read_json(home / "f.json"), dict)


@HOSTILE
@given(data=jsonl_bytes(INCIDENT))
def test_read_jsonl_keeps_objects_only(home, data):
    home.mkdir(exist_ok=True)
    (home / "f.jsonl").write_bytes(data)
    assert all(isinstance(r, dict) for r in state.read_jsonl(home / "f.jsonl"))


@HOSTILE
@example(files={"events.jsonl": b'{"kind": "hang", "culprit_ranks": "x", "evidence": 5, "verdict": [], "restart": 1}'})
@example(files={"events.jsonl": b'{"kind": "xid", "evidence": {"xid": [79]}, "verdict": {"category": "x", '
                                b'"culprit_ranks": 5, "confidence": "high", "evidence": 7}, "summary": {"a": 1}}'})
@example(files={"events.jsonl": b'{"kind": "hang", "summary": ' + b"[" * 900 + b"]" * 900 + b"}"})
@given(files=job_files)
def test_job_dir_readers_type_what_they_return(home, files):
    write_job(home, files)
    d = state.JobDir(JOB)
    job = d.read_job()
    assert job is None or isinstance(job, dict)
    for i in d.incidents():  # each field checked by the codec (test_codec.py)
        json.dumps(i.view(), indent=2)  # nothing nested too deep to print
    assert isinstance(d.telemetry(), dict)
    n, series = d.read_history()
    assert n >= 0
    for rank, s in series.items():
        assert is_int(rank) and len({len(v) for v in s.values()}) == 1
        assert all(is_num(t) for t in s["t"])
        assert all(x is None or is_int(x) for x in s["step"])
        assert all(x is None or isinstance(x, str) for x in s["phase"])
        for col in ("loss", "step_s", "age_s", "ratio"):
            assert all(x is None or is_num(x) for x in s[col])
    for j in state.list_jobs():
        assert isinstance(j["job"], str)
        assert isinstance(state.live_status(j), str)


@HOSTILE
@example(pid=True)
@example(pid="12")
@example(pid=-1)
@example(pid=1e30)
@example(pid=10**30)
@given(pid=st.one_of(PIDS, json_values))
def test_a_launcher_pid_that_is_not_a_live_pid_is_lost(pid):
    assume(not (is_int(pid) and 0 < pid < 2**31 and os.path.exists(f"/proc/{pid}")))
    for status in ("running", "starting", "restarting"):
        assert state.live_status({"status": status, "launcher_pid": pid}) == "lost"
    assert state.live_status({"status": "running", "launcher_pid": os.getpid()}) == "running"


@HOSTILE
@given(status=json_values)
def test_live_status_is_a_status_string(status):
    s = state.live_status({"status": status, "launcher_pid": DEAD_PID})
    assert s == ("?" if not isinstance(status, str) else "lost" if status in ("running", "starting", "restarting")
                 else status)


# ---- rankrow.py, historyfile.py -------------------------------------------------------


@HOSTILE
@given(value=st.one_of(RANK_ROW, json_values))
def test_rank_rows_from_json_are_typed_or_skipped(value):
    row = rankrow.from_json(value)
    if row is not None:
        assert is_int(row.rank) and is_int(row.pid) and is_int(row.step) and isinstance(row.node, str)
        for name in ("loss", "grad_norm", "step_s", "compute_s", "heartbeat_age_s", "cpu_s"):
            assert getattr(row, name) is None or is_num(getattr(row, name))
        for name in ("last_progress_s", "last_step_s", "phase_s"):
            assert is_num(getattr(row, name))
        json.dumps(row.to_json(), allow_nan=False)
    out = rankrow.rows_from_json([value, value])
    assert len(out) == (0 if row is None else 2)


@HOSTILE
@given(data=st.lists(jsonl_bytes(HISTORY_SAMPLE), min_size=1, max_size=2))
def test_history_samples_are_typed_or_skipped(tmp_path, data):
    paths = []
    for i, b in enumerate(data):
        (tmp_path / f"{i}.jsonl").write_bytes(b)
        paths.append(tmp_path / f"{i}.jsonl")
    samples = historyfile.read_samples(paths + [tmp_path / "missing.jsonl", tmp_path])
    assert all(is_num(s["t"]) and isinstance(s["r"], list) for s in samples)
    for rank, s in historyfile.per_rank(samples).items():
        assert is_int(rank)
        assert all(x is None or is_int(x) for x in s["step"])
        for col in ("loss", "step_s", "age_s", "ratio"):
            assert all(x is None or is_num(x) for x in s[col])
        assert all(x is None or isinstance(x, str) for x in s["phase"])


# ---- slots.py: the segment header against the file ------------------------------------


@HOSTILE
@example(header=(slots.MAGIC, slots.LAYOUT_VERSION, 0, slots.SLOT_SIZE), body=0)
@example(header=(slots.MAGIC, slots.LAYOUT_VERSION, 2**32 - 1, slots.SLOT_SIZE), body=slots.SLOT_SIZE)
@example(header=(slots.MAGIC, slots.LAYOUT_VERSION, 3, slots.SLOT_SIZE), body=2 * slots.SLOT_SIZE)
@given(header=st.tuples(st.one_of(st.just(slots.MAGIC), st.binary(min_size=8, max_size=8)),
                        st.one_of(st.just(slots.LAYOUT_VERSION), st.integers(0, 2**32 - 1)),
                        st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
                        st.one_of(st.just(slots.SLOT_SIZE), st.integers(0, 2**32 - 1))),
       body=st.one_of(st.integers(0, 8).map(lambda n: n * slots.SLOT_SIZE), st.integers(0, 5000)))
def test_a_segment_header_that_does_not_fit_its_file_is_a_value_error(tmp_path, header, body):
    path = tmp_path / "seg"
    path.write_bytes(slots.HEADER.pack(*header).ljust(slots.HEADER_SIZE, b"\0") + bytes(body))
    check_segment(path)


@HOSTILE
@given(data=st.binary(max_size=slots.HEADER_SIZE + 2 * slots.SLOT_SIZE))
def test_a_segment_of_any_bytes_is_a_value_error_or_a_segment(tmp_path, data):
    path = tmp_path / "seg"
    path.write_bytes(data)
    check_segment(path)


def check_segment(path: Path) -> None:
    try:
        seg = slots.Segment(str(path))
    except ValueError as e:
        assert str(path) in str(e)
        return
    try:
        assert 1 <= seg.nslots and slots.HEADER_SIZE + seg.nslots * slots.SLOT_SIZE <= path.stat().st_size
        assert len(seg.read_table()) == seg.nslots
    finally:
        seg.close()


# ---- checkpoint.py: the readers ---------------------------------------------------------


STATE_BYTES = b"not really a torch file"
MANIFEST = shaped({
    "format": checkpoint.FORMAT, "step": 30, "kind": "periodic", "time": T0, "world_size": 2, "rank": 0,
    "replicated": True,
    "files": st.dictionaries(
        st.one_of(st.sampled_from(["state.pt", "", ".", "..", "a/b", "\x00", "sub", "missing.pt", "\udcff"]), texts),
        st.one_of(shaped({"sha256": hashlib.sha256(STATE_BYTES).hexdigest(), "bytes": len(STATE_BYTES)}),
                  shaped({"sha256": "0" * 64, "bytes": st.just("DIRSIZE")}), json_values),
        max_size=3),
})


@HOSTILE
@example(manifest=b'{"format": 1, "step": 30, "files": {"": {"sha256": "x", "bytes": "DIRSIZE"}}}')
@example(manifest=b'{"format": 1, "step": 30, "files": {"state.pt": 5}}')
@example(manifest=b'{"format": 1, "step": 30, "files": {"\\u0000": {"bytes": 1}}}')
@example(manifest=b'{"format": 1, "step": true, "kind": [], "files": {"state.pt": {"bytes": 23}}}')
@given(manifest=file_bytes(MANIFEST))
def test_a_manifest_of_any_shape_is_a_checkpoint_error(tmp_path, manifest):
    root = tmp_path / "ckpts"
    shutil.rmtree(root, ignore_errors=True)
    ckpt = root / "step-00000030"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "state.pt").write_bytes(STATE_BYTES)
    dir_size = str(ckpt.stat().st_size).encode()
    (ckpt / checkpoint.MANIFEST).write_bytes(manifest.replace(b'"DIRSIZE"', dir_size))
    try:
        info = checkpoint.verify_checkpoint(ckpt)
    except checkpoint.CheckpointError as e:
        assert str(ckpt) in str(e)
        info = None
    if info is not None:
        assert is_int(info.step) and info.kind in checkpoint.KINDS and info.file.read_bytes() == STATE_BYTES
    warnings: list[str] = []
    found = checkpoint.find_latest(root, warn=warnings.append)
    assert (found is None) == (info is None) and len(warnings) == (info is None)
    try:
        files = checkpoint._manifest_files(ckpt)
    except checkpoint.CheckpointError:
        return
    assert isinstance(files, dict) and all(isinstance(m, dict) for m in files.values())


# ---- the sidecar's own files ------------------------------------------------------------


def shaped_nested(value):
    if isinstance(value, dict):
        return shaped({k: shaped_nested(v) for k, v in value.items()})
    return st.just(value)


@HOSTILE
@given(data=file_bytes(shaped_nested(SidecarConfig().to_json())))
def test_a_sidecar_config_file_is_a_config_or_a_value_error(tmp_path, data):
    path = tmp_path / "sidecar-config.json"
    path.write_bytes(data)
    try:
        config = SidecarConfig.read(path)
    except ValueError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return
    assert isinstance(config, SidecarConfig)


EXIT = shaped({"rank": 1, "local_rank": 1, "pid": DEAD_PID, "exitcode": -9, "signal_name": "SIGKILL", "node": "n0",
               "first": True})


@HOSTILE
@example(line=b'{"rank": Infinity, "local_rank": 0, "pid": 1, "exitcode": 1}')
@example(line=b'{"rank": true, "local_rank": 0, "pid": 1, "exitcode": 1, "signal_name": ["SIGTERM"]}')
@given(line=st.one_of(as_bytes(EXIT), st.binary(max_size=80), as_bytes(json_values)))
def test_an_exits_line_is_a_typed_rank_exit_or_skipped(line):
    e = sidecar._rank_exit(line, "n0")
    if e is not None:
        assert isinstance(e, RankExit)
        assert all(is_int(getattr(e, f)) for f in ("rank", "local_rank", "pid", "exitcode"))
        assert e.signal_name is None or isinstance(e.signal_name, str)
        assert isinstance(e.node, str) and isinstance(e.first, bool)


PHASE_ENTRY = shaped({"p99_s": st.sampled_from([1.5, 0.0, -1.0, 1e-300, 1e30]), "samples": 12})
THRESHOLDS = shaped({"version": 1, "updated": T0, "phases": shaped(
    {"checkpoint": PHASE_ENTRY, "eval": PHASE_ENTRY, "backward": PHASE_ENTRY, "\udcff": PHASE_ENTRY})})


@HOSTILE
@example(data=b'{"version": 1, "phases": {"checkpoint": {"p99_s": 1e999, "samples": 12}}}')
@example(data=b'{"version": 1, "phases": {"eval": {"p99_s": 2, "samples": 1' + b"0" * 5000 + b'}}}')
@given(data=file_bytes(THRESHOLDS))
def test_a_thresholds_file_is_learnt_lengths_or_a_logged_skip(tmp_path, data):
    path = tmp_path / "thresholds.json"
    path.write_bytes(data)
    learnt = thresholds.read(path)
    assert isinstance(learnt, dict) and set(learnt) <= set(LEARNT_PHASES)
    for value, samples in learnt.values():
        assert isinstance(value, float) and 0 < value <= thresholds.MAX_SECONDS
        assert is_int(samples) and samples > 0
    # whatever it holds, a detector seeded with it stays between the floor and the fixed allowance
    persisted = thresholds.Persisted(path, [HangDetector()])
    limits = persisted.detector.phases.limits(5.0, 3.0)
    assert ((limits >= 5.0) | np.isinf(limits)).all()
    json.dumps(persisted.describe(), allow_nan=False)
    assert path.read_bytes() == data  # reading never rewrites it


# ---- the commands that read a job directory ----------------------------------------------


def one_error_line_or_success(rc: int, err: str) -> None:
    assert rc in (0, 2), rc
    assert "Traceback" not in err
    if rc == 2:
        assert err.startswith("error: ") and err.count("\n") == 1, err


@HOSTILE
@example(files={"job.json": b'{"job": "j", "status": "running", "launcher_pid": "12", "start_time": "x", '
                            b'"world_size": 1e30, "restarts": "many", "entrypoint": "a \\udcff"}',
                "events.jsonl": b'{"kind": "hang", "culprit_ranks": "x", "evidence": 5, "time": "2024-01-01T00:00:00"}',
                "launch.json": None, "telemetry.json": b'{"ranks": [{"rank": 0, "last_progress_s": 1e999}]}',
                "history/n0.jsonl": b'{"t": NaN, "r": [[0, "x", [], {}, 5, "y", Infinity]]}'})
@example(files={"job.json": b'{"job": "j", "status": "failed", "start_time": 1e30, "end_time": Infinity}',
                "launch.json": None, "telemetry.json": None, "events.jsonl": None,
                "history/n0.jsonl": b'{"t": 1e300, "r": [[0, 1, 1, 1, "x", 1, 1]]}\n{"t": -1e300, "r": []}'})
@given(files=job_files)
def test_commands_on_a_hostile_job_directory_succeed_or_say_one_error_line(home, tmp_path, monkeypatch, capsys, files):
    monkeypatch.setattr(diagnose, "capture_ranks", lambda rows, **kw: ([], tmp_path, {}, rows))  # never py-spy here
    path = write_job(home, files)
    before = snapshot(path)
    out = tmp_path / "page.html"
    for command in (lambda: diagnose.main([JOB]), lambda: diagnose.main([JOB, "--json"]),
                    lambda: report.main([JOB, "--out", str(out)]), lambda: jobs.main([]),
                    lambda: jobs.main(["--json"])):
        capsys.readouterr()
        rc = command()
        captured = capsys.readouterr()
        one_error_line_or_success(rc, captured.err)
    text = summary.failure_summary(JOB, 1, 3)
    text.encode()  # printable as it is
    after = snapshot(path)
    before.pop("job.json", None), after.pop("job.json", None)  # a reader may mark a dead run `lost`
    assert after == before
