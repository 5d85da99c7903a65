"""Shared helpers for the benchmarks: run `trainwatch launch` as a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def new_home(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"trainwatch-bench-{prefix}-"))


def env_for(home: Path) -> dict:
    env = dict(os.environ)
    env.update(TRAINWATCH_HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


SESSIONS_ENV = "TRAINWATCH_BENCH_SESSIONS"
"""A file where launch() lists each launcher's session id and TRAINWATCH_HOME (one
"PID HOME" line each): a caller that bounds a benchmark's time (gpu_check.py)
ends those sessions when the bound runs out, and reaps what their jobs left."""


def trainwatch_command() -> list[str]:
    """The `trainwatch` command beside this Python, or the module where the
    project is importable without its console script."""
    script = BIN / "trainwatch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainwatch.cli"]


def launch(home: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([*trainwatch_command(), "launch", *args], env=env_for(home), cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if os.environ.get(SESSIONS_ENV):
        with open(os.environ[SESSIONS_ENV], "a") as f:
            f.write(f"{proc.pid} {home}\n")
    return proc


def stop(proc: subprocess.Popen, timeout: float = 60) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    return finish(proc, timeout)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Its output once it ends; its whole process group killed after `timeout`."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out or ""


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def events(home: Path, job: str) -> list[dict]:
    """Incidents with their actions' results merged in."""
    from trainwatch import state

    return state.JobDir(job, root=home).incidents()


def faults_fired(home: Path, job: str) -> list[dict]:
    return read_jsonl(home / "jobs" / job / "control" / "faults.jsonl")


def job_json(home: Path, job: str) -> dict:
    try:
        return json.loads((home / "jobs" / job / "job.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`: a launcher started with
    start_new_session=True and everything it started that kept its session."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(d))
    return pids


def reap(proc: subprocess.Popen, home: Path | None = None, job: str | None = None, timeout: float = 30) -> list[str]:
    """After a launcher's run: nothing of it is left. Its session's processes get
    SIGTERM, then SIGKILL after `timeout` (bounded waits); the run's slot segment
    is removed if the launcher did not. Returns what was left behind (logged)."""
    left = []
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    if not wait_for(lambda: not session_pids(proc.pid), timeout, 0.2):
        pids = session_pids(proc.pid)
        left.append(f"processes {pids} of session {proc.pid}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not session_pids(proc.pid), 10, 0.2)
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    if home is not None and job is not None:
        seg = job_json(home, job).get("slots")
        if seg and os.path.lexists(seg):
            left.append(f"segment {seg}")
            os.unlink(seg)
    for what in left:
        log(f"  LEFTOVER {what}: removed")
    return left
