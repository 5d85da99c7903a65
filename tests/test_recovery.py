"""Recovery end to end (4 gloo ranks): a real fault, an emergency checkpoint,
a restart through torchelastic, and a resumed run whose final weights equal an
uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from util import events, job_json, start, trainwatch, wait_for

pytestmark = pytest.mark.slow

STEPS = 40
TRAINER = ["-m", "trainwatch.trainer", "--model-size", "tiny", "--max-steps", str(STEPS), "--log-interval", "10",
           "--ckpt-interval", "25"]


def final_weights(ckpt_dir):
    from trainwatch.checkpoint import find_latest, load_checkpoint

    info = find_latest(ckpt_dir)
    assert info is not None and info.step == STEPS, info
    return load_checkpoint(info)["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    home = tmp_path_factory.mktemp("reference")
    ckpt = home / "ckpt"
    r = trainwatch(home, "launch", "--nproc-per-node", "4", "--job", "ref", *TRAINER, "--ckpt-dir", str(ckpt))
    assert r.returncode == 0, r.stdout + r.stderr
    return final_weights(ckpt)


def assert_recovered(home, job, ckpt, reference, r):
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rec = job_json(home, job)
    assert rec["status"] == "succeeded" and rec["restarts"] == 1, rec
    restarts = [e for e in events(home, job) if e.kind == "restart"]
    assert len(restarts) == 1, events(home, job)
    ev = restarts[0].evidence
    assert ev["steps_lost"] <= 1, ev
    assert set(ev["breakdown"]) == {"detect_s", "capture_s", "checkpoint_s", "teardown_s", "rendezvous_s",
                                    "load_s", "first_step_s"}
    weights = final_weights(ckpt)
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name
    return ev


FAULTS = {
    "dataloader": "hang:where=dataloader,rank=2,step=12",
    "compute": "hang:where=compute,rank=2,step=12",
    "gc": "hang:where=gc,rank=2,step=12",
    "checkpoint": "hang:where=checkpoint,rank=2,step=12",
    "crash": "crash:rank=2,step=12",
}
SKIP = "hang:where=collective_skip,rank=2,step=12"


@pytest.mark.parametrize("name", list(FAULTS))
def test_recovers_bit_identical(tmp_path, reference, name):
    ckpt = tmp_path / "ckpt"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "4", "--job", name, "--inject", FAULTS[name],
                   *TRAINER, "--ckpt-dir", str(ckpt), timeout=400)
    ev = assert_recovered(tmp_path, name, ckpt, reference, r)
    assert ev["resumed_from_step"] >= 10, ev


def test_a_collective_mismatch_recovers_inside_the_ranks_bit_identical(tmp_path, reference):
    """Every rank alive and responsive: the group is formed again in the same
    processes and the newest step all staged restored from memory; no restart."""
    ckpt = tmp_path / "ckpt"
    # Step 30: past the step-time baseline, so the step that spans the stall would show as a spike.
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "4", "--job", "inproc", "--inject",
                   SKIP.replace("step=12", "step=30"), *TRAINER, "--ckpt-dir", str(ckpt), timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rec = job_json(tmp_path, "inproc")
    assert rec["status"] == "succeeded" and rec["restarts"] == 0, rec
    [incident] = events(tmp_path, "inproc")  # each incident with its actions' results merged in
    assert incident.kind == "collective_mismatch" and incident.culprit_ranks == [2], incident
    inproc = incident.in_process
    assert inproc.ok is True and inproc.ranks == [0, 1, 2, 3] and inproc.step >= 29, inproc
    assert incident.restart.requested is False and incident.checkpoint is None, incident
    assert r.stdout.count("recovered in process in") == 5  # the sidecar's line and each rank's
    weights = final_weights(ckpt)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("job, flags", [("off", ["--no-in-process"]), ("late", ["--in-process-timeout-s", "0.001"])])
def test_a_mismatch_restarts_the_processes_when_in_process_recovery_is_off_or_late(tmp_path, reference, job, flags):
    """--no-in-process, or ranks that do not answer within --in-process-timeout-s:
    the process restart, as before, bit-identical too."""
    ckpt = tmp_path / job / "ckpt"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "4", "--job", job, *flags, "--inject", SKIP,
                   *TRAINER, "--ckpt-dir", str(ckpt), timeout=400)
    assert_recovered(tmp_path, job, ckpt, reference, r)
    [incident] = [e for e in events(tmp_path, job) if e.kind == "collective_mismatch"]
    assert incident.restart.requested is True, incident
    if job == "off":
        assert incident.in_process is None, incident
    else:
        assert incident.in_process.ok is False and incident.in_process.pending, incident


def test_rank_killed_during_emergency_write(tmp_path, reference):
    """Rank 1 dies while writing its emergency checkpoint: the others' complete
    checkpoints (and every earlier one) stay valid and the job still recovers."""
    ckpt = tmp_path / "ckpt"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "4", "--job", "ekill",
                   "--inject", "hang:where=dataloader,rank=2,step=12", "--inject", "crash:rank=1,at=emergency_write",
                   *TRAINER, "--ckpt-dir", str(ckpt), timeout=400)
    assert_recovered(tmp_path, "ekill", ckpt, reference, r)
    hang = next(e for e in events(tmp_path, "ekill") if e.kind == "hang")
    assert "1" in hang.checkpoint.failed and "1" not in hang.checkpoint.written, hang.checkpoint
    assert not any(p.name.startswith("step-") and "-r1" in p.name and "emergency" in p.name for p in ckpt.iterdir())


def test_rank_killed_inside_a_periodic_checkpoint(tmp_path, reference):
    """Rank 0 is killed while it writes the periodic checkpoint of step 25 (its
    state file open, nothing renamed): the half-written temp directory is never
    taken for a checkpoint, the job resumes bit-identically, and no temp
    directory is left behind."""
    ckpt = tmp_path / "ckpt"
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "4", "--job", "pkill",
                   "--inject", "crash:rank=0,step=20,at=checkpoint", *TRAINER, "--ckpt-dir", str(ckpt), timeout=400)
    ev = assert_recovered(tmp_path, "pkill", ckpt, reference, r)
    assert ev["resumed_from_step"] == 25, ev  # the survivors' emergency checkpoints of that step
    assert not list(ckpt.glob(".tmp-*")), sorted(p.name for p in ckpt.iterdir())
    crash = next(e for e in events(tmp_path, "pkill") if e.kind == "crash")
    assert crash.culprit_ranks == [0], crash


def test_sidecar_killed_mid_run_training_goes_on(tmp_path):
    proc = start(tmp_path, "launch", "--nproc-per-node", "2", "--job", "sckill", "-m", "trainwatch.trainer",
                 "--model-size", "tiny", "--max-steps", "150", "--log-interval", "50")
    try:
        first = wait_for(lambda: (job_json(tmp_path, "sckill") or {}).get("sidecar_pid"), 60, what="sidecar pid")

        def stepping():
            try:
                ranks = json.loads((tmp_path / "jobs" / "sckill" / "telemetry.json").read_text())["ranks"]
            except (OSError, ValueError, KeyError):
                return False
            return len(ranks) == 2 and all(r["step"] >= 3 for r in ranks)

        wait_for(stepping, 60, what="training to start")
        os.kill(first, signal.SIGKILL)
        second = wait_for(
            lambda: (job_json(tmp_path, "sckill") or {}).get("sidecar_pid") not in (None, first)
            and job_json(tmp_path, "sckill")["sidecar_pid"], 30, what="a new sidecar")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        assert second != first
        assert "starting a new one (training continues)" in out
        tel = json.loads((tmp_path / "jobs" / "sckill" / "telemetry.json").read_text())
        assert sorted(r["step"] for r in tel["ranks"]) == [150, 150]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_restart_budget_spent_exits_non_zero_with_summary(tmp_path):
    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", "budget", "--max-restarts", "0",
                   "--inject", "hang:where=compute,rank=1,step=5", "-m", "trainwatch.trainer", "--model-size", "tiny",
                   "--max-steps", "100000", timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "summary for job budget" in r.stderr
    assert "restarts: 0 of 0 allowed" in r.stderr and "hang x1" in r.stderr
    assert "trainwatch runbook" in r.stderr and "Traceback" not in r.stderr.split("summary for job")[1]
    assert job_json(tmp_path, "budget")["status"] == "failed"
