"""Shared helpers for the benchmarks: run `trainwatch launch` as a user would,
and leave nothing behind.

Everything a benchmark starts or makes through these helpers is tracked: the
commands it runs (`launch`, `spawn`, `run_command`: each in a session of its
own) and its scratch directories (`new_home`, under the temp dir as
`trainwatch-bench-*`). A benchmark's entry point runs under `main()`: however
it ends (its last line, an error, Ctrl-C, SIGTERM), `clean_up()` then stops
those sessions (SIGTERM to each process group, SIGKILL after a bound), kills
what is left of the jobs under those homes, reaps the runs whose launcher is
gone as `trainwatch jobs` does (their slot segments in /dev/shm, their
Prometheus target files) and removes the homes, except those `keep()` names
(all of them with TRAINWATCH_BENCH_KEEP=1).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
KEEP_ENV = "TRAINWATCH_BENCH_KEEP"
"""Set to 1: keep every scratch home (for reading a run's files afterwards)."""
STOP_GRACE_S = 30.0
"""Seconds a tracked session has, after SIGTERM, to stop (a launcher stops its ranks and sidecar)."""
KILL_WAIT_S = 10.0
"""Seconds to wait for what SIGKILL ended to be gone."""
SMOKE_HELP = ("the smallest run that still goes through every part of this benchmark (seconds, not "
              "minutes; its figures mean nothing): for tests")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Tracked:
    """What this process started and made, for clean_up()."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.homes: list[Path] = []
        self.kept: set[Path] = set()


_TRACKED = _Tracked()


def new_home(prefix: str) -> Path:
    """A scratch directory (a TRAINWATCH_HOME, a work dir), removed by clean_up()."""
    home = Path(tempfile.mkdtemp(prefix=f"trainwatch-bench-{prefix}-"))
    _TRACKED.homes.append(home)
    return home


def keep(home: Path) -> Path:
    """Keep this home after the benchmark (its path was shown for reading); returns it."""
    _TRACKED.kept.add(Path(home))
    return home


def env_for(home: Path | None, **extra: str) -> dict:
    """The environment of a command run under `home`; `extra` adds variables
    (e.g. TRAINWATCH_JOB_SECRET, which `launch` reads from its environment)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if home is not None:
        env["TRAINWATCH_HOME"] = str(home)
    env.update(extra)
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


def spawn(cmd: list[str], home: Path | None = None, *, env: dict | None = None, **popen) -> subprocess.Popen:
    """`cmd` in a session of its own (its process group is what stop(), reap() and
    clean_up() signal), tracked; run in the repository under `home` unless told."""
    popen.setdefault("cwd", str(ROOT))
    proc = subprocess.Popen(cmd, env=env if env is not None else env_for(home), start_new_session=True, **popen)
    _TRACKED.procs.append(proc)
    return proc


def launch(home: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    proc = spawn([*trainwatch_command(), "launch", *args], home, env=env, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)
    if os.environ.get(SESSIONS_ENV):
        with open(os.environ[SESSIONS_ENV], "a") as f:
            f.write(f"{proc.pid} {home}\n")
    return proc


def run_command(cmd: list[str], home: Path | None = None, *, timeout: float, env: dict | None = None,
                **popen) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) in a tracked session of
    its own: past `timeout` its whole group is killed and TimeoutExpired raised."""
    proc = spawn(cmd, home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, timeout: float = 60) -> str:
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
    return finish(proc, timeout)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Its output once it ends; its whole process group killed after `timeout`."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out or ""


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def events(home: Path, job: str) -> list[dict]:
    """Incidents (and restart records), each as `diagnose --json` lists it: its
    line with its actions' results, its status and its resolution merged in."""
    from trainwatch import state

    return [incident.view() for incident in state.JobDir(job, root=home).incidents()]


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


def _sessions() -> dict[int, list[int]]:
    """Session id -> its live (not zombie) processes, from one pass over /proc."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out.setdefault(int(fields[3]), []).append(int(d))
    return out


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`: a launcher started with
    start_new_session=True and everything it started that kept its session."""
    return _sessions().get(sid, [])


def reap(proc: subprocess.Popen, home: Path | None = None, job: str | None = None, timeout: float = 30) -> list[str]:
    """After a launcher's run: nothing of it is left. Its session's processes get
    SIGTERM, then SIGKILL after `timeout` (bounded waits); the run's slot segment
    is removed if the launcher did not. Returns what was left behind (logged)."""
    left = []
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    if not wait_for(lambda: not session_pids(proc.pid), timeout, 0.2):
        pids = session_pids(proc.pid)
        left.append(f"processes {pids} of session {proc.pid}")
        _kill(pids)
        wait_for(lambda: not session_pids(proc.pid), KILL_WAIT_S, 0.2)
    if proc.poll() is None:
        proc.kill()
        proc.wait(KILL_WAIT_S)
    if home is not None and job is not None:
        from trainwatch import liveness

        seg = job_json(home, job).get("slots")
        if seg and os.path.lexists(seg):
            left.append(f"segment {seg}")
            liveness.remove_segment(seg, job)
    for what in left:
        log(f"  LEFTOVER {what}: removed")
    return left


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def reap_home(home: Path) -> bool:
    """Reap every run under `home` whose launcher is gone (what `trainwatch jobs`
    does: its slot segment and scrape target go, job.json says `lost`); True once
    none of their segments is left."""
    from trainwatch import liveness, state

    saved = os.environ.get("TRAINWATCH_HOME")
    os.environ["TRAINWATCH_HOME"] = str(home)
    try:
        left = False
        # A multi-node job's node keeps its record under nodes/<node>/.
        for record_path in [*home.glob("jobs/*/job.json"), *home.glob("jobs/*/nodes/*/job.json")]:
            record = state.read_json(record_path)
            if record is None:
                continue
            try:
                liveness.status_of(record)
            except Exception:  # noqa: BLE001 - reaping is best effort
                pass
            seg = record.get("slots")
            left = left or bool(isinstance(seg, str) and os.path.exists(seg))
        return not left
    finally:
        if saved is None:
            os.environ.pop("TRAINWATCH_HOME", None)
        else:
            os.environ["TRAINWATCH_HOME"] = saved


def _under_homes(homes: list[Path]) -> list[int]:
    """Processes of this user whose TRAINWATCH_HOME is one of `homes` (a job's ranks
    and sidecar keep it wherever their sessions went), this process and its callers aside."""
    import psutil

    wanted = {str(h) for h in homes}
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.pid in me or proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
                continue
            if proc.environ().get("TRAINWATCH_HOME") in wanted:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def _resource_tracker(proc) -> bool:
    """multiprocessing's helper process, started with its first spawn; it lives as long as its parent."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - gone meanwhile
        return False


def clean_up() -> list[str]:
    """Stop everything this process started and remove what it made (see the module
    docstring); returns what had to be killed or reaped (logged)."""
    import psutil

    left: list[str] = []
    sessions = _sessions()
    live = [p for p in _TRACKED.procs if p.poll() is None or sessions.get(p.pid)]
    for proc in live:
        _signal_group(proc.pid, signal.SIGTERM)
        for pid in sessions.get(proc.pid, []):  # a stopped rank handles SIGTERM once continued
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass
    sids = {p.pid for p in live}

    def stopped() -> bool:
        now = _sessions()
        return all(p.poll() is not None for p in live) and not any(now.get(s) for s in sids)

    if live and not wait_for(stopped, STOP_GRACE_S, 0.1):
        now = _sessions()
        pids = [pid for s in sids for pid in now.get(s, [])]
        left.append(f"processes {pids} still running {STOP_GRACE_S:.0f} s after SIGTERM")
        _kill(pids)
    for proc in live:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            left.append(f"process {proc.pid} did not end")
    children = psutil.Process().children(recursive=True)  # e.g. the ranks of a multiprocessing spawn
    if children:
        named = [c.pid for c in children if not _resource_tracker(c)]  # that one is expected: it ends with us
        if named:
            left.append(f"child processes {named}")
        _kill([c.pid for c in children])
        psutil.wait_procs(children, timeout=KILL_WAIT_S)
    homes = [h for h in _TRACKED.homes if h.exists()]
    strays = _under_homes(homes) if homes else []
    if strays:
        left.append(f"processes {strays} of the benchmark's jobs")
        _kill(strays)
        wait_for(lambda: not _under_homes(homes), KILL_WAIT_S, 0.2)
    keep_all = os.environ.get(KEEP_ENV) == "1"
    for home in homes:
        # Retried while a killed launcher's lock is still being released.
        if not wait_for(lambda: reap_home(home), KILL_WAIT_S, 0.2):
            left.append(f"slot segments of {home}")
        if not keep_all and home not in _TRACKED.kept:
            shutil.rmtree(home, ignore_errors=True)
    _TRACKED.procs.clear()
    _TRACKED.homes = [h for h in _TRACKED.homes if h in _TRACKED.kept or keep_all]
    for what in left:
        log(f"  LEFTOVER {what}: removed")
    return left


def _terminate(signum, _frame) -> None:
    log(f"{signal.Signals(signum).name}: stopping what this benchmark started ...")
    raise SystemExit(128 + signum)


def main(fn) -> None:
    """Run a benchmark's entry point `fn()` (its return value is the exit code);
    whatever ends it, clean_up() runs. SIGTERM is an exit that runs `finally`
    blocks, as Ctrl-C is; a second signal during the clean-up is ignored."""
    signal.signal(signal.SIGTERM, _terminate)
    code: int | None = 1
    try:
        code = fn()
    except KeyboardInterrupt:
        log("interrupted: stopping what this benchmark started ...")
        code = 130
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        clean_up()
    sys.exit(code or 0)
