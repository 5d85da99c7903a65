"""Chaos benchmark: faults and abuse against real `trainwatch launch` runs.

    python benchmarks/chaos.py

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

from common import BIN, ROOT, env_for, finish, job_json, log, new_home, wait_for

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
    return subprocess.Popen([str(BIN / "trainwatch"), "launch", *args], env=env_for(home), cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=preexec)


def run(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "trainwatch"), *args], env=env_for(home), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


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
    """SIGKILL rank 0 while its checkpoint's temp directory is being written."""
    home, job = p.home("ckpt"), f"chaos-{uuid.uuid4().hex[:6]}"
    ckpt_dir = home / "jobs" / job / "checkpoints"
    proc = start(home, "--nproc-per-node", "2", "--job", job, "--metrics-port", "0", *TRAINER[:2],
                 "--model-size", "medium", "--batch-size", "2", "--seq-len", "32", "--log-interval", "5",
                 "--max-steps", "24", "--ckpt-interval", "4")
    rec = wait_running(home, job, proc, 300)

    def writing():
        if proc.poll() is not None:
            return "exited"
        tmp = [d for d in ckpt_dir.glob(".tmp-step-*") if (d / "state.pt").exists()] if ckpt_dir.is_dir() else []
        done = [d for d in ckpt_dir.glob("step-*")] if ckpt_dir.is_dir() else []
        return tmp[0] if tmp and done else None
    hit = wait_for(writing, 300, interval=0.002)
    before = checkpoints(ckpt_dir)
    killed = None
    if isinstance(hit, Path):
        for child in children(rec.get("launcher_pid", 0)):
            try:
                if child.environ().get("RANK") == "0" and "trainwatch.watchdog" not in " ".join(child.cmdline()):
                    child.kill()
                    killed = hit.name
                    break
            except psutil.Error:
                pass
    out = finish(proc, 600)
    after = checkpoints(ckpt_dir)
    lost = sum(1 for name, ok in before.items() if ok and name in after and not after[name])
    # Retention may delete old checkpoints on purpose; a checkpoint is lost when
    # the newest complete one before the kill is neither kept nor superseded.
    newest_before = max((n for n, ok in before.items() if ok), default=None)
    if newest_before and not any(ok and n >= newest_before for n, ok in after.items()):
        lost += 1
    p.data_lost += lost
    leftovers = list(ckpt_dir.glob(".tmp-*"))
    rec = job_json(home, job)
    p.record("rank_sigkill_mid_checkpoint", bool(killed) and proc.returncode == 0 and lost == 0
             and all(after.values()) and "step-00000024" in after and not leftovers,
             f"killed rank 0 writing {killed}; exit {proc.returncode} after {rec.get('restarts')} restart(s); "
             f"checkpoints {sorted(after)}; {len(leftovers)} temp dirs left", out)
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
        lines = [line for line in out.splitlines() if "cannot write checkpoint" in line]
        kept = after.get("step-00000010") is True or not mounted  # under ulimit no checkpoint fits
        held = proc.returncode != 0 and bool(lines) and "free" in lines[0] and restarts <= 1 and kept
        p.data_lost += 0 if kept else 1
        p.record("disk_full_during_checkpoint", held,
                 f"{'tmpfs 3 MiB' if mounted else 'ulimit -f 1 MiB'}: exit {proc.returncode}, {restarts} restart(s), "
                 f"kept {sorted(n for n, ok in after.items() if ok)}; "
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


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    p = Probes()
    try:
        for probe in (probe_one_name_one_run, probe_sidecar_sigkill, probe_rank_sigkill_mid_checkpoint,
                      probe_disk_full, probe_planted_symlinks, probe_hostile_state):
            log(f"{probe.__name__.removeprefix('probe_')} ...")
            probe(p)
    finally:
        p.cleanup()
    held = sum(r["held"] for r in p.results)
    print(json.dumps({"probes": len(p.results), "held": held, "orphans_left": p.orphans, "tracebacks": p.tracebacks,
                      "data_lost": p.data_lost, "failed": [r["probe"] for r in p.results if not r["held"]]}))
    sys.exit(0 if held == len(p.results) and not p.orphans else 1)


if __name__ == "__main__":
    main()
