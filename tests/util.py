"""Helpers shared by the end-to-end tests: run trainwatch as a user would."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent


def env_for(home: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.update(
        TRAINWATCH_HOME=str(home),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        LOGLEVEL="WARNING",
    )
    env.update(extra)
    return env


def trainwatch(home: Path, *args: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "trainwatch"), *args],
        env=env_for(home, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )


def start(home: Path, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "trainwatch"), *args],
        env=env_for(home, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        start_new_session=True,
    )


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll a condition with a hard bound; returns its truthy value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def open_gauge(job_rec: dict) -> dict[str, float]:
    """The exporter's open incidents by kind (`trainwatch_incident_open`), from the job record's metrics address."""
    import re

    import requests

    text = requests.get(f"http://{job_rec['metrics']}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'trainwatch_incident_open\{.*kind="(\w+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def job_json(home: Path, job: str) -> dict | None:
    try:
        return json.loads((home / "jobs" / job / "job.json").read_text())
    except (OSError, ValueError):
        return None


def events(home: Path, job: str) -> list:
    """The job's incidents (typed records), each with its actions' results merged in (as diagnose reads them)."""
    from trainwatch import state

    return state.JobDir(job, root=home).incidents()


def acted(home: Path, job: str, kind: str, key: str = "verdict") -> list:
    """Incidents of `kind` whose response (capture/verdict, checkpoint, restart) has been recorded."""
    return [e for e in events(home, job) if e.kind == kind and getattr(e, key) is not None]


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the launcher (it stops its ranks and sidecar), then SIGKILL
    whatever is left in its process group so nothing outlives a test."""
    import os
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def reap(home: Path) -> None:
    """After a launcher was killed: the next reader marks its run lost and removes
    its shared-memory segment and target file (a test leaves none behind)."""
    subprocess.run([str(BIN / "trainwatch"), "jobs"], env=env_for(home), capture_output=True, timeout=60,
                   cwd=str(ROOT))


@contextlib.contextmanager
def running_plain_job(home: Path, job: str):
    """A real 2-rank `trainwatch launch` of the unmodified DDP script, running
    until the block ends; yields job.json once the exporter address is recorded."""
    log_path = home.parent / f"{job}-launch.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "trainwatch"), "launch", "--nproc-per-node", "2", "--metrics-port", "0", "--job", job,
             str(SCRIPTS / "plain_ddp.py"), "--steps", "100000", "--sleep", "0.05"],
            env=env_for(home), stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True,
        )
    try:
        def recorded():
            if proc.poll() is not None:
                raise AssertionError(f"launch exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            rec = job_json(home, job)
            return rec if rec and rec.get("metrics") else None

        yield wait_for(recorded, 120, interval=0.2, what="the metrics address in job.json")
    finally:
        stop_group(proc)
        reap(home)


@contextlib.contextmanager
def prometheus_server(cfg_dir: Path, config: str):
    """A real Prometheus on 127.0.0.1 running `config` (written to cfg_dir/prometheus.yml,
    beside whatever rule files the caller put there); yields its URL."""
    import shutil

    import requests

    from trainwatch import netbind

    binary = shutil.which("prometheus")
    if binary is None:
        import pytest

        pytest.skip("prometheus not installed (Debian package `prometheus`)")
    (cfg_dir / "prometheus.yml").write_text(config)
    port = netbind.free_port()
    log_path = cfg_dir / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={cfg_dir / 'prometheus.yml'}", f"--storage.tsdb.path={cfg_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                return requests.get(f"{url}/-/ready", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        wait_for(ready, 60, interval=0.2, what="prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Clock:
    """A clock a test sets by hand, for code that takes one."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def scripted_detector():
    """A detector that reports what the test puts in its `next` list, once."""
    from trainwatch.watchdog.detectors.base import Detector

    class Scripted(Detector):
        name = "scripted"

        def __init__(self) -> None:
            self.next: list = []

        def check(self, view):
            out, self.next = self.next, []
            return out

    return Scripted()
