"""The edges of a job, end to end on real ranks: a stopped rank, diagnose
before the ranks exist and during a restart, a hang that comes back at the
same step after a restart, and a collective skip in an unmodified DDP script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from util import BIN, SCRIPTS, env_for, events, job_json, start, stop_group, wait_for

pytestmark = pytest.mark.slow
PLAIN = str(SCRIPTS / "plain_ddp.py")


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def diagnose(home, job) -> dict | None:
    r = subprocess.run([str(BIN / "trainwatch"), "diagnose", job, "--json"], env=env_for(home),
                       capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else None


def rank_pid(home, job, rank):
    rec = job_json(home, job) or {}
    for r in rec.get("ranks") or []:
        if r["rank"] == rank and rec.get("status") == "running":
            return r["pid"]
    return None


def test_stopped_rank_is_named_stopped_and_torn_down_fast(tmp_path):
    job = name("stop")
    proc = start(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, PLAIN, "--steps", "100000",
                 "--sleep", "0.05")
    try:
        def stepping():
            report = diagnose(tmp_path, job)
            return report if report and report["status"] == "running" and \
                all(r["step"] > 5 for r in report["ranks"]) else None

        wait_for(stepping, 120, interval=0.5, what="both ranks stepping")
        pid = rank_pid(tmp_path, job, 1)
        os.kill(pid, signal.SIGSTOP)
        stopped_seen = wait_for(lambda: (diagnose(tmp_path, job) or {}).get("verdict", {}).get("category")
                                in ("stopped", "hang") or [e for e in events(tmp_path, job) if e.kind == "hang"],
                                60, interval=0.5, what="the stopped rank noticed")
        assert stopped_seen
        hang = wait_for(lambda: [e for e in events(tmp_path, job) if e.kind == "hang"], 60, what="hang incident")[0]
        assert hang.culprit_ranks == [1]
        assert hang.category == "stopped" and hang.runbook == "stopped", hang.summary
        restart = wait_for(lambda: [e for e in events(tmp_path, job) if e.kind == "restart"], 90,
                           what="the restart")[0]
        assert restart.evidence["breakdown"]["teardown_s"] < 5.0, restart.evidence["breakdown"]
        assert restart.evidence["steps_lost"] is None  # zero-code: where it resumed is the script's business
        assert "restarted from its own checkpoint" in restart.summary
    finally:
        stop_group(proc)


def test_diagnose_knows_the_job_from_the_start(tmp_path):
    job = name("early")
    proc = start(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, PLAIN, "--steps", "30")
    try:
        first = wait_for(lambda: diagnose(tmp_path, job), 60, interval=0.05, what="diagnose to know the job")
        assert first["status"] == "starting", first["status"]
        assert first["verdict"]["category"] == "starting"
        assert first["stack_groups"] == []  # no verdict on start-up stacks
        assert proc.wait(timeout=180) == 0
        final = diagnose(tmp_path, job)
        assert final["status"] == "succeeded" and final["verdict"]["category"] == "finished"
    finally:
        stop_group(proc)


def test_the_same_hang_after_a_restart_only_alerts(tmp_path):
    job = name("again")
    proc = start(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, PLAIN, "--steps", "100000",
                 "--sleep", "0.02", "--hang-at", "20", "--hang-rank", "1")
    try:
        hangs = wait_for(lambda: [e for e in events(tmp_path, job) if e.kind == "hang"][1:], 180,
                         what="the hang a second time")
        first, second = [e for e in events(tmp_path, job) if e.kind == "hang"][:2]
        assert first.culprit_ranks == second.culprit_ranks == [1]
        assert first.restart.requested is not False
        assert second.restart.requested is False
        assert "came back after restart 1" in second.restart.why
        during = diagnose(tmp_path, job)  # still hung, alerting: the verdict names the culprit
        assert during["verdict"]["culprit_ranks"] == [1], during["verdict"]
        time.sleep(0)  # nothing to wait for: the agent has not restarted again
        assert (job_json(tmp_path, job) or {}).get("restarts") == 1
        assert len(hangs) == 1
    finally:
        stop_group(proc)
    out = proc.stdout.read() if proc.stdout else ""
    assert "came back after restart 1" in out


def test_collective_skip_in_an_unmodified_ddp_script(tmp_path):
    job = name("skip")
    r = subprocess.run([str(BIN / "trainwatch"), "launch", "--nproc-per-node", "2", "--job", job, "--no-restart",
                        "--inject", "hang:where=collective_skip,rank=1,step=10", PLAIN, "--steps", "40",
                        "--sleep", "0.1"], env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    found = [e for e in events(tmp_path, job) if e.kind == "collective_mismatch"]
    assert found, r.stdout[-3000:]
    assert found[0].culprit_ranks == [1]
    assert found[0].evidence["source"] == "default_pg_seq"
    assert "never fired" not in r.stderr
