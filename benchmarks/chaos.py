"""Chaos benchmark: faults and abuse against real `trainwatch launch` runs.

    python benchmarks/chaos.py [--only PROBE,...]
    python benchmarks/chaos.py --smoke    # four quick probes, one of them a real launch (for tests)

Each probe does to a real launch what an unlucky operator or a hostile user
of the same machine would: two launches of one job name, SIGKILL of the
launcher, of the sidecar and of a rank in the middle of writing a checkpoint,
a disk that fills up during a checkpoint (a small tmpfs when run as root,
otherwise a file-size limit), symlinks planted at segment paths, and state
files of every wrong shape under the read-only commands. A probe holds when
the run behaves as documented: one `error:` line (exit 2) for what cannot go
on, no traceback anywhere, no process of the job left behind, and every
checkpoint that was complete before the fault still complete after it.

Every probe runs under its own TRAINWATCH_HOME, removed at the end.
Progress goes to stderr; the LAST stdout line is one JSON object:
{"probes", "held", "orphans_left", "tracebacks", "data_lost", "failed": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from common import (BIN, ROOT, SMOKE_HELP, env_for, finish, job_json, log, new_home, run_command, spawn, stop,
                    wait_for)

SCRIPT = ROOT / "tests" / "scripts" / "plain_ddp.py"
TRAINER = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--log-interval", "5"]
TRACEBACK = "Traceback (most recent call last)"


class Probes:
    def __init__(self) -> None:
        self.results: list[dict] = []
        self.homes: list[Path] = []
        self.tracebacks = 0
        self.orphans = 0
        self.data_lost = 0

    def home(self, name: str) -> Path:
        home = new_home(f"chaos-{name}")
        self.homes.append(home)
        return home

    def record(self, name: str, held: bool, detail: str, *outputs: str) -> None:
        tracebacks = sum(o.count(TRACEBACK) for o in outputs)
        self.tracebacks += tracebacks
        held = held and tracebacks == 0
        self.results.append({"probe": name, "held": held, "detail": detail})
        log(f"  {'held  ' if held else 'FAILED'} {name}: {detail}" + (f" ({tracebacks} traceback(s))" if tracebacks else ""))

    def sweep(self, home: Path) -> int:
        """Kill and count processes still running under this probe's home."""
        left = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("TRAINWATCH_HOME") == str(home):
                    left.append(p)
            except (psutil.Error, OSError):
                pass
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.orphans += len(left)
        return len(left)

    def cleanup(self) -> None:
        for home in self.homes:
            self.sweep(home)
            shutil.rmtree(home, ignore_errors=True)


def start(home: Path, *args: str, preexec=None) -> subprocess.Popen:
    return spawn([str(BIN / "trainwatch"), "launch", *args], home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True, preexec_fn=preexec)


def run(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_command([str(BIN / "trainwatch"), *args], home, timeout=timeout)


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def all_gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            pass
    return True


def one_error_line(proc: subprocess.CompletedProcess) -> bool:
    err = proc.stderr.strip()
    return proc.returncode == 2 and err.startswith("error: ") and "\n" not in err


def checkpoints(ckpt_dir: Path) -> dict[str, bool]:
    """{checkpoint directory: verifies} for every final-named checkpoint."""
    from trainwatch.checkpoint import CheckpointError, verify_checkpoint

    out = {}
    for path in sorted(ckpt_dir.glob("step-*")) if ckpt_dir.is_dir() else []:
        try:
            verify_checkpoint(path)
            out[path.name] = True
        except CheckpointError:
            out[path.name] = False
    return out


def wait_running(home: Path, job: str, proc: subprocess.Popen, timeout: float = 120) -> dict:
    def ready():
        if proc.poll() is not None:
            return {"exited": proc.returncode}
        rec = job_json(home, job)
        return rec if rec.get("metrics") and rec.get("status") == "running" else None
    return wait_for(ready, timeout) or {}


# ---- probes ---------------------------------------------------------------------------


def probe_one_name_one_run(p: Probes) -> None:
    """Two launches of one name; SIGKILL of the launcher; the name free again after."""
    home, job = p.home("name"), f"chaos-{uuid.uuid4().hex[:6]}"
    first = start(home, "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", str(SCRIPT),
                  "--steps", "100000", "--sleep", "0.05")
    rec = wait_running(home, job, first)
    if "launcher_pid" not in rec:
        p.record("duplicate_name", False, f"first launch did not start ({rec})", finish(first, 30))
        return
    second = run(home, "launch", "--nproc-per-node", "2", "--job", job, str(SCRIPT), "--steps", "5", timeout=120)
    untouched = job_json(home, job).get("run_id") == rec.get("run_id")
    p.record("duplicate_name", one_error_line(second) and untouched and f"pid {rec['launcher_pid']}" in second.stderr,
             second.stderr.strip()[:160], second.stdout, second.stderr)

    procs = children(rec["launcher_pid"])
    segment = Path(str(rec.get("slots")))
    os.kill(rec["launcher_pid"], signal.SIGKILL)
    t0 = time.monotonic()
    stopped = wait_for(lambda: all_gone(procs), 15)
    took = time.monotonic() - t0
    out = finish(first, 30)
    listing = run(home, "jobs", "--json")
    try:
        status = [j["status"] for j in json.loads(listing.stdout) if j.get("job") == job]
    except ValueError:
        status = []
    cleaned = not segment.exists() and not list((home / "targets").glob(f"{job}@*.json"))
    p.record("launcher_sigkill", bool(stopped) and status == ["lost"] and cleaned,
             f"{len(procs)} ranks+sidecar stopped in {took:.1f}s; jobs says {status}; segment and target "
             f"{'removed' if cleaned else 'LEFT'}", out, listing.stderr)
    p.sweep(home)

    again = run(home, "launch", "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", str(SCRIPT),
                "--steps", "20", timeout=300)
    rec = job_json(home, job)
    p.record("relaunch_after_lost", again.returncode == 0 and rec.get("restarts", 0) == 0
             and not (home / "jobs" / job / "events.jsonl").exists(),
             f"exit {again.returncode}, restarts {rec.get('restarts')}, no replayed exit or restart request",
             again.stdout, again.stderr)
    p.sweep(home)


def probe_sidecar_sigkill(p: Probes) -> None:
    home, job = p.home("sidecar"), f"chaos-{uuid.uuid4().hex[:6]}"
    proc = start(home, "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", str(SCRIPT),
                 "--steps", "300", "--sleep", "0.03")
    rec = wait_running(home, job, proc)
    pid = rec.get("sidecar_pid")
    if pid:
        os.kill(pid, signal.SIGKILL)
    out = finish(proc, 300)
    rec = job_json(home, job)
    p.record("sidecar_sigkill", bool(pid) and proc.returncode == 0 and rec.get("sidecar_starts", 1) >= 2
             and rec.get("restarts", 0) == 0,
             f"exit {proc.returncode}, sidecar started {rec.get('sidecar_starts', 1)} times, "
             f"training restarts {rec.get('restarts', 0)}", out)
    p.sweep(home)


def probe_rank_sigkill_mid_checkpoint(p: Probes) -> None:
    """SIGKILL rank 0 while its checkpoint's temp directory is being written:
    the injected crash fires inside the write of step 12 (state file open, not
    renamed), where an outside poller would miss a write of a few milliseconds."""
    home, job = p.home("ckpt"), f"chaos-{uuid.uuid4().hex[:6]}"
    ckpt_dir = home / "jobs" / job / "checkpoints"
    proc = start(home, "--nproc-per-node", "2", "--job", job, "--metrics-port", "0",
                 "--inject", "crash:rank=0,step=12,at=checkpoint", *TRAINER[:2],
                 "--model-size", "medium", "--batch-size", "2", "--seq-len", "32", "--log-interval", "5",
                 "--max-steps", "24", "--ckpt-interval", "4")
    wait_running(home, job, proc, 300)
    out = finish(proc, 600)
    after = checkpoints(ckpt_dir)
    # The kill came after step-8 was complete: it must still be there, or superseded.
    lost = 0 if any(ok and n >= "step-00000008" for n, ok in after.items()) else 1
    p.data_lost += lost
    leftovers = list(ckpt_dir.glob(".tmp-*"))
    rec = job_json(home, job)
    killed = "killed by SIGKILL" in out and rec.get("restarts", 0) >= 1
    p.record("rank_sigkill_mid_checkpoint", killed and proc.returncode == 0 and lost == 0
             and all(after.values()) and "step-00000024" in after and not leftovers,
             f"rank 0 killed writing step-00000012: {killed}; exit {proc.returncode} after {rec.get('restarts')} "
             f"restart(s); checkpoints {sorted(after)}; {len(leftovers)} temp dirs left", out)
    p.sweep(home)


def probe_disk_full(p: Probes) -> None:
    """The checkpoint disk fills up: one line naming the directory and the free
    space, the earlier checkpoint kept, no restart loop."""
    home, job = p.home("disk"), f"chaos-{uuid.uuid4().hex[:6]}"
    ckpt_dir = home / "small-disk"
    ckpt_dir.mkdir()
    mounted = False
    preexec = None
    if os.geteuid() == 0 and shutil.which("mount"):
        # Room for one checkpoint of the tiny model (~2.3 MB) and not two.
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(ckpt_dir)],
                                 capture_output=True).returncode == 0
    if not mounted:
        def preexec():  # every write past 1 MB fails with EFBIG instead of killing the writer
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        proc = start(home, "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", "--max-restarts", "3",
                     *TRAINER, "--max-steps", "30", "--ckpt-interval", "10", "--ckpt-dir", str(ckpt_dir),
                     preexec=preexec)
        out = finish(proc, 600)
        after = checkpoints(ckpt_dir)
        restarts = job_json(home, job).get("restarts", 0)
        lines = [line for line in out.splitlines() if "cannot write checkpoint" in line or line.startswith("error:")]
        kept = after.get("step-00000010") is True or not mounted  # under ulimit no checkpoint fits
        held = proc.returncode != 0 and bool(lines) and "free" in lines[0] and restarts <= 1 and kept
        p.data_lost += 0 if kept else 1
        p.record("disk_full_during_checkpoint", held,
                 f"{'tmpfs 3 MiB' if mounted else 'ulimit -f 1 MiB'}: exit {proc.returncode}, {restarts} restart(s), "
                 f"kept {sorted(n for n, ok in after.items() if ok)}; {len(lines)} error line(s) over "
                 f"{restarts + 1} attempt(s): "
                 f"{lines[0].strip()[:140] if lines else 'no error line'}", out)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckpt_dir)], capture_output=True)
        p.sweep(home)


def probe_planted_symlinks(p: Probes) -> None:
    """Symlinks planted where a segment would go, and a job.json pointing the
    reaper at someone else's file: nothing followed, nothing removed."""
    home, job = p.home("link"), f"chaos-{uuid.uuid4().hex[:6]}"
    victim = home / "victim"
    victim.write_bytes(b"precious")
    uid = os.getuid()
    planted = [Path(f"/dev/shm/trainwatch-{uid}-{job}.slots"), Path(f"/dev/shm/trainwatch-{uid}-{job}@{os.uname()[1]}.slots")]
    for link in planted:
        try:
            link.symlink_to(victim)
        except OSError:
            pass
    try:
        fake = home / "jobs" / "ghost"
        fake.mkdir(parents=True, mode=0o700)
        (fake / "job.json").write_text(json.dumps({"job": "ghost", "status": "running", "launcher_pid": 1,
                                                   "slots": str(planted[0]), "node": "n"}))
        outs = [run(home, "jobs"), run(home, "diagnose", "ghost", "--json")]
        proc = run(home, "launch", "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", str(SCRIPT),
                   "--steps", "10", timeout=300)
        held = (proc.returncode == 0 and victim.read_bytes() == b"precious"
                and all(link.is_symlink() for link in planted) and all(o.returncode in (0, 2) for o in outs))
        p.record("planted_symlinks", held, f"launch exit {proc.returncode}; victim intact: "
                 f"{victim.read_bytes() == b'precious'}; planted links untouched", proc.stdout, proc.stderr,
                 *(o.stdout + o.stderr for o in outs))
    finally:
        for link in planted:
            try:
                link.unlink()
            except OSError:
                pass
        p.sweep(home)


HOSTILE = {
    "job_json_list": {"job.json": b"[1, 2, 3]"},
    "job_json_types": {"job.json": b'{"job": 5, "status": [], "ranks": "x", "start_time": "now", "restarts": null}'},
    "job_json_garbage": {"job.json": b"\xff\xfe{{{\x00"},
    "events_wrong_shapes": {"events.jsonl": b'[]\n5\n"x"\nnull\n{"kind": 7, "culprit_ranks": "0", "evidence": []}\n\xff\n'},
    "telemetry_wrong_shapes": {"telemetry.json": b'{"ranks": [null, 5, {"rank": "x"}, {"rank": 0, "step": 1e999}]}'},
    "history_garbage": {"history/n.jsonl": b'{"t": "x", "r": 5}\n\x00\x01\n{"t": 1, "r": [[null]]}\n'},
    "slots_not_a_segment": {"job.json": b'{"job": "J", "status": "running", "launcher_pid": 1, "slots": "/etc/passwd"}'},
    "deep_nesting": {"events.jsonl": b'{"kind": "hang", "evidence": ' + b"[" * 5000 + b"]" * 5000 + b"}\n"},
}


def probe_hostile_state(p: Probes) -> None:
    for name, files in HOSTILE.items():
        home = p.home("state")
        job_dir = home / "jobs" / "victim-job"
        job_dir.mkdir(parents=True, mode=0o700)
        base = {"job.json": b'{"job": "victim-job", "status": "failed", "start_time": 1, "ranks": [0, 1]}'}
        for rel, data in {**base, **files}.items():
            path = job_dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data.replace(b'"J"', b'"victim-job"'))
        outs = [run(home, *cmd, timeout=120) for cmd in (
            ("jobs",), ("jobs", "--json"), ("diagnose", "victim-job"), ("diagnose", "victim-job", "--json"),
            ("report", "victim-job", "--out", str(home / "r.html")))]
        held = all(o.returncode == 0 or one_error_line(o) for o in outs)
        p.record(f"hostile_{name}", held, " ".join(str(o.returncode) for o in outs),
                 *(o.stdout + o.stderr for o in outs))


# ---- trust under abuse: the store, the exporter, readers, the terminal, checkpoints -----

OUTSIDER = """
import json, sys, time
from trainwatch.jobstore import JobStore
from trainwatch.watchdog.jobwide import decode_summary
store = JobStore(sys.argv[1], sys.argv[2])  # reaches the port; has no secret
deadline, forged = time.monotonic() + float(sys.argv[3]), 0
while time.monotonic() < deadline:
    store.register("evil")
    store.add_incident({"kind": "hang", "severity": "critical", "scope": "job", "id": "forged",
                        "culprit_ranks": [0, 1, 2, 3], "nodes": ["n0", "n1"], "summary": "forged"})
    store.request_capture("evil")
    store.publish("evil", b"forged summary")
    forged += 4
    time.sleep(0.2)
raw = [store.store.get(store.key(f"summary/{n}")) for n in ("n0", "n1")]
print(json.dumps({"forged": forged, "summaries_read": sum(decode_summary(b) is not None for b in raw)}))
"""


def _remote_captures(homes: list[Path], job: str) -> set[str]:
    return {d.name for h in homes for d in (h / "jobs" / job / "stacks").glob("*-remote-*")}


def probe_store_forgery(p: Probes) -> None:
    """Two nodes on loopback with a job secret; a process without it forges
    incidents, capture requests, node names and summaries for 6 s."""
    from trainwatch import netbind

    job, port, secret = f"chaos-{uuid.uuid4().hex[:6]}", netbind.free_port(), uuid.uuid4().hex
    homes = [p.home(f"mn{i}") for i in range(2)]
    procs = []
    for i, home in enumerate(homes):
        procs.append(spawn(
            [str(BIN / "trainwatch"), "launch", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job, "--job", job,
             "--node-name", f"n{i}", "--metrics-port", "0", *TRAINER, "--max-steps", "100000",
             "--ckpt-interval", "1000"], home, env=env_for(home, TRAINWATCH_JOB_SECRET=secret),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if i == 0:
            wait_for(lambda: netbind.is_listening("127.0.0.1", port), 120)

    def both_training():  # node 0 sees node 1's ranks through the store
        tele = homes[0] / "jobs" / job / "nodes" / "n0" / "telemetry.json"
        try:
            return len(json.loads(tele.read_text()).get("job_ranks") or []) >= 2
        except (OSError, ValueError):
            return None
    ready = wait_for(both_training, 180)
    before = _remote_captures(homes, job)
    out = subprocess.run([sys.executable, "-c", OUTSIDER, f"127.0.0.1:{port}", job, "6"], env=env_for(homes[0]),
                         cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    try:
        seen = json.loads(out.stdout.splitlines()[-1])
    except (ValueError, IndexError):
        seen = {}
    time.sleep(1.0)  # a round or two of every sidecar after the last forged record
    rejected = 0.0
    node0 = json.loads((homes[0] / "jobs" / job / "nodes" / "n0" / "job.json").read_text())
    try:
        import urllib.request

        page = urllib.request.urlopen(f"http://{node0['metrics']}/metrics", timeout=10).read().decode()
        rejected = sum(float(line.split()[-1]) for line in page.splitlines()
                       if line.startswith("trainwatch_store_rejected_total"))
    except (OSError, KeyError, ValueError):
        pass
    actions = len(_remote_captures(homes, job) - before)
    for h in homes:
        events = [json.loads(line) for line in (h / "jobs" / job / "events.jsonl").read_text().splitlines()
                  if line.strip()] if (h / "jobs" / job / "events.jsonl").exists() else []
        actions += sum(1 for e in events if e.get("kind") in ("hang", "restart") or e.get("id") == "forged")
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    outs = [finish(proc, 120) for proc in procs]
    p.record("store_forgery", bool(ready) and seen.get("forged", 0) > 0 and actions == 0 and rejected > 0
             and seen.get("summaries_read") == 0,
             f"{seen.get('forged', 0)} forged records: {actions} actions taken, {rejected:.0f} rejected "
             f"(trainwatch_store_rejected_total), summaries readable without the secret: "
             f"{seen.get('summaries_read')}", *outs, out.stderr)
    for h in homes:
        p.sweep(h)

    # Without a secret a multi-node launch refuses in one line; a wide exporter is named once.
    home = p.home("nosecret")
    env = {k: v for k, v in env_for(home).items() if k != "TRAINWATCH_JOB_SECRET"}
    refused = subprocess.run([str(BIN / "trainwatch"), "launch", "--nnodes", "2", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", f"127.0.0.1:{netbind.free_port()}", str(SCRIPT)], env=env,
                             cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    p.record("multinode_without_secret", one_error_line(refused) and "--insecure-store" in refused.stderr,
             refused.stderr.strip()[:160], refused.stdout, refused.stderr)
    wide = run(home, "launch", "--standalone", "--nproc-per-node", "1", "--metrics-host", "0.0.0.0",
               "--job", f"chaos-{uuid.uuid4().hex[:6]}", str(SCRIPT), "--steps", "3", timeout=300)
    warned = [line for line in wide.stdout.splitlines() if "warning: the metrics exporter listens on 0.0.0.0" in line]
    p.record("wide_exporter_warning", wide.returncode == 0 and len(warned) == 1,
             warned[0].strip()[:160] if warned else "no warning", wide.stdout, wide.stderr)
    p.sweep(home)


def probe_exporter_idle(p: Probes) -> None:
    """400 connections that send nothing (a port scan, a stuck scraper) and 50 malformed ones."""
    import socket

    home, job = p.home("exporter"), f"chaos-{uuid.uuid4().hex[:6]}"
    proc = start(home, "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", str(SCRIPT),
                 "--steps", "100000", "--sleep", "0.05")
    rec = wait_running(home, job, proc)
    host, _, port = str(rec.get("metrics") or ":0").rpartition(":")
    socks = []
    for _ in range(400):
        try:
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        except OSError:
            break
    for _ in range(50):
        try:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"\x16\x03\x01\x00garbage\r\n\r\n")
                s.recv(100)
        except OSError:
            pass

    def dropped():
        import urllib.request

        try:
            page = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
        except OSError:
            return None
        counts = {line.split('reason="')[1].split('"')[0]: float(line.split()[-1]) for line in page.splitlines()
                  if line.startswith("trainwatch_exporter_dropped_connections_total{")}
        return counts if counts.get("idle", 0) >= len(socks) else None
    counts = wait_for(dropped, 60) or {}
    for s in socks:
        s.close()
    out = stop(proc)
    p.record("exporter_idle_connections", len(socks) == 400 and counts.get("idle", 0) >= 400
             and counts.get("malformed", 0) >= 50,
             f"{len(socks)} idle + 50 malformed: closed and counted {counts}", out)
    p.sweep(home)


def _write_history(path: Path, size: int) -> int:
    """A history file of about `size` bytes (4 ranks a sample); returns the samples written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as f:
        while f.tell() < size:
            lines = []
            for _ in range(4096):
                t = 1_700_000_000.0 + n
                lines.append(f'{{"t": {t}, "r": [[0, {n}, 2.5, 0.1, "compute", 0.0, 1.0], '
                             f'[1, {n}, 2.5, 0.1, "compute", 0.0, 1.0], [2, {n}, 2.5, 0.1, "collective", 0.0, 1.0], '
                             f'[3, {n}, 2.5, 0.1, "collective", 0.0, 1.02]]}}\n')
                n += 1
            f.write("".join(lines))
    return n


RSS_OF_CHILD = ("import resource, subprocess, sys, time; t0 = time.monotonic(); "
                "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.monotonic() - t0, r.returncode); "
                "sys.stderr.write(r.stdout + r.stderr)")


def probe_report_big_history(p: Probes) -> None:
    """`trainwatch report` of a job with a 1 GiB history: RSS and time, against a 128 MiB one."""
    figures = {}
    outs = []
    for size in (128 << 20, 1 << 30):
        home = p.home("report")
        job_dir = home / "jobs" / "big"
        samples = _write_history(job_dir / "history" / "n0.jsonl", size)
        (job_dir / "job.json").write_text(json.dumps({"job": "big", "status": "succeeded", "start_time": 1.7e9,
                                                      "end_time": 1.7e9 + samples, "nproc_per_node": 4}))
        r = subprocess.run([sys.executable, "-c", RSS_OF_CHILD, str(BIN / "trainwatch"), "report", "big", "--out",
                            str(home / "r.html")], env=env_for(home), cwd=str(ROOT), capture_output=True, text=True,
                           timeout=900)
        try:
            rss_kib, seconds, code = r.stdout.split()
            figures[size] = (int(rss_kib) / 1024, float(seconds), int(code))
        except ValueError:
            figures[size] = (float("inf"), float("inf"), -1)
        outs.append(r.stderr)
        shutil.rmtree(job_dir / "history", ignore_errors=True)
    small, big = figures[128 << 20], figures[1 << 30]
    per_byte = (big[1] / 8) / small[1] if small[1] > 0 else float("inf")
    p.record("report_1gib_history", big[2] == 0 and big[0] <= 200 and per_byte < 2.0,
             f"1 GiB: {big[0]:.0f} MB RSS, {big[1]:.1f} s; 128 MiB: {small[0]:.0f} MB, {small[1]:.1f} s "
             f"(time per byte 1 GiB / 128 MiB: {per_byte:.2f})", *outs)


def probe_explain_endless(p: Probes) -> None:
    home = p.home("explain")
    t0 = time.monotonic()
    try:
        r = run(home, "explain", "/dev/zero", timeout=60)
        took, out = time.monotonic() - t0, r.stdout + r.stderr
        ok = r.returncode == 0 and "stopped reading" in out
    except subprocess.TimeoutExpired:
        took, out, ok = time.monotonic() - t0, "", False
    p.record("explain_dev_zero", ok and took <= 10, f"ended in {took:.1f} s with a note", out)


ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\\x9b31m\u202e"


def probe_escape_bytes(p: Probes) -> None:
    """Escape bytes in a log, an incident summary and job.json: none reaches the terminal."""
    home = p.home("escape")
    log_file = home / "rank0.log"
    log_file.write_text(f"[rank0]: RuntimeError: CUDA error: an illegal memory access {ESCAPES}\n"
                        f"{ESCAPES} NCCL watchdog thread terminated {ESCAPES}\n")
    job_dir = home / "jobs" / "esc"
    job_dir.mkdir(parents=True, mode=0o700)
    (job_dir / "job.json").write_text(json.dumps({"job": "esc", "status": "failed", "start_time": time.time() - 9,
                                                  "end_time": time.time(), "entrypoint": f"x.py {ESCAPES}",
                                                  "nproc_per_node": 1}))
    (job_dir / "events.jsonl").write_text(json.dumps({
        "kind": "crash", "id": "i", "time": "2026-01-01T00:00:00+00:00", "culprit_ranks": [0],
        "summary": f"rank 0: {ESCAPES}", "severity": "critical", "evidence": {"error": ESCAPES}}) + "\n")
    outs = [run(home, *cmd, timeout=120) for cmd in (("explain", str(log_file)), ("diagnose", "esc"), ("jobs",),
                                                     ("report", "esc", "--out", str(home / "r.html")))]
    shown = "".join(o.stdout + o.stderr for o in outs)
    leaked = sum(shown.count(c) for c in "\x1b\x07\x9b\u202e")
    page = (home / "r.html").read_text(errors="replace") if (home / "r.html").exists() else ""
    in_page = page.count("\x1b") + page.count("<script>alert")
    p.record("escape_bytes", leaked == 0 and in_page == 0 and all(o.returncode == 0 for o in outs),
             f"{leaked} escape bytes reached the terminal from explain, diagnose, jobs, report; "
             f"{in_page} raw in the HTML report", shown)


def probe_bad_manifests(p: Probes) -> None:
    """Older checkpoints with manifests of every wrong shape, a step that lies, and
    newer ones of the right size that fail verification: saves and retention go on."""
    import torch

    from trainwatch import checkpoint as ck

    home = p.home("manifest")
    root = home / "ckpt"
    crashes, notes = 0, []
    good = ck.save_checkpoint(root, 1, {"w": torch.ones(64)}, keep=None)
    odd = {"files_list": ["state.pt"], "files_string": "state.pt", "files_none": None,
           "deep": "DEEP", "step_lies": 999, "step_huge": int("9" * 400)}
    for i, (name, value) in enumerate(odd.items()):
        d = ck.save_checkpoint(root, 2 + i, {"w": torch.ones(64)}, keep=None)
        m = json.loads((d / "manifest.json").read_text())
        if name.startswith("step"):
            m["step"] = value
        else:
            m["files"] = value
        text = json.dumps(m)
        if value == "DEEP":
            text = text.replace('"DEEP"', "[" * 100_000 + "]" * 100_000)
        (d / "manifest.json").write_text(text)
    for step in (20, 21):  # newer, right size, wrong contents
        d = ck.save_checkpoint(root, step, {"w": torch.full((64,), 2.0)}, keep=None)
        data = bytearray((d / "state.pt").read_bytes())
        data[-30] ^= 0xFF
        (d / "state.pt").write_bytes(bytes(data))
    for _ in range(3):
        try:
            ck.apply_retention(root, keep=1, warn=notes.append)
        except Exception:
            crashes += 1
    try:
        found = ck.find_latest(root, warn=notes.append)
    except Exception:
        crashes, found = crashes + 1, None
    kept = good.exists() and found is not None and found.path == good
    p.data_lost += 0 if kept else 1
    p.record("bad_manifests", crashes == 0 and kept,
             f"{crashes} crashes in 3 retention passes and a resume; newest loadable {good.name} "
             f"{'kept and chosen' if kept else 'LOST'}; {len(notes)} warnings")


def _unshare_launch(home: Path, setup: str, job: str) -> subprocess.CompletedProcess | None:
    if shutil.which("unshare") is None:
        return None
    script = (f"set -e; {setup}; {BIN / 'trainwatch'} launch --standalone --nproc-per-node 1 --job {job} "
              f"{SCRIPT} --steps 3 || code=$?; echo; echo left: $(ls /dev/shm | grep -c -- '-{job}@' || true); "
              "exit ${code:-0}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env_for(home), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=300)


def probe_start_without_room(p: Probes) -> None:
    """A full home, a read-only home, no room in /dev/shm (private tmpfs mounts in a mount namespace)."""
    for name, setup in (
            ("full_home", "mount -t tmpfs -o size=32k tmpfs {home}; "
                          "dd if=/dev/zero of={home}/fill bs=4k count=100 2>/dev/null || true"),
            ("readonly_home", "mount -t tmpfs -o ro,size=64k tmpfs {home}"),
            ("no_shm_room", "mount -t tmpfs -o size=4k tmpfs /dev/shm; "
                            "dd if=/dev/zero of=/dev/shm/fill bs=4k count=2 2>/dev/null || true")):
        home, job = p.home("room"), f"chaos-{uuid.uuid4().hex[:6]}"
        r = _unshare_launch(home, setup.format(home=home), job)
        if r is None:
            p.record(f"start_{name}", False, "unshare not available")
            continue
        errors = [line for line in r.stderr.splitlines() if line.strip()]
        left = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "left: ?"
        leaked = [s for s in Path("/dev/shm").glob(f"*-{job}@*")]
        p.record(f"start_{name}", r.returncode == 2 and len(errors) == 1 and left == "left: 0" and not leaked,
                 f"exit {r.returncode}; {errors[0][:140] if errors else 'no error line'}; segments {left}",
                 r.stdout, r.stderr)


ESCAPER = """
import subprocess, sys
subprocess.Popen(["setsid", sys.executable, "-c", "import time; time.sleep(600)  # {tag}"],
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def probe_setsid_child(p: Probes) -> None:
    home, job = p.home("setsid"), f"chaos-{uuid.uuid4().hex[:6]}"
    script = home / "escape.py"
    script.write_text(ESCAPER.replace("{tag}", job))
    r = run(home, "launch", "--standalone", "--nproc-per-node", "1", "--job", job, str(script), timeout=300)

    def escapers():
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(job in part for part in proc.info["cmdline"] or []):
                    out.append(proc)
            except psutil.Error:
                pass
        return out
    gone = wait_for(lambda: not escapers(), 10)
    left = escapers()
    for proc in left:
        proc.kill()
    p.orphans += len(left)
    p.record("setsid_child", r.returncode == 0 and bool(gone), f"exit {r.returncode}; {len(left)} setsid child(ren) "
             "left after the job ended", r.stdout, r.stderr)


def probe_concurrent_diagnoses(p: Probes) -> None:
    from concurrent.futures import ThreadPoolExecutor

    home, job = p.home("diag"), f"chaos-{uuid.uuid4().hex[:6]}"
    proc = start(home, "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", str(SCRIPT),
                 "--steps", "100000", "--sleep", "0.05")
    wait_running(home, job, proc)
    wait_for(lambda: len((json.loads(run(home, "diagnose", job, "--json").stdout or "{}").get("stack_groups"))
                         or []) > 0, 120, interval=0.5)

    def diagnose():
        return run(home, "diagnose", job, "--json", "--timeout", "30", timeout=180)
    with ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(lambda _: diagnose(), range(20)))
    complete = 0
    for o in outs:
        try:
            rep = json.loads(o.stdout)
        except ValueError:
            continue
        ranks = {r for g in rep.get("stack_groups") or [] for r in g.get("ranks") or []}
        complete += ranks == {0, 1} and not any(r.get("capture_error") for r in rep.get("ranks") or [])
    out = stop(proc)
    p.record("concurrent_diagnoses", complete == 20, f"{complete} of 20 simultaneous diagnoses have every rank's "
             "stacks", out, *(o.stderr for o in outs))
    p.sweep(home)


def probe_cli_edges(p: Probes) -> None:
    home = p.home("cli")
    outs = []
    for args in ("--help", "--version", "", "jobs"):
        outs.append(subprocess.run(["bash", "-c", f"{BIN / 'trainwatch'} {args} | true"], env=env_for(home),
                                   cwd=str(ROOT), capture_output=True, text=True, timeout=60))
    bogus = run(home, "dashboards", "--bogus", timeout=60)
    quiet = all(o.stderr == "" for o in outs)
    p.record("cli_pipe_and_usage", quiet and one_error_line(bogus),
             f"closed pipe: {'silent' if quiet else 'NOISE'}; dashboards --bogus: {bogus.stderr.strip()[:100]}",
             *(o.stderr for o in outs), bogus.stderr)


SMOKE_PROBES = ("planted_symlinks", "escape_bytes", "bad_manifests", "cli_edges")
"""--smoke: a launch, the read-only commands on hostile input, checkpoint code, the CLI."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated probe names (default: every probe)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; " + ", ".join(SMOKE_PROBES))
    args = parser.parse_args()
    only = set(SMOKE_PROBES) if args.smoke else {n for n in args.only.split(",") if n}
    p = Probes()
    try:
        for probe in (probe_one_name_one_run, probe_sidecar_sigkill, probe_rank_sigkill_mid_checkpoint,
                      probe_disk_full, probe_planted_symlinks, probe_hostile_state, probe_store_forgery,
                      probe_exporter_idle, probe_report_big_history, probe_explain_endless, probe_escape_bytes,
                      probe_bad_manifests, probe_start_without_room, probe_setsid_child,
                      probe_concurrent_diagnoses, probe_cli_edges):
            if only and probe.__name__.removeprefix("probe_") not in only:
                continue
            log(f"{probe.__name__.removeprefix('probe_')} ...")
            probe(p)
    finally:
        p.cleanup()
    held = sum(r["held"] for r in p.results)
    print(json.dumps({"probes": len(p.results), "held": held, "orphans_left": p.orphans, "tracebacks": p.tracebacks,
                      "data_lost": p.data_lost, "failed": [r["probe"] for r in p.results if not r["held"]]}))
    sys.exit(0 if held == len(p.results) and not p.orphans else 1)


if __name__ == "__main__":
    import common

    common.main(main)
