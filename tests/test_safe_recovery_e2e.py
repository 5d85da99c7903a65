"""Recovery that never makes a job worse, end to end with real ranks (gloo):
a NaN run is rolled back and never ends as succeeded, errors a restart cannot
fix are not restarted, transient ones are, and a preempted job checkpoints
and resumes bit for bit."""

from __future__ import annotations

import re
import signal
import socket
import uuid
from pathlib import Path

import pytest
import torch

from util import SCRIPTS, job_json, start, trainwatch, wait_for

pytestmark = pytest.mark.slow

TINY = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--log-interval", "10"]
NAN_THEN_CRASH = ["--inject", "nan:rank=1,step=10", "--inject", "crash:rank=1,step=40"]


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def assert_all_finite(ckpt_dir):
    from trainwatch.checkpoint import load_checkpoint, valid_checkpoints
    from trainwatch.finite import nonfinite_tensors

    found = list(valid_checkpoints(ckpt_dir)) + list(valid_checkpoints(ckpt_dir / "rolled-back"))
    assert found
    for info in found:
        assert nonfinite_tensors(load_checkpoint(info), limit=1) == [], info.path


def after_resume(out: str) -> str:
    return out[out.index("rolled back to"):]


def test_a_nan_run_rolls_back_and_fails_by_default(tmp_path):
    job, ckpt = name("nan"), tmp_path / "ckpt"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, *NAN_THEN_CRASH, *TINY,
                   "--max-steps", "80", "--ckpt-interval", "5", "--ckpt-dir", str(ckpt), timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    rolled = re.search(r"rolled back to \S+step-(\d+)\S* \(step (\d+)\): the loss was non-finite at step 10", out)
    assert rolled and int(rolled.group(2)) < 10, out[-4000:]
    later = after_resume(out)
    assert not re.search(r"\| loss (nan|inf)", later) and "final loss nan" not in later, later[-3000:]
    assert "not restarting: rank" in later and "NonFiniteLoss" in later and "again at step 10" in later
    rec = job_json(tmp_path, job)
    assert rec["status"] == "failed" and rec["restarts"] == 1, rec
    assert re.search(r"error: rank \d: NonFiniteLoss: non-finite loss nan at step 10", r.stderr), r.stderr[-3000:]
    assert "loss_nan x" in r.stderr
    assert_all_finite(ckpt)


def test_a_nan_run_recovers_when_it_skips_the_batches(tmp_path):
    job, ckpt = name("skip"), tmp_path / "ckpt"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, *NAN_THEN_CRASH, *TINY,
                   "--max-steps", "80", "--ckpt-interval", "5", "--ckpt-dir", str(ckpt), "--nan-skip-batches", "5",
                   timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "skipping 5 batches (step 10 trains on batch 15)" in out
    later = after_resume(out)
    assert not re.search(r"\| loss (nan|inf)", later), later[-3000:]
    final = float(re.findall(r"final loss ([0-9.naif]+)", out)[-1])
    assert final == final and final < 5.0
    assert job_json(tmp_path, job)["status"] == "succeeded"
    assert_all_finite(ckpt)


def test_an_alert_policy_run_ending_on_nan_fails_unless_told(tmp_path):
    # Zero-code: the loss goes NaN for good at step 5 and the script ends normally (exit 0).
    script = tmp_path / "nan_forever.py"
    script.write_text((SCRIPTS / "plain_ddp.py").read_text().replace(
        "loss = model(x).pow(2).mean()", "loss = model(x).pow(2).mean() * (float('nan') if step >= 4 else 1.0)"))
    job = name("nanend")
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, str(script), "--steps", "30",
                   timeout=300)  # too short for the watchdog to see it: the ranks say it as they exit
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    assert "last reported loss is nan" in r.stderr
    assert job_json(tmp_path, job)["status"] == "failed"
    job = name("nanalert")
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, "--nan-policy", "alert", str(script),
                   "--steps", "30", timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def assert_not_restarted(r, job, home, *needles):
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "restarting worker group" not in out, out[-4000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("  error: ")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), r.stderr[-3000:]
    assert "trainwatch/rank/bootstrap.py" not in out and "runpy" not in out, out[-4000:]
    assert job_json(home, job)["restarts"] == 0


def test_a_missing_module_is_one_line_before_any_rank_starts(tmp_path):
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", name("nomod"), "-m", "no_such_module",
                   timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: -m no_such_module: No module named 'no_such_module'; install "
                                             "it, or check the name and the working directory"], r.stderr


def test_a_missing_import_in_the_script_is_not_restarted(tmp_path):
    script = tmp_path / "needs_dep.py"
    script.write_text("import torch\nimport no_such_module\n")
    job = name("nodep")
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, str(script), timeout=300)
    assert_not_restarted(r, job, tmp_path, f"({script}:2): ModuleNotFoundError: No module named 'no_such_module'",
                         "before its first step")


def test_an_exception_at_step_0_is_not_restarted(tmp_path):
    script = tmp_path / "bad_config.py"
    script.write_text("import torch.distributed as dist\n\ndist.init_process_group('gloo')\n"
                      "raise ValueError('width 5 is not divisible by 2')\n")
    job = name("val")
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, str(script), timeout=300)
    assert_not_restarted(r, job, tmp_path, f"({script}:4): ValueError: width 5 is not divisible by 2")


def test_a_busy_master_port_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--master-port", str(port), "--job", name("port"),
                       str(SCRIPTS / "plain_ddp.py"), timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"error: --master-port {port} is already in use on this machine: pick a "
                                             "free port (or leave --master-port out for a free one), or stop what "
                                             "listens there"], r.stderr


def test_a_failure_only_on_the_first_attempt_is_restarted(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text((SCRIPTS / "plain_ddp.py").read_text().replace(
        "    opt.step()\n",
        "    opt.step()\n    if step == 3 and os.environ.get('TORCHELASTIC_RESTART_COUNT') == '0':\n"
        "        raise RuntimeError('flaky storage: read failed')\n"))
    job = name("flaky")
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, str(script), "--steps", "10",
                   timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert job_json(tmp_path, job)["restarts"] == 1


def preempt(home, job, args, ready) -> tuple[int, str]:
    proc = start(home, "launch", "--nproc-per-node", "2", "--job", job, *args)
    lines: list[str] = []
    try:
        wait_for(lambda: ready(home, job, proc, lines), 240, what="training under way")
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as Kubernetes and scancel's notice do
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, "".join(lines) + proc.stdout.read()


def trained_to(step: int):
    def ready(home, job, proc, lines) -> bool:
        line = proc.stdout.readline()
        lines.append(line)
        return f"step {step}/" in line or proc.poll() is not None
    return ready


def test_sigterm_checkpoints_the_integrated_trainer_and_the_next_launch_resumes_bit_identically(tmp_path):
    steps = ["--max-steps", "60", "--ckpt-interval", "1000"]
    ref_ckpt = tmp_path / "ref"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", name("ref"), *TINY, *steps,
                   "--ckpt-dir", str(ref_ckpt), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:]
    job, ckpt = name("pre"), tmp_path / "ckpt"
    rc, out = preempt(tmp_path, job, [*TINY, *steps, "--ckpt-dir", str(ckpt)], trained_to(20))
    assert rc == 75, out[-4000:]
    written = re.search(r"preemption: emergency checkpoint of step (\d+) by 2 of 2 rank\(s\) in ([0-9.]+)s", out)
    assert written and float(written.group(2)) < 30, out[-4000:]
    assert job_json(tmp_path, job)["preempted"]["signal"] == "SIGTERM"
    saved = int(written.group(1))
    again = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, *TINY, *steps, "--ckpt-dir",
                       str(ckpt), timeout=400)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"(step {saved})" in again.stdout and f"steps {saved + 1}-60" in again.stdout

    from trainwatch.checkpoint import find_latest, load_checkpoint

    ref, got = load_checkpoint(find_latest(ref_ckpt))["model"], load_checkpoint(find_latest(ckpt))["model"]
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


REGISTERED = """
import os, sys, time
import torch, torch.distributed as dist
import trainwatch

dist.init_process_group("gloo")
tw = trainwatch.init()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tw.register_state(model, opt, checkpoint_dir=sys.argv[1])
for step in range(1, 100000):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    tw.step(loss=loss.item(), step=step)
    time.sleep(0.05)
"""


def test_sigterm_checkpoints_a_script_with_registered_state(tmp_path):
    script, ckpt = tmp_path / "registered.py", tmp_path / "ckpt"
    script.write_text(REGISTERED)

    def stepping(home, job, proc, lines) -> bool:
        from trainwatch import state

        rows = (state.JobDir(job, root=home).telemetry() or {}).get("ranks") or []
        return len(rows) == 2 and all((r.get("step") or 0) >= 5 for r in rows)

    rc, out = preempt(tmp_path, name("reg"), [str(script), str(ckpt)], stepping)
    assert rc == 75, out[-4000:]
    written = re.search(r"preemption: emergency checkpoint of step (\d+) by 2 of 2 rank\(s\)", out)
    assert written, out[-3000:]
    from trainwatch.checkpoint import valid_checkpoints

    found = list(valid_checkpoints(ckpt))
    assert len(found) == 2 and {i.kind for i in found} == {"emergency"}, found  # one per rank
    assert max(i.step for i in found) == int(written.group(1)) and min(i.step for i in found) >= 5


def test_a_preemption_is_one_story_from_two_sigterms_to_the_next_run(tmp_path):
    """Two SIGTERMs 30 ms apart (a scheduler that repeats its notice): the
    preemption checkpoint is still written by every rank, the job exits 75;
    diagnose, jobs and the report say `preempted` with the step saved, not a
    hang; the next run of the job clears the record."""
    import json
    import time

    from util import stop_group

    from trainwatch import state

    script, ckpt, job = tmp_path / "registered.py", tmp_path / "ckpt", name("twice")
    script.write_text(REGISTERED)
    proc = start(tmp_path, "launch", "--nproc-per-node", "2", "--job", job, str(script), str(ckpt))
    try:
        def stepping() -> bool:
            rows = (state.JobDir(job, root=tmp_path).telemetry() or {}).get("ranks") or []
            return proc.poll() is not None or (len(rows) == 2 and all((r.get("step") or 0) >= 5 for r in rows))

        wait_for(stepping, 120, what="both ranks stepping")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.03)  # the second notice 30 ms after the first, as the issue measured
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
        out = proc.stdout.read()
    finally:
        stop_group(proc, grace_s=5)
    assert rc == 75, out[-4000:]
    written = re.search(r"preemption: emergency checkpoint of step (\d+) by 2 of 2 rank\(s\)", out)
    assert written, out[-4000:]
    step = int(written.group(1))
    record = job_json(tmp_path, job)["preempted"]
    assert (record["signal"], record["saved"], record["step"]) == ("SIGTERM", True, step), record
    assert "skipped" not in record["checkpoint"]
    d = trainwatch(tmp_path, "diagnose", job, "--json", timeout=60)
    assert d.returncode == 0, d.stderr
    verdict = json.loads(d.stdout)["verdict"]
    assert (verdict["category"], verdict["runbook"]) == ("preempted", "preempted"), verdict
    assert f"checkpoint saved at step {step}" in verdict["summary"]
    jobs = trainwatch(tmp_path, "jobs", timeout=60).stdout
    assert f"{job}: preempted by SIGTERM: checkpoint saved at step {step}" in jobs, jobs
    page = trainwatch(tmp_path, "report", job, "--out", str(tmp_path / "r.html"), timeout=60)
    assert page.returncode == 0 and "preempted by SIGTERM" in (tmp_path / "r.html").read_text(), page.stderr
    again = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", job,
                       str(SCRIPTS / "plain_ddp.py"), "--steps", "3", timeout=120)
    assert again.returncode == 0, again.stdout[-3000:]
    assert job_json(tmp_path, job).get("preempted") is None
    assert "preempted" not in trainwatch(tmp_path, "jobs", timeout=60).stdout


def test_sigterm_to_a_script_without_state_says_what_was_not_saved(tmp_path):
    job = name("nostate")

    def stepping(home, job, proc, lines) -> bool:
        from trainwatch import state

        # Both ranks attached and stepping: before that no rank is there to ask, and the
        # message would be "no live rank", not the one this test is about.
        rows = (state.JobDir(job, root=home).telemetry() or {}).get("ranks") or []
        return len(rows) == 2 and all((r.get("step") or 0) >= 2 for r in rows)

    rc, out = preempt(tmp_path, job, [str(SCRIPTS / "plain_ddp.py"), "--steps", "100000", "--sleep", "0.05"],
                      stepping)
    assert rc == 75, out[-4000:]
    assert "nothing was saved: the script registers no state" in out, out[-3000:]


def test_a_node_that_rejoins_gets_its_peers_state(tmp_path):
    """--nnodes 1:2 on loopback, node-local checkpoints: node 1 is killed, node 0
    trains on alone; node 1 starts again with an empty --ckpt-dir, the job
    re-forms with 4 ranks, node 1 receives the agreed step from a rank of node 0."""
    import os
    import subprocess

    from util import BIN, ROOT, env_for, reap

    from trainwatch import netbind

    job, port = name("rejoin"), netbind.free_port()
    secret = uuid.uuid4().hex
    homes = [tmp_path / "home0", tmp_path / "home1"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1-again.log"]
    procs: list[subprocess.Popen] = []

    def start_node(i: int, log) -> subprocess.Popen:
        homes[i].mkdir(exist_ok=True)
        cmd = [str(BIN / "trainwatch"), "launch", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job, "--job", job, "--node-name", f"n{i}",
               "--rdzv-conf", "last_call_timeout=3", "--max-restarts", "5", *TINY, "--max-steps", "400",
               "--ckpt-interval", "20"]
        with open(log, "w") as f:
            # A multi-node job needs its secret on every node (the store's records are sealed with it).
            proc = subprocess.Popen(cmd, env=env_for(homes[i], TRAINWATCH_JOB_SECRET=secret), stdout=f,
                                    stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        procs.append(proc)
        return proc

    def text(path) -> str:
        return path.read_text(errors="replace")

    try:
        node0 = start_node(0, logs[0])
        wait_for(lambda: netbind.is_listening("127.0.0.1", port), 120, what="node 0's rendezvous store")
        node1 = start_node(1, logs[1])
        wait_for(lambda: "world 4" in text(logs[0]) and "step 40/" in text(logs[0]), 300,
                 what="both nodes training")
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()
        wait_for(lambda: re.search(r"world 2 .*\n(.*\n)*step \d+/", text(logs[0])), 300, what="node 0 alone")
        # Node 1 comes back with nothing on disk: its checkpoints are gone with the old machine.
        import shutil

        shutil.rmtree(homes[1])
        again = start_node(1, logs[2])
        codes = [node0.wait(timeout=600), again.wait(timeout=120)]
        assert codes == [0, 0], text(logs[0])[-3000:] + text(logs[2])[-3000:]
        out0, out1 = text(logs[0]), text(logs[2])
        assert out0.count("world 4") >= 2, out0[-3000:]
        received = re.findall(r"node n1: rank (\d) had no checkpoint of step (\d+) .*received it from rank (\d)", out1)
        assert {r for r, _, _ in received} == {"2", "3"} and {src for _, _, src in received} <= {"0", "1"}, out1[-3000:]
        assert "have no checkpoint of a step" not in out0 + out1
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for home in homes:
            if home.exists():
                reap(home)
        # Node 1's first launcher was killed and its relaunch took over its records:
        # the killed run's segment is named by this job alone, and removed here.
        from trainwatch import slots as _slots

        for leftover in Path(_slots.default_segment_dir()).glob(f"trainwatch-{os.getuid()}-{job}@*.slots"):
            leftover.unlink(missing_ok=True)
