"""The state directory: one layout, owned by `JobDir`, used by every process.

    $TRAINWATCH_HOME (default ~/.trainwatch, mode 0700)
      targets/<job>@<node>.json   Prometheus file_sd targets of running jobs
      jobs/<job>/                 one JobDir: every path below is composed there and nowhere else
        job.json                  launcher-owned record: pids, ranks, status, metrics address
        launch.json               marker of a launcher still starting (before job.json)
        launch.lock               flock held by the live run's launcher (trainwatch.liveness)
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
import socket
import stat
import time
from pathlib import Path
from typing import Any, Callable

from trainwatch import codec, env, historyfile, records
from trainwatch.records import finite_number, is_int

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


def write_json_atomic(path: Path, data: Any, *, durable: bool = True,
                      pause: Callable[[], object] | None = None) -> None:
    """Replace path with data. durable=False skips the fsync (and the pretty
    printing): for snapshots rewritten every few seconds, where a crash may
    lose the last one (and its long lists are encoded a slice at a time, with
    `pause` called between slices, see dumps_compact)."""
    if durable:
        payload = json.dumps(data, indent=2, sort_keys=True, default=str)
    else:
        payload = dumps_compact(data, pause=pause, default=str)
    write_atomic(path, payload, durable=durable)


SLICE = 256
"""Items of a long list encoded in one go by dumps_compact."""


def dumps_compact(data: Any, pause: Callable[[], object] | None = None, **kw: Any) -> str:
    """json.dumps(data, separators=(",", ":"), **kw), the same text, with the
    long lists of a top-level object (a snapshot's thousands of ranks) encoded
    SLICE items at a time, `pause` called between slices: one encoder call
    holds the interpreter lock until it is done, and over thousands of rows
    that is a tenth of a second in which the thread next to it (the sidecar's
    detection loop) cannot run."""
    kw["separators"] = (",", ":")
    if not isinstance(data, dict) or not any(isinstance(v, list) and len(v) > SLICE for v in data.values()):
        return json.dumps(data, **kw)
    parts = []
    for key, value in data.items():
        if isinstance(value, list) and len(value) > SLICE:
            chunks = []
            for i in range(0, len(value), SLICE):
                if pause is not None and i:
                    pause()
                chunks.append(json.dumps(value[i:i + SLICE], **kw)[1:-1])
            text = "[" + ",".join(chunks) + "]"
        else:
            text = json.dumps(value, **kw)
        parts.append(json.dumps({key: 0}, **kw)[1:-3] + ":" + text)  # the key as the encoder writes keys
    return "{" + ",".join(parts) + "}"


def append_line(path: Path, line: str) -> None:
    """Append one line with one O_APPEND write: concurrent writers (sidecar,
    agent, ranks) never interleave within a line or rewrite earlier ones."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


MAX_NESTING = 64
"""Deepest nesting a reader accepts: trainwatch writes a handful of levels, and
deeper junk would only break whoever prints or re-encodes the record."""


def nested_too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether lists and objects in value nest deeper than limit (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


MAX_JSON_BYTES = 64 << 20
"""Largest JSON file read (a 4096-rank telemetry snapshot is a few MiB); a larger one is unreadable."""
MAX_LINE_BYTES = 1 << 20
"""Longest .jsonl line read (an incident line of thousands of ranks is tens of KiB); a longer one is skipped
while read, never held whole."""
JOB_TEXT_CHARS = 4096
"""Longest string of job.json (a path, the script and its arguments), written and read."""


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict | None:
    """A JSON object from path; None when missing, unreadable, larger than max_bytes, not a regular file,
    not JSON, not an object or nested absurdly deep."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in its place must not block the reader
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            return None
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and not nested_too_deep(data) else None


def read_jsonl(path: Path, max_line: int = MAX_LINE_BYTES) -> list[dict]:
    """The JSON objects of a .jsonl file; torn, garbled, non-object, absurdly deep and over-long lines skipped."""
    out = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return []
            while line := f.readline(max_line + 1):
                if len(line) > max_line and not line.endswith(b"\n"):
                    while (rest := f.readline(1 << 16)) and not rest.endswith(b"\n"):
                        pass  # the rest of an over-long line, read in pieces and dropped
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # a torn last line from a crash is skipped, not fatal
                if isinstance(record, dict) and not nested_too_deep(record):
                    out.append(record)
    except OSError:
        return out
    return out


def safe_filename(name: str, default: str = "node") -> str:
    """A host or node name as one file name: never a path, never hidden."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100].lstrip(".") or default


# ---- one job's directory -----------------------------------------------------------


class JobDir:
    """Every path under jobs/<job>/, and the readers and writers of its files."""

    def __init__(self, job: str, root: Path | None = None, node: str | None = None):
        self.job = check_job_name(job)
        self.root = root
        self.path = (root if root is not None else home()) / "jobs" / job
        # A node of a multi-node job keeps its own records apart (env.NODE_SCOPE);
        # incidents, history, stacks and checkpoints are the job's.
        self.node = node if node is not None else (os.environ.get(env.NODE_SCOPE) or None)
        self.own = self.path / "nodes" / safe_filename(self.node) if self.node else self.path
        self.job_file = self.own / "job.json"
        self.launch_file = self.own / "launch.json"
        self.lock_file = self.own / "launch.lock"
        self.sidecar_file = self.own / "sidecar.json"
        self.events_file = self.path / "events.jsonl"
        self.telemetry_file = self.own / "telemetry.json"
        self.thresholds_file = self.path / "thresholds.json"  # learnt hang thresholds (watchdog.thresholds)
        self.history_dir = self.path / "history"
        self.stacks_dir = self.path / "stacks"
        self.checkpoints_dir = self.path / "checkpoints"
        self.report_file = self.path / "report.html"
        self.control_dir = self.own / "control"
        self.exits_file = self.control_dir / "exits.jsonl"
        self.restart_request_file = self.control_dir / "restart-request.json"
        self.restart_timing_file = self.control_dir / "restart-timing.json"
        self.restarting_file = self.control_dir / "restarting"  # present while the agent restarts the workers
        self.sidecar_config_file = self.control_dir / "sidecar-config.json"
        self.faults_file = self.control_dir / "faults.jsonl"
        self.errors_file = self.control_dir / "errors.jsonl"
        self.store_key_file = self.control_dir / "store.key"  # the job secret, for this node's sidecar and diagnose

    def history_file(self, node: str) -> Path:
        """One history file per node; a hostname never escapes the directory."""
        return self.history_dir / f"{safe_filename(node)}.jsonl"

    def create(self) -> JobDir:
        ensure_home()
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.own.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in (self.stacks_dir, self.control_dir):
            sub.mkdir(mode=0o700, exist_ok=True)
        return self

    @classmethod
    def resolve(cls, job: str, root: Path | None = None, node: str | None = None) -> JobDir:
        """The directory a reader means by a job name: the job's own, or for a
        multi-node job one node's (`node`, else this machine's, else the newest)."""
        d = cls(job, root)
        if node is None and d.exists():
            return d
        scoped = [cls(job, root, p.name) for p in sorted((d.path / "nodes").glob("*")) if p.is_dir()]
        scoped = [s for s in scoped if s.exists()]
        if node is not None:
            return next((s for s in scoped if s.node == safe_filename(node)), cls(job, root, node))
        if not scoped:
            return d
        here = [s for s in scoped if s.node == safe_filename(socket.gethostname())]
        return here[0] if here else max(scoped, key=lambda s: finite_number((s.read_job() or {}).get("start_time"))
                                        or 0.0)

    def start_run(self) -> None:
        """A new run takes the name: the control records of earlier runs (exits,
        restart requests and timings, fired faults, the sidecar's record) go, so
        nothing of theirs is ever replayed as this run's."""
        for path in (self.exits_file, self.restart_request_file, self.restart_timing_file, self.restarting_file,
                     self.faults_file, self.errors_file, self.sidecar_file):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def exists(self) -> bool:
        return self.job_file.is_file() or self.launch_file.is_file()

    # job.json (written by the launcher only)
    def read_job(self) -> dict | None:
        """job.json, its strings cut to JOB_TEXT_CHARS; None when it is not one."""
        data = read_json(self.job_file)
        return None if data is None else codec.bound_text(data, JOB_TEXT_CHARS)

    def update_job(self, **fields: Any) -> dict:
        """Merge fields into job.json (their strings cut to JOB_TEXT_CHARS)."""
        record = self.read_job() or {"job": self.job}
        record.update(codec.bound_text(codec.encode(fields), JOB_TEXT_CHARS))  # a JobStatus as its value
        write_json_atomic(self.job_file, record)
        return record

    # events.jsonl: incidents, then their actions' results as they finish
    def append_event(self, event: dict) -> None:
        append_line(self.events_file, json.dumps(event, sort_keys=True, default=str))

    def incidents(self) -> list[records.Incident]:
        """Incidents (and restart records) oldest first, each with its actions'
        results and its resolution merged in (see trainwatch.records)."""
        return records.read_events(read_jsonl(self.events_file))

    def telemetry(self) -> dict:
        return read_json(self.telemetry_file) or {}

    def read_history(self, limit: int = 2000) -> tuple[int, dict[int, dict[str, list]]]:
        """All nodes' history: (samples, per-rank series of `limit` to 2 * `limit` points, thinned while read)."""
        total, samples = historyfile.read_thinned(sorted(self.history_dir.glob("*.jsonl")), limit)
        return total, historyfile.per_rank(samples)

    # launch.json: the job is known from the moment `launch` starts
    def announce_launch(self) -> Path | None:
        """Make the job known before the launcher's slow start-up (importing
        torch, parsing torchrun's options): `diagnose` shows it as starting from
        then on. Returns the marker, or None when it cannot be written."""
        try:
            ensure_home()
            created = not self.own.exists()
            self.path.mkdir(mode=0o700, exist_ok=True)
            self.own.mkdir(mode=0o700, parents=True, exist_ok=True)
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
            for path in ((self.own, self.own.parent, self.path) if self.node else (self.path,)):
                try:
                    path.rmdir()  # only when empty: nothing already written is lost
                except OSError:
                    pass


def live_status(job: dict) -> str:
    """A job.json left 'running' by a launcher that was SIGKILLed is reported as lost."""
    status = job.get("status", "?")
    if not isinstance(status, str):
        return "?"
    if status in records.LIVE_STATUSES:
        if not pid_alive(job.get("launcher_pid")):
            return records.JobStatus.LOST.value
    return status


def pid_alive(pid: Any) -> bool:
    """Whether pid, as read from a file, names a live process (true, "12", -1 and 1e30 do not)."""
    import psutil

    try:
        return is_int(pid) and pid > 0 and psutil.pid_exists(pid)
    except (OverflowError, ValueError):  # a pid no process can have
        return False


def list_jobs() -> list[dict]:
    """Every job once; a multi-node job's nodes (those keeping records here) merged
    into one entry with `nodes` and the sum of their ranks."""
    root = home() / "jobs"
    if not root.is_dir():
        return []
    jobs = []
    for d in sorted(root.iterdir()):
        rec = read_json(d / "job.json")
        if rec is not None and isinstance(rec.get("job"), str):
            jobs.append(rec)
            continue
        per_node = [r for r in (read_json(p) for p in sorted(d.glob("nodes/*/job.json")))
                    if r is not None and isinstance(r.get("job"), str)]
        if per_node:
            merged = dict(max(per_node, key=lambda r: finite_number(r.get("start_time")) or 0.0))
            merged["nodes"] = sorted({str(r.get("node")) for r in per_node})
            merged["ranks"] = [x for r in per_node if isinstance(r.get("ranks"), list) for x in r["ranks"]]
            merged["node_records"] = per_node
            jobs.append(merged)
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
