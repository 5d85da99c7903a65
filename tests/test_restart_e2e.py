"""Restarts decided by what the script did, end to end with real ranks (gloo):
the same exception from the same line after the script's own resume is a
replayed crash whatever trainwatch's step count says, and spaced faults that
each recovered are restarted without backoff."""

from __future__ import annotations

import json
import os
import re
import uuid

import psutil
import pytest

from trainwatch import state
from trainwatch.launcher import failures
from util import SCRIPTS, job_json, trainwatch

pytestmark = pytest.mark.slow


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def assert_nothing_left(job: str) -> None:
    """No segment of the job in /dev/shm, no process that carries its name."""
    assert not [p for p in os.listdir("/dev/shm") if job in p] if os.path.isdir("/dev/shm") else True
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TRAINWATCH_JOB") == job:
                left.append(p.pid)
        except psutil.Error:
            pass
    assert not left, left


def test_the_same_exception_after_the_scripts_own_resume_stops_after_one_restart(tmp_path):
    job, ckpt = name("replay"), tmp_path / "ckpt"
    ckpt.mkdir()
    script = SCRIPTS / "resume_then_raise.py"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--max-restarts", "3", "--job", job, str(script),
                   "--ckpt", str(ckpt), "--ckpt-every", "4", "--fail-at", "6", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert out.count("restarting worker group (restart") == 1, out[-4000:]
    assert "restarting worker group (restart 1/3, no backoff: " in out
    assert "resumed from its own checkpoint at step 4" in out, out[-4000:]
    line = re.escape(f"{script}:") + r"\d+"
    assert re.search(r"not restarting: rank \d \(" + line + r"\): ValueError: the batch of step 6 holds a bad value "
                     r"\(worker pid \d+\) \(again from the same line after a restart", out), out[-4000:]
    assert re.search(r"error: rank \d \(" + line + r"\): ValueError: .*again from the same line after a restart; "
                     r"not restarted\)", r.stderr), r.stderr[-3000:]
    rec = job_json(tmp_path, job)
    assert rec["status"] == "failed" and rec["restarts"] == 1, rec
    # What made it a replay: trainwatch's step count differs between the two runs, the pid in the message
    # too; the type, the masked message and the line do not.
    recorded = failures.read_failures(state.JobDir(job, root=tmp_path).errors_file, rec["run_id"])
    first = [f for f in recorded if f.generation == 0]
    again = [f for f in recorded if f.generation == 1]
    assert first and again, recorded
    assert {f.step for f in first} == {5} and {f.step for f in again} == {1}, recorded
    assert {f.message for f in first}.isdisjoint(f.message for f in again)
    assert {f.identity for f in first} == {f.identity for f in again}
    assert_nothing_left(job)


def test_spaced_faults_that_each_recovered_restart_without_backoff(tmp_path):
    job = name("spaced")
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--max-restarts", "3", "--job", job,
                   "--inject", "crash:rank=1,step=4,signal=KILL", "--inject", "crash:rank=1,step=8,signal=KILL",
                   str(SCRIPTS / "plain_ddp.py"), "--steps", "14", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "restarting worker group (restart 1/3, no backoff: steps completed since the start)" in out, out[-4000:]
    assert re.search(r"restarting worker group \(restart 2/3, no backoff: steps completed since the last restart "
                     r"and a different failure \(rank 1 killed by SIGKILL at step \d+\)\)", out), out[-4000:]
    assert "backoff:" not in out.replace("no backoff:", ""), out[-4000:]
    timing = json.loads(state.JobDir(job, root=tmp_path).restart_timing_file.read_text())
    assert timing["restart"] == 2 and timing["backoff_s"] == 0, timing
    rec = job_json(tmp_path, job)
    assert rec["status"] == "succeeded" and rec["restarts"] == 2, rec
    assert_nothing_left(job)
