"""The state directory: one layout, used by the launcher, sidecar and CLI.

    $TRAINWATCH_HOME (default ~/.trainwatch, mode 0700)
      jobs/<job>/job.json       launcher-owned record: pids, ranks, status, metrics address
      jobs/<job>/sidecar.json   sidecar-owned record: its pid and metrics address
      jobs/<job>/events.jsonl   incidents, one JSON object per line, append-only
      jobs/<job>/stacks/        raw stack dumps
      jobs/<job>/control/       requests between sidecar and agent (restart)

Every JSON file is replaced atomically (tmp + fsync + rename) so a reader never
sees half a record, and a crash mid-write keeps the previous version.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class StateError(RuntimeError):
    """A user-fixable problem with the state directory or a job name."""


def home() -> Path:
    return Path(os.environ.get("TRAINWATCH_HOME") or Path.home() / ".trainwatch").expanduser()


def ensure_home() -> Path:
    root = home()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        (root / "jobs").mkdir(mode=0o700, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise StateError(
            f"$TRAINWATCH_HOME must be a writable directory; got {root} ({e.strerror or e}). "
            "Set TRAINWATCH_HOME to a directory you own."
        ) from None
    return root


def check_job_name(name: str) -> str:
    if not JOB_NAME_RE.match(name):
        raise StateError(
            f"--job must be 1-100 characters of letters, digits, '.', '_' or '-' starting with a "
            f"letter or digit; got {name!r}"
        )
    return name


def generate_job_name() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


def job_dir(job: str) -> Path:
    return home() / "jobs" / check_job_name(job)


def make_job_dir(job: str) -> Path:
    ensure_home()
    d = job_dir(job)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    for sub in ("stacks", "control"):
        (d / sub).mkdir(mode=0o700, exist_ok=True)
    return d


def announce_launch(job: str) -> Path | None:
    """Make a job known the moment `trainwatch launch` starts, before its slow
    start-up (importing torch, parsing torchrun's options): a marker
    `launch.json` naming the launcher's pid. `diagnose` shows the job as
    starting from then on. Returns the marker, or None when it cannot be
    written (the launch goes on; the job appears a few seconds later)."""
    try:
        check_job_name(job)
        ensure_home()
        d = job_dir(job)
        created = not d.exists()
        d.mkdir(mode=0o700, exist_ok=True)
        path = d / "launch.json"
        write_json_atomic(path, {"job": job, "launcher_pid": os.getpid(), "start_time": time.time(),
                                 "created_dir": created}, durable=False)
        return path
    except (StateError, OSError):
        return None


def withdraw_launch(marker: Path | None, *, failed: bool = False) -> None:
    """Remove the launch marker; after a failed launch also the job directory
    it created, when nothing else was written there."""
    if marker is None:
        return
    rec = read_json(marker) or {}
    try:
        marker.unlink()
    except OSError:
        pass
    if failed and rec.get("created_dir"):
        try:
            marker.parent.rmdir()  # only when empty: nothing already written is lost
        except OSError:
            pass


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o600, durable: bool = False) -> None:
    """Replace path with data: written to a temp file beside it (created with
    `mode`, less the umask), optionally fsynced, then renamed over it, so a
    reader sees the old file or the new one, never half of one. On failure the
    temp file is removed and the old file is left as it was."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any, *, durable: bool = True) -> None:
    """Replace path with data. durable=False skips the fsync (and the pretty
    printing): for snapshots rewritten every few seconds, where a crash may
    lose the last one."""
    if durable:
        payload = json.dumps(data, indent=2, sort_keys=True, default=str)
    else:
        payload = json.dumps(data, separators=(",", ":"), default=str)
    write_atomic(path, payload, durable=durable)


def safe_filename(name: str, default: str = "node") -> str:
    """A host or node name as one file name: never a path, never hidden."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100].lstrip(".") or default


def read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_job(job: str) -> dict | None:
    return read_json(job_dir(job) / "job.json")


def update_job(job: str, **fields: Any) -> dict:
    """Merge fields into job.json. Only the launcher process calls this."""
    path = job_dir(job) / "job.json"
    record = read_json(path) or {"job": job}
    record.update(fields)
    write_json_atomic(path, record)
    return record


def live_status(job: dict) -> str:
    """A job.json left 'running' by a launcher that was SIGKILLed is reported as lost."""
    status = job.get("status", "?")
    if status in ("running", "starting"):
        import psutil

        pid = job.get("launcher_pid")
        if pid and not psutil.pid_exists(pid):
            return "lost"
    return status


def list_jobs() -> list[dict]:
    root = home() / "jobs"
    if not root.is_dir():
        return []
    jobs = []
    for d in sorted(root.iterdir()):
        rec = read_json(d / "job.json")
        if rec is not None:
            jobs.append(rec)
    jobs.sort(key=lambda r: r.get("start_time", 0))
    return jobs


def append_event(job: str, event: dict) -> None:
    """Append one incident line. O_APPEND writes of one line are atomic enough for
    the few writers we have (sidecar, agent), and never rewrite earlier lines."""
    path = job_dir(job) / "events.jsonl"
    line = (json.dumps(event, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_events(job: str) -> Iterator[dict]:
    path = job_dir(job) / "events.jsonl"
    try:
        f = open(path)
    except OSError:
        return
    with f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                continue  # a torn last line from a crash is skipped, not fatal


# ---- Prometheus file-based service discovery ------------------------------------


def targets_dir() -> Path:
    """Where `trainwatch launch` lists its exporters for Prometheus' file_sd
    (dashboards/prometheus.yml reads `targets/*.json` next to itself: link or
    point this directory there). TRAINWATCH_TARGETS_DIR overrides it."""
    explicit = os.environ.get("TRAINWATCH_TARGETS_DIR")
    return Path(explicit).expanduser() if explicit else home() / "targets"


def _target_path(job: str, node: str) -> Path:
    return targets_dir() / f"{check_job_name(job)}@{safe_filename(node)}.json"


def write_scrape_target(job: str, node: str, address: str) -> Path | None:
    """List one node's exporter for Prometheus. The file is replaced atomically
    (Prometheus never reads half of it) and is world-readable so a Prometheus
    running as its own user can read it from a directory it may enter. Returns
    None, and leaves the job running, when the directory is not writable."""
    path = _target_path(job, node)
    record = [{"targets": [address], "labels": {"trainwatch_job": job, "node": node}}]
    try:
        path.parent.mkdir(mode=0o755 if os.environ.get("TRAINWATCH_TARGETS_DIR") else 0o700, parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=2) + "\n", mode=0o644)
    except OSError:
        return None
    return path


def remove_scrape_target(job: str, node: str) -> None:
    """A finished job leaves Prometheus' target list (no TrainwatchExporterDown for it)."""
    try:
        _target_path(job, node).unlink()
    except (OSError, StateError):
        pass
