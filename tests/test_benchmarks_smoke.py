"""Every benchmark runs, and stops cleanly.

Each benchmark's `--smoke` (its smallest run through every part, figures that
mean nothing) exits 0 and ends with its JSON line; they run side by side, each
in its own temp dir, sharing nothing, and leave nothing of trainwatch's there
(no scratch home, no scrape target). A benchmark
sent SIGTERM while the job it launched trains stops that job: no process of
it, no slot segment, no scrape target, no scratch home left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from util import wait_for

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
SMOKE_TIMEOUT_S = 110
GPU_CHECK_TIMEOUT_S = 330
"""gpu_check's smoke runs its checks within 300 s (its SMOKE_TOTAL_S) where there is a GPU;
without one it skips each at once."""
WORKERS = 3
"""Smokes run at once: most of their time is waits (a hang threshold, a rendezvous)."""

# benchmark -> keys its last line must hold; the longest first, so the pool ends together.
EXPECTED = {
    "multinode": ("culprit_ok", "diagnose_sees_all_ranks", "recovered", "node_lost_s", "aggregate_ms_1024_ranks",
                  "sidecar_round_ms_4096_ranks"),
    "detection": ("faults", "incidents_per_fault", "false_incidents", "false_incidents_clients",
                  "watchdog_cpu_fraction", "tick_ms_4096_ranks"),
    "overhead": ("record_ns", "step_overhead_ratio", "zero_code_step_ratio", "collective_wrapper_ns"),
    "recovery": ("recovered", "bitwise_equal", "recovery_s", "breakdown"),
    "goodput": ("tool", "goodput", "steps", "badput_s", "peers", "notes"),
    "scale": ("scrape_bytes", "tick_period_ms", "diagnose_s", "series_per_default_panel_max"),
    "stragglers": ("healthy_runs", "false_stragglers", "true_straggler_detected", "detect_s", "leftovers"),
    "chaos": ("probes", "held", "orphans_left", "tracebacks", "data_lost", "failed"),
    "explain_accuracy": ("dev", "retired", "heldout", "earlier_heldout_rounds"),
    "gpu_check": ("summary",),
}

pytestmark = pytest.mark.slow


def bench_env(tmp: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    env.update(TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               TRAINWATCH_TARGETS_DIR=str(tmp / "targets"), **extra)
    return env


def run_smoke(name: str, tmp: Path) -> dict:
    tmp.mkdir(parents=True)
    t0 = time.monotonic()
    timeout = GPU_CHECK_TIMEOUT_S if name == "gpu_check" else SMOKE_TIMEOUT_S
    try:
        p = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke"], capture_output=True, text=True,
                           timeout=timeout, env=bench_env(tmp), cwd=str(ROOT))
        code, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = "timeout", e.stdout or "", e.stderr or ""
    return {"code": code, "out": out if isinstance(out, str) else out.decode(errors="replace"),
            "err": err if isinstance(err, str) else err.decode(errors="replace"),
            "seconds": round(time.monotonic() - t0, 1), "tmp": tmp}


@pytest.fixture(scope="module")
def smokes(tmp_path_factory):
    """Every benchmark's smoke, WORKERS at a time."""
    base = tmp_path_factory.mktemp("smoke")
    t0 = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {name: pool.submit(run_smoke, name, base / name) for name in EXPECTED}
        results = {name: f.result() for name, f in futures.items()}
    results["_wall_s"] = round(time.monotonic() - t0, 1)
    print(f"\nsmoke wall {results['_wall_s']} s: "
          + ", ".join(f"{n} {r['seconds']} s" for n, r in results.items() if n != "_wall_s"))
    return results


@pytest.mark.parametrize("name", list(EXPECTED))
def test_smoke_runs_and_ends_with_its_json_line(smokes, name):
    r = smokes[name]
    assert r["code"] == 0, f"{name} --smoke exited {r['code']} after {r['seconds']} s:\n{r['err'][-4000:]}"
    last = json.loads(r["out"].strip().splitlines()[-1])
    missing = [k for k in EXPECTED[name] if k not in last]
    assert not missing, f"{name}: last line lacks {missing}: {last}"
    left = sorted(p.name for p in r["tmp"].glob("trainwatch-*"))  # torch's own caches and logs aside
    assert left == [], f"{name} left {left} in its temp dir"
    assert not any((r["tmp"] / "targets").glob("*.json")), f"{name} left scrape targets"
    if name == "gpu_check" and last["summary"]["device"] == "none":
        assert last["summary"]["no_gpu"].startswith("no GPU") and last["summary"]["skip"] > 0
    if name == "goodput":
        assert "skipped" in last["notes"]["peers"]


def job_processes(home: Path) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TRAINWATCH_HOME") == str(home) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def alive(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_sigterm_stops_the_benchmark_and_everything_it_started(tmp_path):
    """detection.py's first fault row launches a 2-rank job; once its ranks train,
    SIGTERM to the benchmark: it exits 143, and nothing of the job is left."""
    proc = subprocess.Popen([sys.executable, str(BENCH / "detection.py"), "--only", "hang_compute", "--ranks", "2",
                             "--skip-healthy", "--client-rounds", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=bench_env(tmp_path), cwd=str(ROOT))
    try:
        def training():
            for record in tmp_path.glob("trainwatch-bench-*/jobs/*/job.json"):
                try:
                    rec = json.loads(record.read_text())
                except (OSError, ValueError):
                    continue
                ranks = [r.get("pid") for r in rec.get("ranks") or []]
                if rec.get("status") == "running" and len(ranks) == 2 and all(ranks) and rec.get("sidecar_pid"):
                    return record.parents[2], rec
            return None

        home, rec = wait_for(training, 25, 0.1, what="the benchmark's job training")
        pids = [rec["launcher_pid"], rec["sidecar_pid"], *(r["pid"] for r in rec["ranks"])]
        started = {pid: psutil.Process(pid).create_time() for pid in pids if psutil.pid_exists(pid)}
        assert all(alive(pid, t) for pid, t in started.items()) and len(started) == len(pids)
        segment = Path(rec["slots"])
        assert segment.exists() and list((tmp_path / "targets").glob("*.json"))
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [pid for pid, t in started.items() if alive(pid, t)] == []
    assert job_processes(home) == []
    assert not segment.exists()
    assert list((tmp_path / "targets").glob("*.json")) == []
    assert [p.name for p in tmp_path.glob("trainwatch-*")] == []  # torch's own caches and logs aside
