"""One live run per job name, and what a dead run leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainwatch import liveness, slots, state


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_HOME", str(tmp_path))
    monkeypatch.setenv("TRAINWATCH_TARGETS_DIR", str(tmp_path / "targets"))
    return tmp_path


def test_a_second_run_of_a_live_name_is_refused_naming_the_launcher(home):
    job = state.JobDir("one")
    lock = liveness.acquire(job)
    try:
        with pytest.raises(state.StateError, match=rf"already running \(launcher pid {os.getpid()}\)"):
            liveness.acquire(job)
        assert liveness.is_held(job)
    finally:
        lock.release()
    assert not liveness.is_held(job)
    liveness.acquire(job).release()  # free again


def test_the_lock_goes_with_a_killed_launcher(home):
    job = state.JobDir("k")
    code = ("import sys, time; from trainwatch import liveness, state; "
            "liveness.acquire(state.JobDir('k')); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TRAINWATCH_HOME": str(home)})
    try:
        assert proc.stdout.readline().strip() == "held"
        assert liveness.is_held(job) and liveness.holder_pid(job) == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert not liveness.is_held(job)


def test_a_dead_run_is_marked_lost_and_its_leftovers_removed(home):
    job = state.JobDir("dead").create()
    seg = f"/dev/shm/trainwatch-{os.getuid()}-dead@n-{os.urandom(4).hex()}.slots"
    slots.create_segment(seg, 1)
    target = state.write_scrape_target("dead", "n", "127.0.0.1:1")
    job.update_job(status="running", slots=seg, node="n", launcher_pid=999999)
    assert liveness.status(job) == "lost"
    assert not os.path.exists(seg) and not target.exists()
    assert job.read_job()["status"] == "lost"


def test_a_job_json_cannot_point_the_reaper_elsewhere(home, tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    job = state.JobDir("evil").create()
    job.update_job(status="running", slots=str(victim), node="../../etc")
    assert liveness.status(job) == "lost"
    assert victim.read_text() == "keep me"


def test_a_planted_segment_path_is_refused_not_followed(tmp_path):
    target = tmp_path / "target"
    target.write_text("not yours")
    link = tmp_path / "seg"
    os.symlink(target, link)
    with pytest.raises(ValueError, match="refusing to use"):
        slots.create_segment(str(link), 2)
    assert target.read_text() == "not yours"
    plain = tmp_path / "plain"
    plain.write_text("x")
    with pytest.raises(ValueError, match="already exists"):
        slots.create_segment(str(plain), 2)


def test_a_new_run_never_reads_an_earlier_runs_control_records(home):
    job = state.JobDir("ctl").create()
    for path in (job.exits_file, job.restart_request_file, job.restart_timing_file, job.faults_file):
        path.write_text("{}\n")
    job.start_run()
    assert not any(p.exists() for p in (job.exits_file, job.restart_request_file, job.restart_timing_file))


def test_sidecar_reads_only_exits_of_its_run():
    from trainwatch.watchdog.sidecar import _rank_exit

    line = b'{"rank": 1, "local_rank": 1, "pid": 5, "exitcode": 1, "run": "old"}'
    assert _rank_exit(line, "n", "new") is None
    assert _rank_exit(line, "n", "old").rank == 1


def test_die_with_parent_kills_an_orphan(tmp_path):
    """A child that asked to die with its parent is gone when the parent is SIGKILLed."""
    code = r'''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, time; from trainwatch import procctl; procctl.die_with_parent(9, os.getppid()); "
    "print(os.getpid(), flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(60)
'''
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child_pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        os.kill(child_pid, 9)
        raise AssertionError("the orphan outlived its parent")


def test_exporter_closes_idle_connections_and_queues_many(monkeypatch):
    import socket as socketlib

    from prometheus_client.registry import Collector

    from trainwatch.watchdog import exporter

    class Empty(Collector):
        def collect(self):
            return iter(())

    monkeypatch.setattr(exporter._Handler, "timeout", 0.5)
    server = exporter.serve_metrics(Empty(), "127.0.0.1", 0)
    try:
        assert server.request_queue_size >= 256
        idle = socketlib.create_connection(("127.0.0.1", server.server_port))
        idle.settimeout(10)
        assert idle.recv(1) == b""  # closed by the server, not held open forever
        idle.close()
    finally:
        server.shutdown()
        server.server_close()


def test_an_ended_runs_leftover_segment_is_removed_and_no_other_jobs(home):
    job = state.JobDir("ended").create()
    mine = f"/dev/shm/trainwatch-{os.getuid()}-ended@n-{os.urandom(4).hex()}.slots"
    other = f"/dev/shm/trainwatch-{os.getuid()}-other@n-{os.urandom(4).hex()}.slots"
    for seg in (mine, other):
        slots.create_segment(seg, 1)
    try:
        job.update_job(status="failed", slots=mine, node="n")
        assert liveness.status(job) == "failed"
        assert not os.path.exists(mine)
        job.update_job(slots=other)  # a record pointing at another job's segment
        liveness.status(job)
        assert os.path.exists(other)
    finally:
        for seg in (mine, other):
            if os.path.exists(seg):
                os.unlink(seg)
