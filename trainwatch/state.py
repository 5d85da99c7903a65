"""The state directory: one layout, owned by `JobDir`, used by every process.

    $TRAINWATCH_HOME (default ~/.trainwatch, mode 0700)
      targets/<job>@<node>.json   Prometheus file_sd targets of running jobs
      jobs/<job>/                 one JobDir: every path below is composed there and nowhere else
        job.json                  launcher-owned record: pids, ranks, status, metrics address
        launch.json               marker of a launcher still starting (before job.json)
        sidecar.json              sidecar-owned record: its pid and metrics address
        events.jsonl              incidents (and their actions' results), append-only
        telemetry.json            the last per-rank view (what diagnose reads once the job ended)
        history/<node>.jsonl      ~1 Hz per-rank samples for `trainwatch report`
        stacks/                   raw py-spy dumps of captures
        checkpoints/              default checkpoint directory of the integrated trainer
        report.html               default output of `trainwatch report`
        control/                  between launcher, agent, sidecar and ranks: exits, restart
                                  requests and timing, the sidecar's config, injected faults fired

Every JSON file is replaced atomically (tmp + fsync + rename) so a reader never
sees half a record, and a crash mid-write keeps the previous version. Every
reader takes what it finds as untrusted: a file of the wrong shape reads as
missing, a bad line of a .jsonl file is skipped.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from trainwatch import env, historyfile

JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class StateError(RuntimeError):
    """A user-fixable problem with the state directory or a job name."""


def home() -> Path:
    return Path(os.environ.get(env.HOME) or Path.home() / ".trainwatch").expanduser()


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
            f"${env.HOME} must be a writable directory; got {root} ({e.strerror or e}). "
            f"Set {env.HOME} to a directory you own."
        ) from None
    return root


def check_job_name(name: str) -> str:
    if not isinstance(name, str) or not JOB_NAME_RE.fullmatch(name):
        raise StateError(
            f"--job must be 1-100 characters of letters, digits, '.', '_' or '-' starting with a "
            f"letter or digit; got {name!r}"
        )
    return name


def generate_job_name() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-") + os.urandom(2).hex()


# ---- files: atomic writes, tolerant reads ------------------------------------------


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


def append_line(path: Path, line: str) -> None:
    """Append one line with one O_APPEND write: concurrent writers (sidecar,
    agent, ranks) never interleave within a line or rewrite earlier ones."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_json(path: Path) -> dict | None:
    """A JSON object from path; None when missing, unreadable, not JSON or not an object."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; torn, garbled and non-object lines skipped."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return []
    out = []
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a torn last line from a crash is skipped, not fatal
        if isinstance(record, dict):
            out.append(record)
    return out


def safe_filename(name: str, default: str = "node") -> str:
    """A host or node name as one file name: never a path, never hidden."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100].lstrip(".") or default


# ---- one job's directory -----------------------------------------------------------


class JobDir:
    """Every path under jobs/<job>/, and the readers and writers of its files."""

    def __init__(self, job: str, root: Path | None = None):
        self.job = check_job_name(job)
        self.path = (root if root is not None else home()) / "jobs" / job
        self.job_file = self.path / "job.json"
        self.launch_file = self.path / "launch.json"
        self.sidecar_file = self.path / "sidecar.json"
        self.events_file = self.path / "events.jsonl"
        self.telemetry_file = self.path / "telemetry.json"
        self.history_dir = self.path / "history"
        self.stacks_dir = self.path / "stacks"
        self.checkpoints_dir = self.path / "checkpoints"
        self.report_file = self.path / "report.html"
        self.control_dir = self.path / "control"
        self.exits_file = self.control_dir / "exits.jsonl"
        self.restart_request_file = self.control_dir / "restart-request.json"
        self.restart_timing_file = self.control_dir / "restart-timing.json"
        self.sidecar_config_file = self.control_dir / "sidecar-config.json"
        self.faults_file = self.control_dir / "faults.jsonl"

    def history_file(self, node: str) -> Path:
        """One history file per node; a hostname never escapes the directory."""
        return self.history_dir / f"{safe_filename(node)}.jsonl"

    def create(self) -> JobDir:
        ensure_home()
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in (self.stacks_dir, self.control_dir):
            sub.mkdir(mode=0o700, exist_ok=True)
        return self

    def exists(self) -> bool:
        return self.job_file.is_file() or self.launch_file.is_file()

    # job.json (written by the launcher only)
    def read_job(self) -> dict | None:
        return read_json(self.job_file)

    def update_job(self, **fields: Any) -> dict:
        """Merge fields into job.json."""
        record = self.read_job() or {"job": self.job}
        record.update(fields)
        write_json_atomic(self.job_file, record)
        return record

    # events.jsonl: incidents, then their actions' results as they finish
    def append_event(self, event: dict) -> None:
        append_line(self.events_file, json.dumps(event, sort_keys=True, default=str))

    def incidents(self) -> list[dict]:
        """Incidents oldest first, each with its actions' results merged in
        (an `action` record carries the `id` of the incident it belongs to)."""
        out: list[dict] = []
        by_id: dict[str, dict] = {}
        for record in read_jsonl(self.events_file):
            if not isinstance(record.get("kind"), str):
                continue
            if record["kind"] == "action":
                target = by_id.get(str(record.get("incident")))
                if target is not None:
                    target.update({k: v for k, v in record.items() if k not in ("kind", "incident", "time", "id")})
                continue
            out.append(record)
            if record.get("id") is not None:
                by_id[str(record["id"])] = record
        return out

    def telemetry(self) -> dict:
        return read_json(self.telemetry_file) or {}

    def read_history(self) -> tuple[int, dict[int, dict[str, list]]]:
        """All nodes' history of the job: (number of samples, per-rank series)."""
        samples = historyfile.read_samples(sorted(self.history_dir.glob("*.jsonl")))
        return len(samples), historyfile.per_rank(samples)

    # launch.json: the job is known from the moment `launch` starts
    def announce_launch(self) -> Path | None:
        """Make the job known before the launcher's slow start-up (importing
        torch, parsing torchrun's options): `diagnose` shows it as starting from
        then on. Returns the marker, or None when it cannot be written."""
        try:
            ensure_home()
            created = not self.path.exists()
            self.path.mkdir(mode=0o700, exist_ok=True)
            write_json_atomic(self.launch_file, {"job": self.job, "launcher_pid": os.getpid(),
                                                 "start_time": time.time(), "created_dir": created}, durable=False)
            return self.launch_file
        except (StateError, OSError):
            return None

    def withdraw_launch(self, *, failed: bool = False) -> None:
        """Remove the launch marker; after a failed launch also the job directory
        it created, when nothing else was written there."""
        rec = read_json(self.launch_file) or {}
        try:
            self.launch_file.unlink()
        except OSError:
            return
        if failed and rec.get("created_dir"):
            try:
                self.path.rmdir()  # only when empty: nothing already written is lost
            except OSError:
                pass


def live_status(job: dict) -> str:
    """A job.json left 'running' by a launcher that was SIGKILLed is reported as lost."""
    status = job.get("status", "?")
    if status in ("running", "starting", "restarting"):
        import psutil

        pid = job.get("launcher_pid")
        if not isinstance(pid, int) or pid <= 0 or not psutil.pid_exists(pid):
            return "lost"
    return str(status)


def list_jobs() -> list[dict]:
    root = home() / "jobs"
    if not root.is_dir():
        return []
    jobs = []
    for d in sorted(root.iterdir()):
        rec = read_json(d / "job.json")
        if rec is not None and isinstance(rec.get("job"), str):
            jobs.append(rec)
    jobs.sort(key=lambda r: r.get("start_time") if isinstance(r.get("start_time"), (int, float)) else 0)
    return jobs


# ---- Prometheus file-based service discovery ------------------------------------


def targets_dir() -> Path:
    """Where `trainwatch launch` lists its exporters for Prometheus' file_sd
    (dashboards/prometheus.yml reads `targets/*.json` next to itself: link or
    point this directory there). TRAINWATCH_TARGETS_DIR overrides it."""
    explicit = os.environ.get(env.TARGETS_DIR)
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
        path.parent.mkdir(mode=0o755 if os.environ.get(env.TARGETS_DIR) else 0o700, parents=True, exist_ok=True)
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
