"""Every input has a bound, and every setting a range.

The config file (`--config`, TRAINWATCH_CONFIG) is a regular file of at most
1 MiB: a FIFO, a device or a directory is named in one line before anything is
read from it. Free text in incidents (events.jsonl, the job store) and in
job.json is cut with a visible note when written and when read, and a line
too long to be one of trainwatch's is skipped while read, never held whole.
The console's start-up line escapes what the user typed.
"""

from __future__ import annotations

import json
import os
import threading
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch import codec, flags, records, state
from trainwatch.launcher.launch import start_line
from trainwatch.views import diagnose

from util import trainwatch

SCRIPT = "tests/scripts/plain_ddp.py"
QUICK = settings(max_examples=60, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def read_in_thread(path: str, seconds: float = 10.0) -> str:
    """read_toml's error for path, from a thread, so a reader that blocks fails the test instead of hanging it."""
    result: list = []

    def run():
        try:
            result.append(flags.read_toml(path))
        except ValueError as e:
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert result, f"reading {path} blocked"
    assert isinstance(result[0], ValueError), result[0]
    return str(result[0])


# ---- the config file --------------------------------------------------------------------


def test_a_fifo_a_device_or_a_directory_is_named_not_read(tmp_path):
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    for path, what in ((str(fifo), "is a FIFO"), ("/dev/zero", "is a character device"),
                       (str(tmp_path), "is a directory")):
        message = read_in_thread(path)
        assert message.startswith(f"{path}: {what}") and "regular TOML file" in message and "\n" not in message


def test_a_file_over_the_cap_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "big.toml"
    path.write_bytes(b"[launch]\n" + b"# padding\n" * (flags.MAX_CONFIG_BYTES // 10 + 1))
    with pytest.raises(ValueError, match="too large for a config file"):
        flags.read_toml(str(path))
    path.write_bytes(b"[watchdog]\ntick_s = 0.2\n" + b"#" * (flags.MAX_CONFIG_BYTES - 100) + b"\n")
    assert flags.read_toml(str(path)) == {"watchdog": {"tick_s": 0.2}}  # just under the cap: read


@QUICK
@given(head=st.binary(max_size=300), pad=st.sampled_from([0, 1000, flags.MAX_CONFIG_BYTES - 50,
                                                          flags.MAX_CONFIG_BYTES + 1]),
       tail=st.binary(max_size=50))
def test_any_bytes_are_a_config_or_one_line_naming_the_file(tmp_path, head, pad, tail):
    path = tmp_path / "fuzz.toml"
    path.write_bytes(head + b"\n" + b"#" * pad + b"\n" + tail)
    try:
        data = flags.read_toml(str(path))
    except ValueError as e:
        assert str(e).startswith(str(path)) and "\n" not in str(e), str(e)
    else:
        assert isinstance(data, dict)


def test_launch_with_dev_zero_as_its_config_is_one_error_line(tmp_path):
    for argv, extra in ((["--config", "/dev/zero"], {}), ([], {"TRAINWATCH_CONFIG": "/dev/zero"})):
        r = trainwatch(tmp_path, "launch", *argv, "--print-config", SCRIPT, timeout=60, **extra)
        assert r.returncode == 2, r.stderr
        assert r.stderr.splitlines() == ["error: /dev/zero: is a character device, not a config file; give a "
                                         "regular TOML file"], r.stderr
    odd = str(tmp_path / "x\x1b]0;owned\x07.toml")
    r = trainwatch(tmp_path, "launch", "--config", odd, "--print-config", SCRIPT, timeout=60)
    assert r.returncode == 2 and "\x1b" not in r.stderr and "\x07" not in r.stderr and "\\x1b]0;owned" in r.stderr


# ---- free text in records ------------------------------------------------------------------


def test_an_incident_is_written_with_its_text_cut_and_a_note():
    huge = "s" * 100_000
    line = records.Incident(kind="hang", summary=huge, evidence={"why": huge, huge: 1}, category=huge,
                            runbook=huge).to_json()
    assert len(line["summary"]) == records.SUMMARY_CHARS and line["summary"].endswith("… (cut, 100000 chars)")
    assert len(line["category"]) == len(line["runbook"]) == records.NAME_CHARS
    assert all(len(k) <= records.TEXT_CHARS for k in line["evidence"])
    assert len(line["evidence"]["why"]) == records.TEXT_CHARS
    assert len(json.dumps(line)) < 10_000
    verdict = records.Verdict(category="hang", summary=huge, evidence=[huge]).to_json()
    assert len(verdict["summary"]) == records.SUMMARY_CHARS and len(verdict["evidence"][0]) == records.TEXT_CHARS


def test_an_incident_is_read_with_its_text_cut_and_a_long_line_skipped_in_bounded_memory(tmp_path):
    path = tmp_path / "events.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "hang", "id": "a", "summary": "x" * 500_000,
                            "evidence": {"note": "y" * 500_000}}) + "\n")
        f.write(json.dumps({"kind": "hang", "id": "b", "summary": "z" * (20 << 20)}) + "\n")  # an 20 MB line
        f.write(json.dumps({"kind": "crash", "id": "c", "summary": "ok"}) + "\n")
    tracemalloc.start()
    try:
        incidents = records.read_events(state.read_jsonl(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [i.id for i in incidents] == ["a", "c"]
    assert incidents[0].summary.endswith("… (cut, 500000 chars)") and len(incidents[0].summary) == 2000
    assert len(incidents[0].evidence["note"]) == records.TEXT_CHARS
    assert peak < 8 << 20, peak  # the 20 MB line was never held


def test_diagnose_of_a_job_with_a_huge_summary_prints_a_bounded_answer(home, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(diagnose, "capture_ranks", lambda rows, **kw: ([], tmp_path, {}, rows))
    job = state.JobDir("j").create()
    state.write_json_atomic(job.job_file, {"job": "j", "status": "failed", "start_time": 1.0, "end_time": 2.0,
                                           "entrypoint": "train.py " + "a" * 100_000})
    line = {"kind": "hang", "id": "i1", "summary": "s" * 800_000, "time": "2026-01-01T00:00:00+00:00"}
    job.events_file.write_text(json.dumps(line) + "\n")
    for argv in (["j"], ["j", "--json"]):
        capsys.readouterr()
        assert diagnose.main(argv) == 0
        out = capsys.readouterr().out
        assert len(out) < 40_000 and "(cut, 800000 chars)" in out, len(out)


def test_job_json_text_is_cut_when_written_and_when_read(home):
    job = state.JobDir("j").create()
    job.update_job(entrypoint="e" * 50_000)
    written = json.loads(job.job_file.read_text())["entrypoint"]
    assert len(written) == state.JOB_TEXT_CHARS and written.endswith("(cut, 50000 chars)")
    state.write_json_atomic(job.job_file, {"job": "j", "node": "n" * 50_000, "ranks": [{"rank": 0}]})
    read = job.read_job()
    assert len(read["node"]) == state.JOB_TEXT_CHARS and read["ranks"] == [{"rank": 0}]


@QUICK
@given(data=st.binary(max_size=400) | st.lists(st.sampled_from([b'{"kind": "hang", "summary": "', b"x" * 3000,
                                                                 b'"}', b"\n", b'{"kind": "action", "incident": "',
                                                                 b'\xff', b"[", b"{"]), max_size=12).map(b"".join))
def test_any_events_file_is_incidents_or_skipped_lines(tmp_path, data):
    path = tmp_path / "events.jsonl"
    path.write_bytes(data)
    for incident in records.read_events(state.read_jsonl(path, max_line=2000)):
        assert len(incident.summary) <= records.SUMMARY_CHARS and len(incident.kind) <= records.NAME_CHARS


@QUICK
@given(text=st.text(max_size=300), limit=st.integers(min_value=1, max_value=200))
def test_cut_text_fits_its_bound_and_says_so(text, limit):
    out = codec.cut(text, limit)
    assert len(out) <= limit
    assert out == text or (len(text) > limit and (f"(cut, {len(text)} chars)" in out or len(out) == limit))


# ---- the console ---------------------------------------------------------------------------


def test_the_start_line_escapes_the_script_and_its_arguments():
    line = start_line("j", "tr\x1b[2Jain.py --title \x1b]0;x\x07 \u202e\nnext", 2, "/home/u/.trainwatch/jobs/j")
    assert "\x1b" not in line and "\x07" not in line and "\u202e" not in line and "\n" not in line
    assert "tr\\x1b[2Jain.py" in line and line.startswith("[trainwatch] job j: ")
