"""benchmarks/gpu_check.py without a GPU: every check skips with its reason, in
valid JSON lines, exit 0, quickly; a check that runs past its budget is a
`timeout` (its process group and the jobs it launched ended) and the rest go on."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from util import wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def no_gpu() -> bool:
    from trainwatch.launcher.preflight import read_gpus

    return not read_gpus()[0]


needs_no_gpu = pytest.mark.skipif(not no_gpu(), reason="this machine has a GPU: the checks would run")


@needs_no_gpu
def test_without_a_gpu_every_check_skips_with_a_reason(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    env["TMPDIR"] = str(tmp_path)
    # The bound is the issue's: under 30 s on a machine without a GPU.
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    checks, summary = lines[:-1], lines[-1]["summary"]
    assert [c["check"] for c in checks] == [c.name for c in gpu_check.CHECKS]
    groups = {c["group"] for c in checks}
    assert groups == {"nvml", "trainer", "nccl", "warm_start", "overhead"}
    for c in checks:
        assert c["status"] == "skip" and c["reason"].startswith("no GPU"), c
        assert set(c) >= {"check", "group", "status", "seconds", "reason"}
    assert summary["skip"] == len(checks) and summary["fail"] == summary["timeout"] == 0
    assert summary["failed"] == [] and summary["no_gpu"]
    assert list(tmp_path.iterdir()) == []  # nothing kept when nothing ran


def test_unknown_check_is_a_one_line_error():
    p = subprocess.run([sys.executable, str(SCRIPT), "--only", "nope"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.startswith("error: --only: unknown check nope; the checks are nvml, doctor")
    assert p.stdout == ""


def by_name(name: str) -> gpu_check.Check:
    return next(c for c in gpu_check.CHECKS if c.name == name)


def test_a_check_over_its_budget_is_a_timeout_and_the_rest_go_on(tmp_path):
    """A check stuck past its 2 s budget (as a hung CUDA call would be) is killed and
    reports `timeout`; the next check still runs, in its own process."""
    ctx = gpu_check.Context(device="cpu", no_gpu="rehearsal")
    stuck = dataclasses.replace(by_name("trainer_bf16"), budget_s=2.0)
    out = []
    lines = gpu_check.run_all([(stuck, None), (by_name("doctor"), None)], ctx, tmp_path, 300.0, out.append,
                              command_for=lambda c: [sys.executable, "-c", "import time; time.sleep(600)"]
                              if c is stuck else None)
    assert out == lines
    assert [(line["check"], line["status"]) for line in lines] == [("trainer_bf16", "timeout"), ("doctor", "pass")]
    assert lines[0]["reason"] == "over its 2 s budget" and 2 <= lines[0]["seconds"] < 60
    json.dumps(lines)  # every line is JSON


LAUNCH_AND_HANG = """
import sys, time
sys.path.insert(0, {benchmarks!r})
from common import launch, new_home
launch(new_home("t"), "--nproc-per-node", "1", "--job", "gpu-check-t", "-m", "trainwatch.trainer",
       "--model-size", "tiny", "--max-steps", "100000")
time.sleep(600)
"""


def test_a_timed_out_check_ends_the_jobs_it_launched(tmp_path, monkeypatch):
    """A check that launched a job (a session of its own) and then ran over its
    budget: the job is ended with it and its shared-memory segment reaped."""
    from common import session_pids

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the launched job's home
    script = tmp_path / "launch_and_hang.py"
    script.write_text(LAUNCH_AND_HANG.format(benchmarks=str(ROOT / "benchmarks")))
    sessions = tmp_path / "doctor.sessions"

    def launched_then_timeout():
        return gpu_check.run_check(by_name("doctor"), gpu_check.Context(device="cpu"), tmp_path / "context.json",
                                   tmp_path, 20.0, command=[sys.executable, str(script)])

    line = launched_then_timeout()
    assert line["status"] == "timeout"
    pids = [int(row.split()[0]) for row in sessions.read_text().splitlines()]
    assert len(pids) == 1
    assert wait_for(lambda: not session_pids(pids[0]), 30, what="launched job ended")
    segments = [json.loads(p.read_text()).get("slots") for p in tmp_path.glob("*/jobs/*/job.json")]
    assert not any(seg and os.path.exists(seg) for seg in segments)


def test_no_time_left_skips_the_rest(tmp_path):
    ctx = gpu_check.Context(device="cpu")
    lines = gpu_check.run_all([(by_name("doctor"), None), (by_name("nvml"), "needs a GPU")], ctx, tmp_path, 0.0,
                              lambda line: None)
    assert [line["status"] for line in lines] == ["skip", "skip"]
    assert lines[0]["reason"] == "no time left of the 0 s total" and lines[1]["reason"] == "needs a GPU"


def test_a_check_that_breaks_is_a_fail_with_its_log(tmp_path, monkeypatch):
    """A check's own bug (here: no context file to read) is that check's `fail`, with the traceback quoted."""
    ctx = gpu_check.Context(device="cpu")
    line = gpu_check.run_check(by_name("doctor"), ctx, tmp_path / "context.json", tmp_path, 60.0,
                               command=[sys.executable, str(SCRIPT), "--run-check", "doctor", "--context",
                                        str(tmp_path / "missing.json"), "--result", str(tmp_path / "r.json")])
    assert line["status"] == "fail" and "no result" in line["reason"]
    assert "FileNotFoundError" in line["log_tail"]


def test_plan_without_a_gpu_and_in_the_rehearsal():
    none = gpu_check.plan(gpu_check.Context(device="none", no_gpu="no GPU: x"), None)
    assert all(reason == "no GPU: x" for _c, reason in none)
    # NVML sees GPUs but torch cannot use them: only the NVML checks run.
    nvml_only = gpu_check.plan(gpu_check.Context(device="none", gpus=[{"index": 0}], no_gpu="torch: no CUDA"), None)
    assert [c.name for c, reason in nvml_only if reason is None] == ["nvml", "doctor"]
    rehearsal = gpu_check.plan(gpu_check.Context(device="cpu"), ["nvml", "trainer_fp8"])
    assert [(c.name, reason) for c, reason in rehearsal] == [("nvml", None),
                                                            ("trainer_fp8", "needs a GPU (--device cpu rehearsal)")]


def test_trainer_figures_from_its_log():
    """MFU recomputed from the trainer's own log line (the last window of steps)."""
    out = ("trainer: model gpt3-1.3b (1213.32M params) | world 1 | device cuda | bf16 | steps 1-30\n"
           "step 10/30 | loss 3.1000 | lr 1.0e-04 | step 0.900s | 18204 tok/s | mfu 15.6%\n"
           "step 20/30 | loss 2.9000 | lr 2.0e-04 | step 0.350s | 46811 tok/s | mfu 40.2%\n"
           "step 30/30 | loss 2.7000 | lr 2.0e-04 | step 0.320s | 51200 tok/s | mfu 43.9%\n"
           "done: steps 1-30 | first loss 5.5000 | final loss 2.7000 | ratio 0.491 | 40.0s\n")
    ctx = gpu_check.Context(device="cuda", gpus=[{"index": 0, "name": "NVIDIA H100 80GB HBM3"}])
    fig = gpu_check.trainer_figures(out, ctx, "gpt3-1.3b", 8, 2048, "bf16")
    assert fig["measured_at_step"] == 30 and fig["step_s"] == 0.32
    assert fig["tokens_per_s"] == pytest.approx(8 * 2048 / 0.32)
    assert fig["mfu"] == pytest.approx(8 * 2048 / 0.32 * fig["flops_per_token"] / 989e12, abs=1e-4)
    assert fig["mfu_trainer_log"] == pytest.approx(0.439) and fig["params_m"] == 1213.32
    with pytest.raises(gpu_check.Fail, match="loss did not fall"):
        gpu_check.trainer_figures(out.replace("final loss 2.7000", "final loss nan"), ctx, "gpt3-1.3b", 8, 2048,
                                  "bf16")


@pytest.mark.gpu
def test_the_quick_gpu_checks_pass_on_a_gpu(tmp_path):
    """On a GPU machine: NVML, doctor, the sync-free loss read and the zygote's CUDA rule."""
    p = subprocess.run([sys.executable, str(SCRIPT), "--only", "nvml", "doctor", "deferred_sync", "zygote_cuda",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in p.stdout.splitlines()]
    assert [(c["check"], c["status"]) for c in lines[:-1]] == [
        ("nvml", "pass"), ("doctor", "pass"), ("deferred_sync", "pass"), ("zygote_cuda", "pass")], p.stdout
    assert p.returncode == 0
