"""The shipped alert rules on a real Prometheus, over real faults that last:
a straggler that persists pages `TrainwatchStraggler` once (its `for:` holds on
the open incident, whatever its ratio does meanwhile), a loss that stays NaN
pages `TrainwatchLossNaN`, and each stays one incident the whole time, in
events.jsonl, the console, the exporter's open-incident gauge and `diagnose`.

The rules run as a test copy whose `for:` durations are scaled down
(`FOR_SCALE`): the same expressions, labels and pending-then-firing logic,
with the straggler's five minutes as twenty seconds."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import requests

from util import BIN, ROOT, env_for, events, job_json, open_gauge, prometheus_server, reap, stop_group, wait_for

pytestmark = pytest.mark.slow

OUT = ROOT / "dashboards"
JOB = "alert-straggler-nan"
FOR_SCALE = 15
"""The test copy's `for:` durations are the shipped ones divided by this (5m -> 20s)."""


def scaled_for(rules: str, scale: int) -> tuple[str, dict[str, float]]:
    """The rules with every `for: <N><unit>` divided by `scale`, and each alert's scaled `for` in seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    alert, fors = None, {}

    def one(line: str) -> str:
        nonlocal alert
        named = re.match(r"\s*- alert: (\w+)", line)
        if named:
            alert = named.group(1)
        m = re.match(r"(\s*for: )(\d+)([smh])\s*$", line)
        if not m:
            return line
        seconds = max(1, int(m.group(2)) * units[m.group(3)] // scale)
        fors[alert] = float(seconds)
        return f"{m.group(1)}{seconds}s"

    return "\n".join(one(line) for line in rules.splitlines()) + "\n", fors


def test_scaled_for_keeps_everything_but_the_durations():
    shipped = (OUT / "alert-rules.yml").read_text()
    scaled, fors = scaled_for(shipped, FOR_SCALE)
    assert fors["TrainwatchStraggler"] == 300 / FOR_SCALE
    assert re.sub(r"for: \S+", "for:", scaled).splitlines() == re.sub(r"for: \S+", "for:", shipped).splitlines()


def query_range(url: str, expr: str, start: float, end: float) -> list[dict]:
    r = requests.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": 1},
                     timeout=30).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def diagnose(home, job) -> dict | None:
    r = subprocess.run([str(BIN / "trainwatch"), "diagnose", job, "--json", "--timeout", "5"], env=env_for(home),
                       capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    return json.loads(r.stdout) if r.returncode == 0 else None


def firing(url: str, alert: str, state: str, start: float, end: float) -> list[dict]:
    return query_range(url, f'ALERTS{{alertname="{alert}",trainwatch_job="{JOB}",alertstate="{state}"}}', start, end)


def test_a_persistent_straggler_and_a_nan_streak_page_once_each_and_stay_one_incident_each(tmp_path):
    home, cfg_dir = tmp_path / "home", tmp_path / "prometheus"
    home.mkdir(mode=0o700)
    cfg_dir.mkdir()
    config, n = re.subn(r"(scrape_interval|evaluation_interval): 15s", r"\1: 1s", (OUT / "prometheus.yml").read_text())
    assert n == 2
    rules, fors = scaled_for((OUT / "alert-rules.yml").read_text(), FOR_SCALE)
    (cfg_dir / "alert-rules.yml").write_text(rules)
    for_s = fors["TrainwatchStraggler"]
    run_s = for_s + 15.0  # the rule's `for`, and room to see it fire once and stay firing
    (home / "targets").mkdir(mode=0o700)
    (cfg_dir / "targets").symlink_to(home / "targets")
    log_path = tmp_path / "launch.log"
    with prometheus_server(cfg_dir, config) as url:
        start = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [str(BIN / "trainwatch"), "launch", "--nproc-per-node", "2", "--job", JOB, "--no-restart",
                 # --nan-policy alert: the trainer trains on through the NaN (the default stops and rolls back).
                 "--nan-policy", "alert", "--inject", "nan:rank=0,step=15",
                 "--inject", "straggler:delay=0.3,rank=1,step=5", "-m", "trainwatch.trainer", "--model-size", "tiny",
                 "--max-steps", "1000000", "--log-interval", "1000"],
                env=env_for(home), stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        try:
            opened = wait_for(lambda: [e for e in events(home, JOB) if e.kind == "straggler"], 180,
                              what="the straggler incident")[0]
            wait_for(lambda: time.time() - opened.opened_time > run_s or proc.poll() is not None, run_s + 60,
                     interval=0.5, what="the straggler to outlast the rule's `for`")
            assert proc.poll() is None, log_path.read_text()[-3000:]
            record = wait_for(lambda: (job_json(home, JOB) or {}).get("metrics") and job_json(home, JOB), 30,
                              what="the exporter's address")
            gauge = open_gauge(record)
            report = diagnose(home, JOB)
            end = time.time()
            fired = firing(url, "TrainwatchStraggler", "firing", start, end)
            pending = firing(url, "TrainwatchStraggler", "pending", start, end)
            nan_fired = firing(url, "TrainwatchLossNaN", "firing", start, end)
        finally:
            stop_group(proc)
            reap(home)
    # Fired, as one unbroken run of samples: it paged once.
    assert len(fired) == 1, fired
    times = [float(t) for t, _ in fired[0]["values"]]
    assert times and max(b - a for a, b in zip(times, times[1:] + times[-1:])) <= 2.0, times
    # ... the rule's `for` after the incident opened, not before (a scrape of slack).
    assert times[0] - opened.opened_time >= for_s - 1.0, times[0] - opened.opened_time
    assert pending and min(float(t) for s in pending for t, _ in s["values"]) < times[0]
    # The NaN streak (no `for:`) fired as one unbroken run too.
    assert len(nan_fired) == 1, nan_fired
    # One incident of each kind for the whole run, still open, with one console line each, in every reader.
    stragglers = [e for e in events(home, JOB) if e.kind == "straggler"]
    nans = [e for e in events(home, JOB) if e.kind == "loss_nan"]
    assert len(stragglers) == 1 and stragglers[0].culprit_ranks == [1], stragglers
    assert len(nans) == 1, nans
    assert gauge.get("straggler") == 1.0 and gauge.get("loss_nan") == 1.0, gauge
    assert report is not None and report["verdict"]["category"] in ("straggler", "loss_nan"), report["verdict"]
    console = log_path.read_text()
    assert console.count("INCIDENT straggler") == 1 and console.count("INCIDENT loss_nan") == 1
