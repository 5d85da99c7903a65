"""Which run owns a job name, and whether it is still alive.

A job name belongs to one live run: the launcher holds an exclusive `flock` on
the job's lock file for its whole life, so a second `trainwatch launch` of the
same name (same $TRAINWATCH_HOME) is refused, naming the running launcher. The
kernel drops the lock when the launcher dies, however it dies (SIGKILL
included): a job.json that still says `running` with nobody holding the lock
is a run that is gone. Readers (`jobs`, `diagnose`, the next `launch`) then
mark it `lost` and remove what it left behind: its shared-memory segment and
its Prometheus target file.

A lock rather than a pid check: pids are reused, and a pid that exists says
nothing about whose process it is.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from trainwatch import records, state

LIVE_STATUSES = records.LIVE_STATUSES


class RunLock:
    """The launcher's hold on a job name; released when the process ends."""

    def __init__(self, job_dir: state.JobDir, fd: int):
        self.job_dir = job_dir
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def acquire(job_dir: state.JobDir) -> RunLock:
    """Hold the job name for this process, or StateError naming the live run's launcher."""
    job_dir.path.mkdir(mode=0o700, parents=True, exist_ok=True)
    job_dir.own.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(job_dir.lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise state.StateError(f"cannot lock {job_dir.lock_file} ({e.strerror})") from None
        pid = holder_pid(job_dir)
        who = f"launcher pid {pid}" if pid else "another launcher"
        raise state.StateError(
            f"job {job_dir.job!r} is already running ({who}); wait for it to end, stop it"
            + (f" (kill {pid})" if pid else "") + ", or launch under another --job name"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {time.time():.3f}\n".encode(), 0)
    return RunLock(job_dir, fd)


def holder_pid(job_dir: state.JobDir) -> int | None:
    """The pid written by the lock's holder (informative only: the lock decides)."""
    try:
        text = job_dir.lock_file.read_text(errors="replace").split()
        return int(text[0]) if text and text[0].isdigit() else None
    except (OSError, ValueError):
        return None


def is_held(job_dir: state.JobDir) -> bool:
    """True while a launcher holds the job's lock."""
    try:
        fd = os.open(job_dir.lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def status(job_dir: state.JobDir, record: dict | None = None) -> str:
    """The job's status, with a run whose launcher is gone reaped and marked `lost`."""
    record = job_dir.read_job() if record is None else record
    if record is None:
        return "unknown"
    current = record.get("status")
    if not isinstance(current, str):
        return "unknown"
    if current not in LIVE_STATUSES or is_held(job_dir):
        if current not in LIVE_STATUSES and not is_held(job_dir):
            remove_segment(record.get("slots"), job_dir.job)  # an ended run's, should its launcher have left it
        return current
    if not job_dir.lock_file.exists() and state.live_status(record) != "lost":
        return current  # a run from before job locks: its launcher pid decides
    reap(job_dir, record)
    return "lost"


def status_of(record: dict) -> str:
    """`status` for a job.json read from a listing (its job name may be anything)."""
    try:
        node = record.get("node") if record.get("node_scoped") is True and isinstance(record.get("node"), str) else None
        job_dir = state.JobDir(record.get("job"), node=node)  # type: ignore[arg-type]
    except (state.StateError, TypeError, ValueError):
        return state.live_status(record)
    return status(job_dir, record)


def reap(job_dir: state.JobDir, record: dict, *, locked: bool = False) -> None:
    """Clean up after a run whose launcher died: its segment and scrape target,
    then job.json says `lost`. Only while nobody else holds the lock (`locked`:
    this process holds it, as a launch taking over the name does)."""
    if locked:
        _reap(job_dir, record)
        return
    try:
        fd = os.open(job_dir.lock_file, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # a run from before job locks; a new launch locks first
        _reap(job_dir, record)
        return
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # a launcher took the name meanwhile: nothing of ours to reap
        _reap(job_dir, record)
    finally:
        os.close(fd)


def _reap(job_dir: state.JobDir, record: dict) -> None:
    remove_segment(record.get("slots"), job_dir.job)
    node = record.get("node")
    if isinstance(node, str):
        state.remove_scrape_target(job_dir.job, node)
    if record.get("status") in LIVE_STATUSES:
        try:
            end = record.get("end_time")
            job_dir.update_job(status=records.JobStatus.LOST, end_time=end if isinstance(end, (int, float)) else time.time())
        except OSError:
            pass


def remove_segment(path: object, job: str | None = None) -> None:
    """Remove a dead run's slot segment: only a regular file of ours, named as
    trainwatch names segments (of `job`, when given): a job.json is not
    trusted to point anywhere."""
    prefix = f"trainwatch-{os.getuid()}-" + (f"{job}@" if job else "")
    if not isinstance(path, str) or not Path(path).name.startswith(prefix):
        return
    try:
        st = os.lstat(path)
        if st.st_uid == os.getuid() and (st.st_mode & 0o170000) == 0o100000:
            os.unlink(path)
    except OSError:
        pass
