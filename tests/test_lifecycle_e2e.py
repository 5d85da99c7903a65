"""One fault, one story, end to end: real ranks of the integrated trainer, a
real injected fault, and every reader (the console, events.jsonl, `diagnose
--json` polled throughout, the exporter's open-incident gauge) telling the
same incident: one id, kind, culprit and runbook, open until it is over."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from util import BIN, ROOT, env_for, events, job_json, open_gauge, reap, stop_group, wait_for

pytestmark = pytest.mark.slow

TRAINER = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--log-interval", "1000"]


def launch(home, job, *args, log_name=None):
    log_path = home.parent / f"{log_name or job}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([str(BIN / "trainwatch"), "launch", "--nproc-per-node", "2", "--job", job,
                             "--metrics-port", "0", *args],
                            env=env_for(home), stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                            start_new_session=True)
    log.close()
    return proc, log_path


def diagnose(home, job) -> dict | None:
    r = subprocess.run([str(BIN / "trainwatch"), "diagnose", job, "--json", "--timeout", "5"], env=env_for(home),
                       capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    return json.loads(r.stdout) if r.returncode == 0 else None


def test_node_name_names_the_node_everywhere(tmp_path):
    job = "story-node"
    proc, log_path = launch(tmp_path, job, "--node-name", "nodeA", "--inject", "crash:rank=1,step=5",
                            "--max-restarts", "0", *TRAINER, "--max-steps", "100000")
    try:
        proc.wait(timeout=240)
    finally:
        stop_group(proc)
        reap(tmp_path)
    rec = job_json(tmp_path, job) or json.loads((tmp_path / "jobs" / job / "nodes" / "nodeA" / "job.json").read_text())
    assert {r["node"] for r in rec["ranks"]} == {"nodeA"}, rec["ranks"]
    crash = [e for e in events(tmp_path, job) if e.kind == "crash"]
    assert crash and crash[0].node == "nodeA"
    assert "vm" not in {r.get("node") for r in rec["ranks"]}


EARLY_EXIT = '''
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(200):
    if rank == 1 and step == 5:
        os._exit(0)  # leaves without a word: no exit hooks, no error
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    time.sleep(0.02)
dist.destroy_process_group()
'''


def test_a_rank_that_leaves_early_is_the_culprit_not_its_peer(tmp_path):
    script = tmp_path / "early_exit.py"
    script.write_text(EARLY_EXIT)
    job = "story-early-exit"
    proc, log_path = launch(tmp_path, job, "--max-restarts", "0", str(script))
    try:
        proc.wait(timeout=300)
    finally:
        stop_group(proc)
        reap(tmp_path)
    crashes = [e for e in events(tmp_path, job) if e.kind == "crash"]
    assert len(crashes) == 1, (crashes, log_path.read_text()[-3000:])
    assert crashes[0].culprit_ranks == [1] and 0 in crashes[0].victims, crashes[0]
    assert "before finishing" in crashes[0].summary
