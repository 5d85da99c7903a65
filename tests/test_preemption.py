"""A preemption is part of the job's story: the launcher's `preempted` record
(signal, checkpoint saved or not, step) is what `diagnose`, `jobs`, the report
and the metrics say; the next run of the job clears it; a second stop signal
never cuts the preemption checkpoint short."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import time
import types

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainwatch import slots, state
from trainwatch.cli import main
from trainwatch.diagnostics import preemption
from trainwatch.launcher import agent as agent_mod
from trainwatch.launcher import launch
from trainwatch.views import report
from trainwatch.watchdog.exporter import TrainwatchCollector
from trainwatch.watchdog.sidecar import Sidecar

from slot_tables import make_table

WRITTEN = {"requested": [0, 1], "no_state": [], "written": {"0": 120, "1": 120}, "failed": {}, "step": 120,
           "seconds": 0.4}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path))
    return tmp_path


def preempted_job(name: str, result: dict = WRITTEN) -> state.JobDir:
    d = state.JobDir(name).create()
    d.update_job(status="stopped", start_time=time.time() - 60, end_time=time.time(), exit_code=75,
                 launcher_pid=999999999, entrypoint="train.py",
                 preempted=preemption.record("SIGTERM", result, "emergency checkpoint of step 120 by 2 of 2 rank(s)",
                                             0.4, time.time()))
    return d


def test_diagnose_says_preempted_with_its_own_runbook_not_a_hang(home, capsys):
    preempted_job("pre-diag")
    assert main(["diagnose", "pre-diag", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    v = out["verdict"]
    assert v["category"] == "preempted" and v["runbook"] == "preempted" and v["confidence"] >= 0.9
    assert "SIGTERM" in v["summary"] and "saved at step 120" in v["summary"] and "--job pre-diag" in v["summary"]
    assert out["preempted"]["signal"] == "SIGTERM" and out["preempted"]["saved"] is True
    assert out["preempted"]["step"] == 120
    assert main(["diagnose", "pre-diag"]) == 0
    text = capsys.readouterr().out
    assert "(stopped, preempted)" in text and "verdict: preempted" in text and "runbook preempted" in text
    assert main(["runbook", "preempted"]) == 0 and "Job preempted" in capsys.readouterr().out


def test_a_preemption_without_a_checkpoint_says_nothing_was_saved(home, capsys):
    preempted_job("pre-none", {"requested": [], "no_state": [0, 1], "written": {}, "failed": {}, "step": None})
    assert main(["diagnose", "pre-none", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["verdict"]
    assert v["category"] == "preempted" and "no checkpoint saved" in v["summary"]
    assert "its own last checkpoint" in v["summary"]


def test_jobs_and_the_report_say_the_preemption(home, capsys):
    preempted_job("pre-list")
    assert main(["jobs"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("pre-list "))
    assert row.split()[1] == "preempted"
    assert "pre-list: preempted by SIGTERM: checkpoint saved at step 120" in out
    data = report.collect("pre-list")
    assert data["preempted"] == "preempted by SIGTERM: checkpoint saved at step 120"
    assert "<dt>preempted</dt><dd>preempted by SIGTERM: checkpoint saved at step 120</dd>" in report.render(data)


def scrape(tmp_path, name: str, seq: int) -> dict:
    path = str(tmp_path / f"{name}-{seq}.slots")
    slots.create_segment(path, 2)
    seg = slots.Segment(path)
    try:
        table = make_table(2, now=100.0, step=20)
        table["pid"] = os.getpid()
        np.frombuffer(seg.buf, dtype=slots.slot_dtype(), count=2, offset=slots.HEADER_SIZE)[:] = table
        sc = Sidecar(name, path, node="n0", out=io.StringIO(), clock=lambda: 101.0)
        sc.tick()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(TrainwatchCollector(sc))
        families = text_string_to_metric_families(generate_latest(registry).decode())
        return {(s.labels.get("signal"), s.labels.get("checkpoint")): s.value
                for f in families for s in f.samples if s.name == "trainwatch_preempted"}
    finally:
        seg.close()


def test_the_metrics_say_the_preemption(home, tmp_path):
    state.JobDir("pre-metrics").create().update_job(status="running")
    assert scrape(tmp_path, "pre-metrics", 0) == {("", ""): 0.0}
    preempted_job("pre-metrics")
    assert scrape(tmp_path, "pre-metrics", 1) == {("SIGTERM", "saved"): 1.0}


def test_the_next_run_of_the_job_clears_the_preemption(home, capsys):
    d = preempted_job("pre-again")
    run = types.SimpleNamespace(
        args=argparse.Namespace(module=False, training_script="train.py", training_script_args=[], nnodes="1",
                                max_restarts=0),
        config=types.SimpleNamespace(job="pre-again", faults=[]), job_dir=d, run_id="r2", node="n0")
    launch._record_start(run, d, 2, "/dev/shm/none")
    assert d.read_job()["status"] == "starting" and d.read_job().get("preempted") is None
    assert preemption.of_job(d.read_job()) is None
    assert main(["jobs"]) == 0 and "preempted" not in capsys.readouterr().out


def test_held_signals_note_each_signal_and_restore_the_handlers():
    def before(signum, frame):
        raise AssertionError("the handler from before ran inside the block")

    old = signal.signal(signal.SIGUSR2, before)
    try:
        with agent_mod.held_signals({int(signal.SIGUSR2)}) as during:
            os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR2)
        assert during == [signal.SIGUSR2, signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is before
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_a_second_sigterm_never_aborts_the_preemption_checkpoint(home, monkeypatch, capsys):
    """Two SIGTERMs 30 ms apart: torchelastic's handler raises on each; the
    second comes while the ranks write, and the checkpoint is finished anyway."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    def checkpoint(segment, grace_s, alive):
        time.sleep(0.03)
        os.kill(os.getpid(), signal.SIGTERM)  # the second notice, while the ranks write
        time.sleep(0.05)
        return dict(WRITTEN)

    monkeypatch.setattr(agent_mod, "request_emergency_checkpoint", checkpoint)
    a = object.__new__(agent_mod.TrainwatchAgent)
    a.preempt_signals, a.preempt_grace_s, a.preempted, a.segment = frozenset({int(signal.SIGTERM)}), 5.0, None, None
    a.dir = state.JobDir("pre-twice").create()
    events: list = []
    a._on_event = lambda kind, data: events.append(kind)
    old = signal.signal(signal.SIGTERM, _terminate_process_handler)
    try:
        a._checkpoint_for_preemption(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is _terminate_process_handler
    finally:
        signal.signal(signal.SIGTERM, old)
    record = a.dir.read_job()["preempted"]
    assert record["saved"] is True and record["step"] == 120 and record["signals_during"] == 1
    assert "skipped" not in record["checkpoint"] and events == ["preempted"]
    assert "1 more stop signal(s) held until the checkpoint was done" in capsys.readouterr().out
