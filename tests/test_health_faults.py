"""Training-health faults (`--inject lr | dead_grad | scale_collapse | loss_rise |
slow_step`): their specs, and each one's real effect in a rank of the integrated
trainer, read back from the rank's slot as the sidecar would."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from trainwatch import rankrow, slots
from trainwatch.inject import faults, spec
from trainwatch.rank import telemetry as api

# ---- specs ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, step, params", [
    ("lr:value=0,rank=2,step=30", "lr", 30, {"value": 0.0}),
    ("lr", "lr", 5, {"value": 0.0}),
    ("lr:value=1e-6", "lr", 5, {"value": 1e-6}),
    ("dead_grad:rank=1,step=40", "dead_grad", 40, {}),
    ("scale_collapse:rank=0,step=7", "scale_collapse", 7, {}),
    ("loss_rise:rank=1,step=20,rate=0.05", "loss_rise", 20, {"rate": 0.05}),
    ("loss_rise", "loss_rise", 5, {"rate": 0.02}),
    ("slow_step:where=backward,delay=2.5,rank=1,step=9,every=10", "slow_step", 9,
     {"where": "backward", "delay": 2.5, "every": 10}),
    ("slow_step", "slow_step", 5, {"where": "data", "delay": 1.0, "every": 0}),
])
def test_health_fault_specs_parse(text, kind, step, params):
    f = spec.parse(text)
    assert (f.kind, f.step, f.params) == (kind, step, params)
    assert spec.decode(spec.encode([f])) == [f]


@pytest.mark.parametrize("text, needle", [
    ("lr:value=fast", "value must be a number"),
    ("lr:value=-1", "value must be a finite number >= 0"),
    ("lr:rate=1", "unknown key 'rate'"),
    ("dead_grad:value=0", "unknown key 'value'"),
    ("scale_collapse:step=0", "step must be >= 1"),
    ("loss_rise:rate=0", "rate must be greater than 0"),
    ("loss_rise:rate=inf", "rate must be a finite number"),
    ("slow_step:where=forward", "unknown where='forward'; valid: data, backward, optimizer"),
    ("slow_step:every=-1", "every must be >= 0"),
    ("slow_step:every=often", "every must be an integer"),
    ("slow_step:delay=nan", "delay must be a finite number"),
])
def test_bad_health_fault_specs_are_one_line_errors(text, needle):
    with pytest.raises(spec.InjectError) as e:
        spec.parse(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- the fault hooks, on a real rank handle ---------------------------------------------


def armed(*texts: str) -> faults.Armed:
    hooks = faults.armed_faults(spec.encode([spec.parse(t) for t in texts]), 0)
    assert isinstance(hooks, faults.Armed)
    return hooks


def rank_with(tmp_path, *texts: str) -> api.Telemetry:
    path = str(tmp_path / "seg")
    slots.create_segment(path, 1)
    return api.Telemetry(slots.Segment(path), 0, rank=0, world_size=1, restart=0, attached=True, faults=armed(*texts))


def test_slow_step_sleeps_inside_its_phase_once_or_every_n_steps(tmp_path, monkeypatch):
    slept = []
    tw = rank_with(tmp_path, "slow_step:where=optimizer,delay=0.5,rank=0,step=3,every=4",
                   "slow_step:where=data,delay=0.25,rank=0,step=2")
    monkeypatch.setattr(faults.time, "sleep", lambda s: slept.append((tw.current_step + 1, tw.phase_name, s)))
    for _ in range(12):
        for _ in range(2):  # a fault point reached twice in a step sleeps once
            tw.fault_point("data")
            tw.fault_point("optimizer")
        tw.step()
    assert slept == [(2, "data", 0.25), (3, "optimizer", 0.5), (7, "optimizer", 0.5), (11, "optimizer", 0.5)]
    assert tw.faults.unfired() == []


def test_lr_fault_holds_the_lr_against_a_scheduler(tmp_path):
    tw = rank_with(tmp_path, "lr:value=0,rank=0,step=2")
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)  # writes 0.5 back every step
    values = []
    for _ in range(3):
        w.grad = torch.ones(3)
        tw.faults.before_optimizer(tw, opt)
        values.append((opt.param_groups[0]["lr"], float(w[0].detach())))
        opt.step()
        sched.step()
        tw.step()
    assert values == [(0.5, 1.0), (0.0, 0.5), (0.0, 0.5)]
    tensor_lr = torch.optim.Adam([w], lr=torch.tensor(0.1))
    tw.faults.before_optimizer(tw, tensor_lr)
    assert isinstance(tensor_lr.param_groups[0]["lr"], torch.Tensor) and float(tensor_lr.param_groups[0]["lr"]) == 0


def test_dead_grad_and_scale_collapse_act_on_gradients(tmp_path):
    tw = rank_with(tmp_path, "dead_grad:rank=0,step=1", "scale_collapse:rank=0,step=2")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    tw.faults.after_backward(tw, model.parameters)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    tw.faults.before_unscale(tw, model.parameters)  # not yet: step 2
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    tw.step()
    assert scaler.get_scale() == 65536.0
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    tw.faults.before_unscale(tw, lambda: list(model.parameters()))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 32768.0  # a real overflow: step skipped, scale halved
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_loss_rise_is_a_steady_ramp_not_a_spike(tmp_path):
    tw = rank_with(tmp_path, "loss_rise:rank=0,step=3,rate=0.1", "spike:rank=0,step=6,factor=10")
    seen = []
    for _ in range(8):
        seen.append(round(float(tw.perturb_loss(torch.tensor(2.0))), 6))
        tw.step()
    assert seen == [2.0, 2.0, 2.0, 2.2, 2.4, 26.0, 2.8, 3.0]


# ---- the integrated trainer, attached to a slot --------------------------------------------


def run_trainer(tmp_path, *args: str, inject: tuple = ()) -> tuple[subprocess.CompletedProcess, dict, list]:
    """One plain trainer process on the CPU, attached to a one-slot segment (as under
    `trainwatch launch`), with these faults armed in its rank (0)."""
    seg = str(tmp_path / "tr.slots")
    slots.create_segment(seg, 1)
    home = tmp_path / "home"
    (home / "jobs" / "tr" / "control").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", TRAINWATCH_SLOTS=seg, TRAINWATCH_HOME=str(home), TRAINWATCH_JOB="tr",
               TRAINWATCH_INJECT=spec.encode([spec.parse(t) for t in inject]))
    proc = subprocess.run([sys.executable, "-m", "trainwatch.trainer", "--model-size", "tiny", "--device", "cpu",
                           "--resume", "never", "--log-interval", "100", *args],
                          env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    s = slots.Segment(seg)
    table = s.read_table()
    raw = {name: table[0][name].item() for name in ("grad_norm", "peak_step_s", "peak_step_s_step", "peak_data_s",
                                                    "peak_backward_s", "peak_optimizer_s")}
    raw["row"] = rankrow.decode(table, 0.0)[0]
    s.close()
    path = home / "jobs" / "tr" / "control" / "faults.jsonl"
    marks = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc, raw, marks


def test_trainer_fp16_publishes_lr_scale_zero_fraction_and_a_dead_grad(tmp_path):
    from trainwatch.trainer.config import TrainConfig, resolve
    from trainwatch.trainer.train import lr_at

    proc, raw, marks = run_trainer(tmp_path, "--max-steps", "6", "--precision", "fp16",
                                   inject=("dead_grad:rank=0,step=4",))
    r = raw["row"]
    assert r.step == 6 and "| fp16 |" in proc.stdout
    assert r.lr == pytest.approx(lr_at(6, resolve(TrainConfig(max_steps=6, model_size="tiny"))))
    assert r.loss_scale == 65536.0  # a real GradScaler, never overflowing here
    assert r.grad_norm == 0.0 and r.zero_grad_frac == 1.0 and math.isfinite(r.loss)
    assert set(r.phase_times) == {"data", "backward", "optimizer"} and r.phase_times["backward"] > 0
    assert [(m["kind"], m["step"]) for m in marks] == [("dead_grad", 4)]


def test_trainer_scale_collapse_halves_a_real_scale_every_step(tmp_path):
    proc, raw, marks = run_trainer(tmp_path, "--max-steps", "8", inject=("scale_collapse:rank=0,step=3",))
    r = raw["row"]
    assert "| fp32 + GradScaler |" in proc.stdout  # the fault turned a GradScaler on
    assert r.loss_scale == 65536.0 / 2 ** 6  # steps 3..8 overflowed
    assert math.isfinite(r.loss) and math.isinf(raw["grad_norm"])  # an overflow step's norm, as reported
    assert [(m["kind"], m["step"]) for m in marks] == [("scale_collapse", 3)]


def test_trainer_lr_fault_and_slow_step(tmp_path):
    _, raw, marks = run_trainer(
        tmp_path, "--max-steps", "6",
        inject=("lr:value=0,rank=0,step=3", "slow_step:where=optimizer,delay=0.6,rank=0,step=4"))
    r = raw["row"]
    assert r.lr == 0.0 and r.loss_scale is None and 0.0 <= r.zero_grad_frac < 1.0
    assert raw["peak_step_s_step"] == 4 and raw["peak_optimizer_s"] >= 0.6 and raw["peak_step_s"] >= 0.6
    assert r.phase_times["optimizer"] < 0.6
    assert sorted((m["kind"], m["step"]) for m in marks) == [("lr", 3), ("slow_step", 4)]


def test_fp16_checkpoints_carry_the_loss_scale_and_resume_bit_exact(tmp_path):
    from trainwatch.checkpoint import find_latest, load_checkpoint

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    env["OMP_NUM_THREADS"] = "1"
    base = [sys.executable, "-m", "trainwatch.trainer", "--model-size", "tiny", "--device", "cpu", "--precision",
            "fp16", "--schedule-steps", "6", "--ckpt-interval", "2", "--log-interval", "100"]
    for ckpt, steps in (("split", "4"), ("split", "6"), ("straight", "6")):
        proc = subprocess.run([*base, "--ckpt-dir", str(tmp_path / ckpt), "--max-steps", steps], env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    split, straight = (load_checkpoint(find_latest(tmp_path / d)) for d in ("split", "straight"))
    assert split["scaler"] == straight["scaler"] and split["scaler"]["scale"] == 65536.0
    assert split["scaler"]["_growth_tracker"] == 6  # counted across the resume, not from 0
    assert all(torch.equal(split["model"][k], straight["model"][k]) for k in straight["model"])


def test_precision_flag_accepts_fp16():
    from trainwatch.trainer.config import TrainConfig, UsageError, resolve

    assert resolve(TrainConfig(precision="fp16")).precision == "fp16"
    with pytest.raises(UsageError, match="fp32, bf16, fp16, fp8"):
        resolve(TrainConfig(precision="fp12"))


@pytest.mark.slow
def test_launched_ranks_carry_their_own_health_faults(tmp_path):
    """`trainwatch launch --inject` of two health faults on two DDP ranks: each
    stays in its rank (dead_grad zeroes after DDP's all-reduce), and the
    sidecar's telemetry shows both."""
    from util import trainwatch

    r = trainwatch(tmp_path, "launch", "--nproc-per-node", "2", "--job", "hf",
                   "--inject", "lr:value=0,rank=1,step=3", "--inject", "dead_grad:rank=0,step=3",
                   "-m", "trainwatch.trainer", "--max-steps", "8", "--model-size", "tiny", "--precision", "fp16")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    job = tmp_path / "jobs" / "hf"
    marks = sorted((m["kind"], m["rank"], m["step"]) for m in map(json.loads, (job / "control" / "faults.jsonl")
                                                                      .read_text().splitlines()))
    assert marks == [("dead_grad", 0, 3), ("lr", 1, 3)]
    ranks = {x["rank"]: x for x in json.loads((job / "telemetry.json").read_text())["ranks"]}
    assert ranks[0]["step"] == ranks[1]["step"] == 8
    assert ranks[0]["grad_norm"] == 0.0 and ranks[0]["zero_grad_frac"] == 1.0 and ranks[0]["lr"] > 0
    assert ranks[1]["lr"] == 0.0 and ranks[1]["grad_norm"] > 0 and ranks[1]["zero_grad_frac"] < 1.0
    assert all(x["loss_scale"] == 65536.0 and set(x["phase_times"]) == {"data", "backward", "optimizer"}
               for x in ranks.values())
