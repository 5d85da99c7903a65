"""Real training scripts, unmodified, under `trainwatch launch` (tests/clients/):
Lightning Fabric and Trainer (also with strategy and devices from flags),
accelerate, FSDP2, pipeline-parallel loops (microbatches; an end-of-step
broadcast the first stage always reaches last), validation passes (also
inside the step), metric all-reduces after the step, gradient accumulation,
a script with its own checkpoints, torch.compile, an RL loop with no-grad
rollouts and a rising value loss.

Each runs once, with one injected hang and, after the restart, validation
passes (or rollouts) far longer than the hang floor: it must produce exactly
one incident (of any kind, alert-only ones included) naming the right rank,
one restart, show its steps and loss in `diagnose --json` while it runs, and
finish as plain torchrun does: before the hang and after the restart it is a
healthy run, with no incident."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from util import BIN, ROOT, env_for, events, job_json, stop_group, wait_for

pytestmark = pytest.mark.slow

CLIENTS_DIR = ROOT / "tests" / "clients"
# script -> (ranks, args, injected hang, culprit rank)
CLIENTS = {
    "fabric_lm.py": (2, ["--steps", "40"], "hang:where=dataloader,rank=1,step=12", 1),
    "lightning_trainer.py": (2, ["--steps", "40"], "hang:where=compute,rank=1,step=12", 1),
    "accelerate_loop.py": (2, ["--steps", "40"], "hang:where=dataloader,rank=1,step=12", 1),
    "fsdp_train.py": (2, ["--steps", "40"], "hang:where=compute,rank=1,step=12", 1),
    "pipeline_microbatch.py": (4, ["--steps", "40"], "hang:where=dataloader,rank=3,step=12", 3),
    "ddp_validation.py": (2, ["--steps", "60"], "hang:where=dataloader,rank=0,step=25", 0),
    "ddp_metric_allreduce.py": (2, ["--steps", "60"], "hang:where=compute,rank=1,step=12", 1),
    "ddp_grad_accum.py": (4, ["--steps", "30"], "hang:where=dataloader,rank=2,step=12", 2),
    "ddp_own_checkpoint.py": (2, ["--steps", "60", "--ckpt-every", "20"], "hang:where=checkpoint,rank=1,step=25", 1),
    "ddp_compile.py": (2, ["--steps", "40"], "hang:where=dataloader,rank=1,step=12", 1),
    "lightning_ddp_flags.py": (2, ["--steps", "40", "--strategy", "ddp", "--devices", "auto"],
                               "hang:where=compute,rank=1,step=12", 1),
    "rl_rollouts.py": (2, ["--steps", "24"], "hang:where=compute,rank=1,step=12", 1),
    "pipeline_broadcast.py": (2, ["--steps", "60"], "hang:where=compute,rank=1,step=12", 1),
    "ddp_validation_in_step.py": (2, ["--steps", "60"], "hang:where=compute,rank=1,step=25", 1),
}


# Validation passes far longer than the hang floor (5 s), as
# a large model's evaluation is, with no optimizer step in them.
SLOW_EVAL = {
    "fabric_lm.py": ["--val-every", "20", "--val-sleep", "0.14"],  # 50 batches: 7 s
    "lightning_trainer.py": ["--val-every", "20", "--val-sleep", "0.7"],  # 10 batches: 7 s
    "accelerate_loop.py": ["--eval-every", "20", "--val-sleep", "1.75"],  # 4 batches: 7 s
    "ddp_validation.py": ["--val-every", "30", "--val-sleep", "1.75"],  # 4 batches: 7 s
    "lightning_ddp_flags.py": ["--val-every", "20", "--val-sleep", "0.9"],  # 8 batches: 7 s
    "ddp_validation_in_step.py": ["--val-every", "20", "--val-sleep", "3.5"],  # 2 batches: 7 s, inside a step
    "rl_rollouts.py": ["--act-sleep", "0.1"],  # 64-step no-grad rollouts: 6.4 s between updates
}


def client_env(home: Path) -> dict:
    return env_for(home, CKPT_DIR=str(home / "client-ckpt"))


def run(cmd: list[str], home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=client_env(home), capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))


def launch_cmd(job: str, script: str, ranks: int, args: list[str], *extra: str) -> list[str]:
    return [str(BIN / "trainwatch"), "launch", "--nproc-per-node", str(ranks), "--job", job, *extra,
            str(CLIENTS_DIR / script), *args]


def unique(script: str) -> str:
    return f"{Path(script).stem.replace('_', '-')}-{uuid.uuid4().hex[:8]}"


def diagnose(home: Path, job: str) -> dict | None:
    r = run([str(BIN / "trainwatch"), "diagnose", job, "--json"], home, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else None


def few_steps(args: list[str], steps: int = 4) -> list[str]:
    """The script's arguments with `--steps` cut to `steps`: plain torchrun's run only shows how the script
    exits without trainwatch, which a few steps show as well as sixty."""
    out = list(args)
    out[out.index("--steps") + 1] = str(steps)
    return out


@pytest.mark.parametrize("script", CLIENTS)
def test_client_is_one_incident_with_the_right_culprit_and_otherwise_healthy(tmp_path, script):
    """One real run per script, checked by every assertion: healthy from a cold start (first steps, compile,
    DataLoader workers) until one injected hang, which is exactly one incident naming the right rank and one
    restart; the run after the restart is healthy again through validation passes far longer than the hang
    floor; `diagnose` shows steps and loss while it runs and `finished` after; it exits as plain torchrun does."""
    ranks, args, inject, culprit = CLIENTS[script]
    plain = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                 str(CLIENTS_DIR / script), *few_steps(args)], tmp_path / "plain")
    assert "done:" in plain.stdout, plain.stdout[-2000:] + plain.stderr[-3000:]

    job = unique(script)
    home = tmp_path / "tw"
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        slow = args + SLOW_EVAL.get(script, []) + ["--sleep", "0.05"]
        proc = subprocess.Popen(launch_cmd(job, script, ranks, slow, "--inject", inject), env=client_env(home),
                                stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
    try:
        def stepping():
            report = diagnose(home, job)
            if report and report["status"] == "running" and len(report["ranks"]) == ranks and all(
                    (r.get("step") or 0) > 0 for r in report["ranks"]):
                return report
            if proc.poll() is not None:
                return diagnose(home, job)  # finished first: the last snapshot must show the same
            return None

        live = wait_for(stepping, 240, interval=0.5, what="diagnose showing steps")
        rc = proc.wait(timeout=400)
    finally:
        stop_group(proc)
    text = log.read_text()
    assert rc == plain.returncode == 0, text[-4000:]
    found = [e for e in events(home, job) if e.kind != "restart"]
    assert [e.kind for e in found] == ["hang"], [e.summary for e in found] + [text[-3000:]]
    assert found[0].culprit_ranks == [culprit], found[0].summary
    assert culprit not in found[0].victims
    assert (job_json(home, job) or {}).get("restarts") == 1
    assert len(live["ranks"]) == ranks
    assert all((r["step"] or 0) > 0 for r in live["ranks"]), live["ranks"]
    assert any(r["loss"] is not None for r in live["ranks"]), live["ranks"]
    final = diagnose(home, job)
    assert final["verdict"]["category"] == "finished", final["verdict"]
