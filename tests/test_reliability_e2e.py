"""A job name owned by one run, no orphans when the launcher dies, loopback-only
stores for a single-node job, and no restart loop into a usage error: real
`trainwatch launch` runs of an unmodified DDP script."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import psutil
import pytest

from util import BIN, SCRIPTS, env_for, events, job_json, running_plain_job, trainwatch, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    return home


def job_processes(launcher_pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def command(p: psutil.Process) -> str:
    """The process's command line, or "" once it has exited (a listed process may end before it is read)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def listening(procs: list[psutil.Process]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            out += [(p.pid, c.laddr.ip) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return out


def test_one_live_run_per_name_no_orphans_and_a_lost_run_cleaned(home):
    job = f"rel-{uuid.uuid4().hex[:8]}"
    with running_plain_job(home, job) as rec:
        launcher = psutil.Process(rec["launcher_pid"])
        # Every listener of a single-node job (launcher's store, rank 0's
        # store, the exporter) is on loopback only.
        procs = [launcher] + wait_for(lambda: len(job_processes(launcher.pid)) >= 3 and job_processes(launcher.pid),
                                      60, what="ranks and sidecar")
        ports = wait_for(lambda: len(listening(procs)) >= 3 and listening(procs), 60, what="three listeners")
        assert {ip for _pid, ip in ports} == {"127.0.0.1"}, ports

        second = trainwatch(home, "launch", "--nproc-per-node", "1", "--job", job,
                            str(SCRIPTS / "plain_ddp.py"), "--steps", "5", timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        err = second.stderr.strip()
        assert err.startswith("error: ") and err.count("\n") == 0, err
        assert f"launcher pid {launcher.pid}" in err
        assert job_json(home, job)["run_id"] == rec["run_id"]  # the live run's state untouched

        children = job_processes(launcher.pid)
        segment = Path(rec["slots"])
        assert segment.exists() and str(rec["run_id"]) in segment.name
        launcher.send_signal(signal.SIGKILL)
        wait_for(lambda: gone(children), 15, what="ranks and sidecar to stop after the launcher's death")

        listing = trainwatch(home, "jobs", "--json")
        assert listing.returncode == 0, listing.stderr
        assert [j["status"] for j in json.loads(listing.stdout) if j["job"] == job] == ["lost"]
        assert not segment.exists()
        assert not list((home / "targets").glob(f"{job}@*.json"))
        assert job_json(home, job)["status"] == "lost"
        diagnosed = trainwatch(home, "diagnose", job, "--json")
        assert json.loads(diagnosed.stdout)["status"] == "lost", diagnosed.stdout[-2000:]

    # The name is free again, and the new run replays nothing of the old one.
    again = trainwatch(home, "launch", "--nproc-per-node", "2", "--job", job, "--metrics-port", "0",
                       str(SCRIPTS / "plain_ddp.py"), "--steps", "20", timeout=240)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    rec = job_json(home, job)
    assert rec["status"] == "succeeded" and rec.get("restarts", 0) == 0
    assert events(home, job) == []


def test_a_rank_that_keeps_exiting_with_a_usage_error_gets_one_restart(home, tmp_path):
    script = tmp_path / "bad_flag.py"
    script.write_text("import sys\nprint('error: --data must exist', file=sys.stderr)\nsys.exit(2)\n")
    job = f"usage-{uuid.uuid4().hex[:8]}"
    proc = trainwatch(home, "launch", "--nproc-per-node", "1", "--max-restarts", "5", "--job", job,
                      "--metrics-port", "0", str(script), timeout=240)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "not restarting into the same failure" in out, out[-4000:]
    assert out.count("restarting worker group (restart") == 1, out[-4000:]
    assert job_json(home, job)["status"] == "failed"


def test_ranks_of_a_launch_die_with_it_even_when_the_sidecar_is_killed_first(home):
    job = f"side-{uuid.uuid4().hex[:8]}"
    with running_plain_job(home, job) as rec:
        launcher = psutil.Process(rec["launcher_pid"])
        sidecars = wait_for(lambda: [p for p in job_processes(launcher.pid)
                                     if "trainwatch.watchdog.sidecar" in command(p)], 60, what="sidecar")
        sidecars[0].send_signal(signal.SIGKILL)
        # The agent starts a new sidecar; the job goes on.
        wait_for(lambda: [p for p in job_processes(launcher.pid) if p.pid != sidecars[0].pid
                          and "trainwatch.watchdog.sidecar" in command(p)], 60, what="a new sidecar")
        children = job_processes(launcher.pid)
        launcher.send_signal(signal.SIGKILL)
        wait_for(lambda: gone(children), 15, what="every process of the job to stop")
    assert os.environ.get("TRAINWATCH_HOME") != str(home)  # the test never touched the user's home
    assert env_for(home)["TRAINWATCH_HOME"] == str(home)
    assert (BIN / "trainwatch").exists()
