"""The console and the readers say each thing once: an incident's kind is not
doubled in front of a summary that already names it, and a failed job is said
failed in one line, with why."""

from __future__ import annotations

import types

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainwatch import records, state
from trainwatch.cli import main
from trainwatch.launcher import launch
from trainwatch.records import JobStatus
from trainwatch.views.summary import failure_summary


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path))
    return tmp_path


def test_a_summary_that_names_its_kind_is_not_prefixed_again():
    assert records.headline("crash", "crash: rank 1 exited") == "crash: rank 1 exited"
    assert records.headline("crash", "rank 1 exited") == "crash: rank 1 exited"
    assert records.headline("hang", "hangs everywhere") == "hang: hangs everywhere"


def test_the_failure_summary_and_diagnose_say_crash_once(home, capsys):
    d = state.JobDir("words-crash").create()
    d.update_job(status="failed", start_time=1.0, launcher_pid=999999999)
    d.append_event({"kind": "crash", "culprit_ranks": [1], "summary": "crash: rank 1 (pid 7) exited with code 1",
                    "time": 2.0})
    text = failure_summary("words-crash", 0, 0)
    assert "last: crash: rank 1 (pid 7) exited with code 1" in text and "crash: crash:" not in text
    assert main(["diagnose", "words-crash"]) == 0
    out = capsys.readouterr().out
    assert "crash: rank 1 (pid 7)" in out and "crash: crash:" not in out


class _Agent:
    preempted = None

    def __init__(self, result):
        self.result = result

    def run(self):
        return self.result


def test_a_failed_job_is_said_failed_once_with_its_exits(home, capsys):
    run = types.SimpleNamespace(config=types.SimpleNamespace(job="words-failed"), ended="")
    failure = ProcessFailure(local_rank=1, pid=7, exitcode=1, error_file="")
    result = RunResult(state=WorkerState.FAILED, failures={1: failure})
    assert launch._run_agent(run, _Agent(result), "localhost:0") == (JobStatus.FAILED, 1)
    said = capsys.readouterr()
    end = launch._end_line(run, JobStatus.FAILED, 2)
    assert end == "[trainwatch] job words-failed failed (rank 1: exit code 1; restarts: 2)"
    assert "failed" not in said.out + said.err  # the end line is the only one that says it
    assert launch._end_line(run, JobStatus.SUCCEEDED, 0) == "[trainwatch] job words-failed succeeded (restarts: 0)"
