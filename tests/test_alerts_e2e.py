"""The shipped alert rules on a real Prometheus, over a real fault that lasts:
a straggler that persists pages `TrainwatchStraggler` once (its `for:` holds on
the open incident, whatever its ratio does meanwhile), and the incident stays
one incident the whole time.

The rules run as a test copy whose `for:` durations are scaled down
(`FOR_SCALE`): the same expressions, labels and pending-then-firing logic,
with the straggler's five minutes as twenty seconds."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import requests

from util import BIN, ROOT, env_for, events, job_json, prometheus_server, stop_group, wait_for

pytestmark = pytest.mark.slow

OUT = ROOT / "dashboards"
JOB = "alert-straggler"
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


def test_a_persistent_straggler_pages_once(tmp_path):
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
                 "--inject", "straggler:delay=0.3,rank=1,step=5", "-m", "trainwatch.trainer", "--model-size", "tiny",
                 "--max-steps", "1000000", "--log-interval", "1000"],
                env=env_for(home), stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        try:
            opened = wait_for(lambda: [e for e in events(home, JOB) if e.kind == "straggler"], 180,
                              what="the straggler incident")[0]
            wait_for(lambda: time.time() - opened.opened_time > run_s or proc.poll() is not None, run_s + 60,
                     interval=0.5, what="the straggler to outlast the rule's `for`")
            assert proc.poll() is None, log_path.read_text()[-3000:]
            end = time.time()
            fired = query_range(url, f'ALERTS{{alertname="TrainwatchStraggler",trainwatch_job="{JOB}",'
                                     f'alertstate="firing"}}', start, end)
            pending = query_range(url, f'ALERTS{{alertname="TrainwatchStraggler",trainwatch_job="{JOB}",'
                                       f'alertstate="pending"}}', start, end)
            record = job_json(home, JOB)
        finally:
            stop_group(proc)
    # Fired, as one unbroken run of samples: it paged once.
    assert len(fired) == 1, fired
    times = [float(t) for t, _ in fired[0]["values"]]
    assert times and max(b - a for a, b in zip(times, times[1:] + times[-1:])) <= 2.0, times
    # ... the rule's `for` after the incident opened, not before (a scrape of slack).
    assert times[0] - opened.opened_time >= for_s - 1.0, times[0] - opened.opened_time
    assert pending and min(float(t) for s in pending for t, _ in s["values"]) < times[0]
    # One incident for the whole run, still open, with one console line.
    stragglers = [e for e in events(home, JOB) if e.kind == "straggler"]
    assert len(stragglers) == 1 and stragglers[0].culprit_ranks == [1], stragglers
    assert log_path.read_text().count("INCIDENT straggler") == 1
    assert record is not None
