"""One fault, one story, end to end: real ranks of the integrated trainer, a
real injected fault, and every reader (the console, events.jsonl, `diagnose
--json` polled throughout, the exporter's open-incident gauge) telling the
same incident: one id, kind, culprit and runbook, open until it is over."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import pytest
import requests

from util import BIN, ROOT, env_for, events, job_json, reap, stop_group, wait_for

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


def open_gauge(job_rec) -> dict[str, float]:
    text = requests.get(f"http://{job_rec['metrics']}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'trainwatch_incident_open\{.*kind="(\w+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@pytest.mark.parametrize("floor", [None, "2"], ids=["default-floor", "hang-floor-2"])
def test_a_hang_is_one_story_in_every_reader(tmp_path, floor):
    job = f"story-{floor or 'default'}"
    extra = ["--hang-floor-s", floor] if floor else []
    proc, log_path = launch(tmp_path, job, *extra, "--inject", "hang:where=dataloader,rank=1,step=20",
                            *TRAINER, "--max-steps", "60")
    polls: list[tuple[tuple[float, float], dict]] = []
    gauges: list[dict] = []
    stop = threading.Event()

    def scrape():  # the exporter, read every 0.1 s (a hang is open for seconds)
        while not stop.is_set():
            rec = job_json(tmp_path, job)
            if rec and rec.get("metrics"):
                try:
                    gauges.append(open_gauge(rec))
                except requests.RequestException:
                    pass
            stop.wait(0.1)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        def hang_seen():
            if proc.poll() is not None:
                return True
            asked = time.time()  # what diagnose says is about some moment while it ran
            report = diagnose(tmp_path, job)
            if report is not None:
                polls.append(((asked, time.time()), report))
            time.sleep(0.5)
            done = [e for e in events(tmp_path, job) if e.kind == "hang" and e.status == "resolved"]
            return bool(done)

        wait_for(hang_seen, 240, interval=0.0, what="the hang to be detected, restarted and resolved")
        assert proc.wait(timeout=240) == 0, log_path.read_text()[-4000:]
    finally:
        stop.set()
        scraper.join(timeout=10)
        stop_group(proc)
        reap(tmp_path)
    console = log_path.read_text()
    hangs = [e for e in events(tmp_path, job) if e.kind == "hang"]
    assert len(hangs) == 1, hangs  # one fault, one incident
    hang = hangs[0]
    assert hang.culprit_ranks == [1] and hang.status == "resolved" and hang.resolution.duration_s >= 0
    assert not [e for e in events(tmp_path, job) if e.kind == "collective_mismatch"]
    # The console said it once, with the same id and runbook, and said when it was over.
    said = [line for line in console.splitlines() if "INCIDENT hang" in line]
    assert len(said) == 1 and f"[{hang.id}]" in said[0], said
    assert f"RESOLVED hang {hang.id}" in console
    assert "INCIDENT restart" not in console and f"RECOVERED after hang {hang.id}" in console
    # diagnose: never healthy while the incident was open, and naming it.
    opened = hang.opened_time
    resolved = hang.resolution.time
    # A poll that ran wholly while the incident was open (one that began before
    # the resolution was written may have read it).
    during = [r for (begin, end), r in polls if opened <= begin and end <= resolved]
    assert polls and all(r["verdict"]["category"] != "healthy" for r in during), [
        (r["status"], r["verdict"]) for r in during]
    named = [r for r in during if r["verdict"]["culprit_ranks"]]
    assert all(r["verdict"]["culprit_ranks"] == [1] for r in named), [r["verdict"] for r in named]
    assert all(r["verdict"]["runbook"] == hang.runbook for r in named if r["status"] != "running"), (
        hang.runbook, [r["verdict"] for r in named])
    listed = [i for _, r in polls for i in r["incidents"] if i.get("id") == hang.id]
    assert listed and {i["kind"] for i in listed} == {"hang"}
    # The exporter said it was open, and no more once it was resolved.
    assert any(g.get("hang") == 1.0 for g in gauges), gauges


def test_a_persistent_straggler_and_a_nan_streak_are_one_incident_each(tmp_path):
    job = "story-straggler"
    # --nan-policy alert: the trainer trains on through the NaN (the default stops and rolls back).
    proc, log_path = launch(tmp_path, job, "--no-restart", "--nan-policy", "alert",
                            "--inject", "straggler:delay=0.3,rank=1,step=5",
                            "--inject", "nan:rank=0,step=15", *TRAINER, "--max-steps", "100000")
    try:
        t0 = time.monotonic()
        wait_for(lambda: [e for e in events(tmp_path, job) if e.kind == "straggler"], 120, what="a straggler")
        rec = wait_for(lambda: (job_json(tmp_path, job) or {}).get("metrics") and job_json(tmp_path, job), 30,
                       what="the exporter")
        # 60 s of a persistent straggler (and a loss that stays NaN from step 15 on)
        wait_for(lambda: time.monotonic() - t0 > 60 or proc.poll() is not None, 120, interval=1.0,
                 what="60 s of straggling")
        assert proc.poll() is None, log_path.read_text()[-4000:]
        gauge = open_gauge(rec)
        report = diagnose(tmp_path, job)
    finally:
        stop_group(proc)
        reap(tmp_path)
    stragglers = [e for e in events(tmp_path, job) if e.kind == "straggler"]
    nans = [e for e in events(tmp_path, job) if e.kind == "loss_nan"]
    assert len(stragglers) == 1 and stragglers[0].culprit_ranks == [1], stragglers
    assert len(nans) == 1, nans
    assert gauge.get("straggler") == 1.0 and gauge.get("loss_nan") == 1.0, gauge
    assert report is not None and report["verdict"]["category"] in ("straggler", "loss_nan"), report["verdict"]
    console = log_path.read_text()
    assert console.count("INCIDENT straggler") == 1 and console.count("INCIDENT loss_nan") == 1


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
