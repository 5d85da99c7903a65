"""All-rank stack capture with py-spy: in parallel, with a hard time bound per rank.

A rank py-spy cannot sample (exited, permission, stuck in uninterruptible
sleep) is reported with the reason and its process state instead of failing
the capture: such a rank is a prime suspect, not a gap in the report.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from trainwatch import env, state
from trainwatch.rankrow import RankRow
from trainwatch.diagnostics.stack_groups import STOPPED_ERROR, StackGroup, group_stacks
from trainwatch.diagnostics.stack_parsers import parse_pyspy_json
from trainwatch.diagnostics.stacks import ProcessStack

PER_RANK_TIMEOUT_S = 5.0
"""Hard bound for one py-spy dump; a healthy dump takes ~20 ms."""


@dataclass(frozen=True, slots=True)
class RankCapture:
    rank: int
    pid: int
    stack: ProcessStack
    """Parsed stacks; `stack.error` says why when sampling failed."""
    process_state: str | None
    """psutil status ('running', 'sleeping', 'disk-sleep', 'stopped', 'zombie'); None if gone."""
    seconds: float
    """How long this rank's capture took."""
    raw_path: str | None
    """Where the raw dump was saved, if it was."""


def py_spy_binary() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    if here.is_file():
        return str(here)
    return shutil.which("py-spy")


def belongs_to_job(pid: int, job: str) -> bool:
    """Only sample processes this job started: the rank's environment names the job."""
    try:
        return psutil.Process(pid).environ().get(env.JOB) == job
    except (psutil.Error, OSError):
        return False


def process_state(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def capture_rank(rank: int, pid: int, *, native: bool = False, timeout_s: float = PER_RANK_TIMEOUT_S,
                 out_dir: Path | None = None, job: str | None = None) -> RankCapture:
    start = time.monotonic()
    pstate = process_state(pid)

    def failed(reason: str) -> RankCapture:
        detail = reason if reason.startswith(STOPPED_ERROR) else f"{reason} (process state: {pstate or 'gone'})"
        return RankCapture(rank, pid, ProcessStack(pid, rank, None, (), error=detail), pstate,
                           time.monotonic() - start, None)

    if pstate is None or pstate == psutil.STATUS_ZOMBIE:
        return failed("process exited")
    if job is not None and not belongs_to_job(pid, job):
        return failed("not a process of this job; refusing to sample it")
    if pstate == psutil.STATUS_STOPPED:
        # A stopped process has no running stack to read; say what it is.
        return failed(f"{STOPPED_ERROR} (state T: SIGSTOP, job control or a debugger); `kill -CONT {pid}` resumes it")
    if pstate == psutil.STATUS_DISK_SLEEP:
        # ptrace attach to a process in D state can block; say so instead of waiting.
        return failed("process in uninterruptible sleep (D), likely blocked in the kernel or on a device")
    binary = py_spy_binary()
    if binary is None:
        return failed("py-spy not installed")
    cmd = [binary, "dump", "--pid", str(pid), "--json"]
    if native:
        cmd.append("--native")
    dump = _dump_once(cmd, pid, native, timeout_s)
    if isinstance(dump, str):
        return failed(dump)
    stdout = dump[0]
    raw_path = None
    if out_dir is not None:
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        raw = out_dir / f"rank{rank}-pid{pid}.json"
        raw.write_text(stdout)
        raw_path = str(raw)
    try:
        data = json.loads(stdout)
    except ValueError:
        return failed("py-spy output was not JSON")
    parsed = parse_pyspy_json(data, pid=pid, rank=rank)
    stack = parsed[0] if parsed else ProcessStack(pid, rank, None, (), error="py-spy returned no threads")
    return RankCapture(rank, pid, stack, pstate, time.monotonic() - start, raw_path)


SHARED_DUMP_S = 30.0
"""A dump kept for captures of the same process that waited for it (then pruned)."""


def _dump_once(cmd: list[str], pid: int, native: bool, timeout_s: float) -> tuple[str] | str:
    """(py-spy's JSON,) or why not. Captures of one process are serialised across
    processes (two ptrace attaches collide: `tracing-stop`), and one that waited
    for another takes the dump made meanwhile instead of attaching again."""
    locks = _locks_dir()
    if locks is None:
        return _run_py_spy(cmd, timeout_s)
    name = f"pid{pid}{'-native' if native else ''}"
    asked = time.time()
    deadline = time.monotonic() + 2 * timeout_s + 1.0
    try:
        fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return _run_py_spy(cmd, timeout_s)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return "another capture of this process did not finish in time"
                time.sleep(0.02)
        shared = locks / f"{name}.json"
        try:
            if shared.stat().st_mtime >= asked:  # made while this capture waited: as fresh as its own
                return (shared.read_text(),)
        except OSError:
            pass
        result = _run_py_spy(cmd, timeout_s)
        if not isinstance(result, str):
            try:
                state.write_atomic(shared, result[0], mode=0o600)
            except OSError:
                pass
        return result
    finally:
        os.close(fd)  # releases the lock
        _prune_shared(locks)


def _run_py_spy(cmd: list[str], timeout_s: float) -> tuple[str] | str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"py-spy timed out after {timeout_s:.0f}s"
    except OSError as e:
        return f"py-spy could not run: {e.strerror}"
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        reason = msg[-1] if msg else f"py-spy exit code {proc.returncode}"
        if "ermission" in reason or "ptrace" in reason.lower():
            reason += " (py-spy needs root or CAP_SYS_PTRACE)"
        return reason
    return (proc.stdout,)


def _locks_dir() -> Path | None:
    """Per-process capture locks and shared dumps, in the state home (owner-only)."""
    path = state.home() / "captures"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return path


def _prune_shared(locks: Path) -> None:
    now = time.time()
    try:
        for entry in locks.iterdir():
            if entry.suffix == ".json" and now - entry.stat().st_mtime > SHARED_DUMP_S:
                entry.unlink()
    except OSError:
        pass
MAX_PARALLEL = 32
"""Most py-spy dumps at once: each briefly stops its rank and costs a process;
a node's 8 ranks go in one wave, a machine's hundreds in waves of this size."""


def capture_all(pids: dict[int, int], *, native: bool = False, timeout_s: float = PER_RANK_TIMEOUT_S,
                out_dir: Path | None = None, job: str | None = None, workers: int = MAX_PARALLEL,
                budget_s: float | None = None) -> dict[int, RankCapture]:
    """Capture every rank (rank -> pid) in parallel, at most `workers` at once;
    returns rank -> RankCapture. With `budget_s`, the whole capture ends by then:
    a rank whose turn comes later is reported as not sampled, never waited for."""
    if not pids:
        return {}
    deadline = time.monotonic() + budget_s if budget_s is not None else None

    def one(rank: int, pid: int) -> RankCapture:
        left = timeout_s if deadline is None else min(timeout_s, deadline - time.monotonic())
        if left < 0.2:
            return RankCapture(rank, pid, ProcessStack(pid, rank, None, (), error=(
                f"not sampled: the capture's {budget_s:.0f}s budget was spent on other ranks")),
                process_state(pid), 0.0, None)
        return capture_rank(rank, pid, native=native, timeout_s=left, out_dir=out_dir, job=job)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(pids)))) as pool:
        futures = {rank: pool.submit(one, rank, pid) for rank, pid in pids.items()}
        return {rank: f.result() for rank, f in futures.items()}


def capture_ranks(rows: list[RankRow], *, job: state.JobDir, label: str, timeout_s: float = PER_RANK_TIMEOUT_S,
                  native: bool = False, budget_s: float | None = None
                  ) -> tuple[list[StackGroup], Path, dict[str, str], list[RankRow]]:
    """Capture every rank of `rows` in parallel and group the stacks: (groups,
    where the raw dumps went, {rank: why not sampled}, the rows with each
    rank's process state and capture error)."""
    out_dir = capture_dir(job.path, label)
    pids = {r.rank: r.pid for r in rows if r.pid}
    caps = capture_all(pids, native=native, timeout_s=timeout_s, out_dir=out_dir, job=job.job, budget_s=budget_s)
    seen = [replace(r, state=(c.process_state or "gone") if c else None, capture_error=c.stack.error if c else None)
            for r in rows for c in (caps.get(r.rank),)]
    groups = group_stacks({rank: c.stack for rank, c in caps.items()})
    return groups, out_dir, {str(k): c.stack.error for k, c in caps.items() if c.stack.error}, seen


KEEP_CAPTURES = {"diagnose": 5, "remote": 5}
"""Newest captures kept per label; other labels (incidents) keep KEEP_DEFAULT."""
KEEP_DEFAULT = 50


def capture_dir(job_dir: Path, label: str) -> Path:
    """A fresh folder for one capture's raw dumps. Old captures with the same
    label are pruned, so polling `diagnose` does not fill the disk."""
    root = job_dir / "stacks"
    prune_captures(root, label, KEEP_CAPTURES.get(label, KEEP_DEFAULT) - 1)
    return root / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{os.getpid()}-{time.monotonic_ns() % 10**6:06d}"


def prune_captures(root: Path, label: str, keep: int) -> None:
    try:
        mine = sorted((p for p in root.iterdir() if p.is_dir() and f"-{label}-" in p.name),
                      key=lambda p: p.stat().st_mtime)
    except OSError:
        return
    for old in mine[: max(0, len(mine) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
