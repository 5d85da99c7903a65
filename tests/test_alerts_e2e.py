"""The shipped alert rules on a real Prometheus, over a real fault that lasts:
a straggler that persists for six minutes pages `TrainwatchStraggler` once
(its `for: 5m` holds on the open incident, whatever its ratio does meanwhile),
and the incident stays one incident the whole time."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest
import requests

from util import BIN, ROOT, env_for, events, job_json, prometheus_server, stop_group, wait_for

pytestmark = pytest.mark.slow

OUT = ROOT / "dashboards"
JOB = "alert-straggler"
RUN_S = 390.0
"""Six and a half minutes of straggling: the rule's five minutes, and room to see it fire once and stay firing."""


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
    shutil.copy(OUT / "alert-rules.yml", cfg_dir / "alert-rules.yml")
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
            wait_for(lambda: time.time() - opened["opened_time"] > RUN_S or proc.poll() is not None, RUN_S + 60,
                     interval=1.0, what="six and a half minutes of straggling")
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
    # ... five minutes (the rule's `for`) after the incident opened, not before.
    assert times[0] - opened["opened_time"] >= 295.0, times[0] - opened["opened_time"]
    assert pending and min(float(t) for s in pending for t, _ in s["values"]) < times[0]
    # One incident for the whole run, still open, with one console line.
    stragglers = [e for e in events(home, JOB) if e.kind == "straggler"]
    assert len(stragglers) == 1 and stragglers[0].culprit_ranks == [1], stragglers
    assert log_path.read_text().count("INCIDENT straggler") == 1
    assert record is not None
