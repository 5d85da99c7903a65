"""Readers of inputs trainwatch did not write stay bounded: `explain` reads a
window of any input (head and tail) and ends on an endless one; `report`
streams and thins a history of any size; text from a rank, a log or a state
file reaches a terminal with its control characters escaped."""

from __future__ import annotations

import io
import json
import subprocess
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from trainwatch import historyfile
from trainwatch.usage import printable
from trainwatch.views import explain
from util import BIN, ROOT, env_for


class Endless(io.RawIOBase):
    """A stream that never ends (like /dev/zero), counting what was read."""

    def __init__(self, byte: bytes = b"x"):
        self.byte, self.read_bytes = byte, 0

    def readable(self):
        return True

    def read(self, n=-1):
        n = 1 << 20 if n is None or n < 0 else n
        self.read_bytes += n
        return self.byte * n


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 0.01
        return self.now


def test_a_large_file_is_read_at_both_ends(tmp_path):
    path = tmp_path / "big.log"
    with open(path, "wb") as f:
        f.write(b"HEAD line\n" + b"middle\n" * 500_000 + b"TAIL line\n")
    with open(path, "rb") as f:
        w = explain.read_window(f, 1000)
    assert w.data.startswith(b"HEAD line\n") and w.data.endswith(b"TAIL line\n") and len(w.data) == 1000
    assert w.skipped == path.stat().st_size - 999 and not w.cut_short


def test_an_endless_stream_ends_at_the_scan_limits():
    stream = Endless()
    w = explain.read_window(stream, 1 << 16, scan_s=1.0, clock=Clock())
    assert w.cut_short and len(w.data) == 1 << 16 and stream.read_bytes < 200 << 20
    stream = Endless()
    w = explain.read_window(stream, 1 << 16, scan_bytes=8 << 20)
    assert w.cut_short and stream.read_bytes <= (8 << 20) + 1


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=5000), st.integers(2, 3000))
def test_a_short_input_is_read_whole_and_a_long_one_keeps_its_ends(data, limit):
    w = explain.read_window(io.BufferedReader(io.BytesIO(data)), limit)
    if len(data) <= limit:
        assert w.data == data and w.skipped == 0
    else:
        head = limit // 4
        assert len(w.data) == limit and w.data[:head] == data[:head]
        assert w.data[head + 1:] == data[len(data) - (limit - head - 1):]
        assert w.skipped == len(data) - limit + 1


def test_explain_on_dev_zero_ends_within_seconds_and_says_so():
    t0 = time.monotonic()
    r = subprocess.run([str(BIN / "trainwatch"), "explain", "/dev/zero", "--json"], capture_output=True, text=True,
                       timeout=120, cwd=str(ROOT), env=env_for(ROOT))
    took = time.monotonic() - t0
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert any("stopped reading" in e for e in json.loads(r.stdout)["errors"])
    print(f"explain /dev/zero: {took:.1f} s")


def test_explain_escapes_what_a_log_says_before_it_reaches_the_terminal(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_bytes(b"\x1b]0;owned\x07\x1b[2J[rank0]: RuntimeError: CUDA error: an illegal memory access was "
                    b"encountered \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\n")
    out = io.StringIO()
    assert explain.main([str(log)], out=out, err=io.StringIO()) == 0
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text, text


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_printable_leaves_no_control_character(text):
    shown = printable(text)
    assert not any(ord(c) < 32 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f for c in shown)
    assert "\n" not in printable(text, newlines=False)
    shown.encode("utf-8")  # always encodable


def _write_history(path: Path, samples: int, ranks: int = 4) -> None:
    with open(path, "w") as f:
        for i in range(samples):
            rows = [[r, i, 1.0 / (i + 1), 0.1, "compute", 0.0, 1.0] for r in range(ranks)]
            f.write(json.dumps({"t": 1000.0 + i, "r": rows}) + "\n")


def test_history_is_thinned_evenly_while_streaming(tmp_path):
    path = tmp_path / "n0.jsonl"
    _write_history(path, 20_000)
    with open(path, "a") as f:
        f.write("{torn\n" + "x" * (historyfile.MAX_LINE_BYTES + 10) + "\n")
    _write_history(tmp_path / "n1.jsonl", 10)
    total, samples = historyfile.read_thinned([path, tmp_path / "n1.jsonl", tmp_path / "missing.jsonl"], 100)
    assert total == 20_011  # the torn line counts, the over-long one is skipped unread
    ts = [s["t"] for s in samples]
    assert ts == sorted(ts) and 100 <= len(samples) <= 2 * 100 + 10, len(samples)
    assert ts[0] == 1000.0 and max(ts) >= 1000 + 20_000 - 20_000 // 100  # the span is kept
    late = [t for t in ts if t > 1010]  # node 0's only
    gaps = {b - a for a, b in zip(late, late[1:])}
    assert len(gaps) == 1  # evenly


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=50))
def test_any_bytes_in_a_history_file_are_samples_or_skipped(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("h") / "n.jsonl"
    path.write_bytes(b"\n".join(lines))
    total, samples = historyfile.read_thinned([path], 10)
    historyfile.per_rank(samples)
    assert total <= path.read_bytes().count(b"\n") + 1 and all(isinstance(s["r"], list) for s in samples)


def test_diagnose_and_jobs_escape_what_a_state_file_says(tmp_path):
    home = tmp_path / "home"
    job = home / "jobs" / "esc-job"
    job.mkdir(parents=True, mode=0o700)
    evil = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202egnp.exe"
    (job / "job.json").write_text(json.dumps({
        "job": "esc-job", "status": "failed", "start_time": time.time() - 60, "end_time": time.time(),
        "entrypoint": f"train.py {evil}", "nproc_per_node": 1, "exit_code": 1}))
    (job / "events.jsonl").write_text(json.dumps({
        "kind": "crash", "id": "i1", "time": "2026-01-01T00:00:00+00:00", "severity": "critical",
        "culprit_ranks": [0], "summary": f"rank 0 said {evil}", "evidence": {"error": evil}}) + "\n")
    for args in (["diagnose", "esc-job"], ["jobs"]):
        r = subprocess.run([str(BIN / "trainwatch"), *args], capture_output=True, text=True, timeout=120,
                           cwd=str(ROOT), env=env_for(home))
        shown = r.stdout + r.stderr
        assert "Traceback" not in shown and not any(c in shown for c in "\x1b\x07\x9b\u202e"), (args, shown)
        assert "\\x1b" in shown, (args, shown)
