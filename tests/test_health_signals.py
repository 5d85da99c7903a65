"""Training-health signals a rank publishes in its slot: phase times per step,
the slowest step since the sidecar's last read, LR, loss scale, zero-gradient
fraction (trainer API and zero-code hooks), and the deferred GPU scalar reader."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from util import SCRIPTS

from trainwatch import rankrow, slots
from trainwatch.rank import phases
from trainwatch.rank import telemetry as api
from trainwatch.rank.deferred import DeferredScalar


class Clock:
    """A monotonic clock the test moves by hand: phase times are exact."""

    def __init__(self, monkeypatch, start: float = 1000.0):
        self.now = start
        monkeypatch.setattr(api, "_monotonic", self)
        monkeypatch.setattr(phases, "monotonic", self)

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def segment(tmp_path):
    path = str(tmp_path / "seg")
    slots.create_segment(path, 1)
    seg = slots.Segment(path)
    yield seg
    seg.close()


def handle(seg) -> api.Telemetry:
    return api.Telemetry(seg, 0, rank=0, world_size=1, restart=0, attached=True)


def row(seg):
    return seg.read_table()[0]


def timed(r) -> tuple:
    return tuple(round(float(r[f]), 9) for f in ("data_s", "backward_s", "optimizer_s"))


def test_phase_times_are_summed_per_step_and_reset(segment, monkeypatch):
    clock = Clock(monkeypatch)
    tw = handle(segment)
    r = row(segment)
    assert math.isnan(r["data_s"]) and math.isnan(r["lr"]) and r["peak_step_s_step"] == 0
    tw.step(loss=1.0)  # start-up: no phase entered yet
    assert all(math.isnan(v) for v in timed(row(segment)))
    for _ in range(2):  # a step may fetch twice (gradient accumulation)
        with tw.phase("data"):
            clock.tick(0.25)
        with tw.phase("forward"):
            clock.tick(1.0)
        with tw.phase("backward"):
            clock.tick(0.5)
    # the zero-code hooks' bare pair around optimizer.step()
    tw.set_phase("optimizer")
    clock.tick(0.125)
    tw.set_phase("compute")
    clock.tick(2.0)
    tw.step(loss=1.0)
    assert timed(row(segment)) == (0.5, 1.0, 0.125)
    # a step without any optimizer phase: 0.0 there now (the rank has one), not NaN
    with tw.phase("data"):
        clock.tick(0.5)
    tw.step(loss=1.0)
    assert timed(row(segment)) == (0.5, 0.0, 0.0)
    decoded = rankrow.decode(segment.read_table(), clock.now)[0]
    assert decoded.phase_times == {"data": 0.5, "backward": 0.0, "optimizer": 0.0}


def test_time_is_split_once_however_phases_nest(segment, monkeypatch):
    clock = Clock(monkeypatch)
    tw = handle(segment)
    tw.step()
    with tw.phase("backward"):
        clock.tick(0.5)
        token = tw.begin_wait()  # a blocking collective inside backward: the collective's time
        clock.tick(4.0)
        tw.end_wait(token)
        clock.tick(0.25)
        with tw.phase("backward"):  # nested same phase: counted once
            clock.tick(0.125)
        with tw.phase("optimizer"):
            clock.tick(1.0)
    # a step recorded while still in a phase: its time so far is this step's
    with tw.phase("optimizer"):
        clock.tick(0.5)
        tw.step()
        data_s, backward_s, optimizer_s = timed(row(segment))
        assert math.isnan(data_s) and (backward_s, optimizer_s) == (0.875, 1.5)  # never in `data`: not measured
        clock.tick(0.25)
    tw.step()
    assert timed(row(segment))[1:] == (0.0, 0.25)


def test_slowest_step_is_kept_until_the_sidecar_reads(segment, monkeypatch):
    clock = Clock(monkeypatch)
    tw = handle(segment)
    clock.tick(30.0)  # start-up: the first step's time includes it, never a peak
    tw.step()
    r = row(segment)
    assert math.isnan(r["peak_step_s"]) and r["peak_step_s_step"] == 0

    def step(data_s: float, backward_s: float, rest: float) -> None:
        with tw.phase("data"):
            clock.tick(data_s)
        with tw.phase("backward"):
            clock.tick(backward_s)
        clock.tick(rest)
        tw.step()

    step(0.1, 0.2, 0.7)  # step 2: 1.0 s
    step(2.0, 0.5, 0.5)  # step 3: 3.0 s, mostly data
    step(0.1, 0.2, 0.2)  # step 4: 0.5 s
    r = row(segment)
    assert (r["step"], r["peak_step_s_step"]) == (4, 3) and r["peak_step_s"] == pytest.approx(3.0)
    assert (r["peak_data_s"], r["peak_backward_s"]) == pytest.approx((2.0, 0.5))
    assert math.isnan(r["peak_optimizer_s"])  # this rank has no optimizer phase
    assert r["step_s"] == pytest.approx(0.5) and r["data_s"] == pytest.approx(0.1)
    segment.acknowledge_read(segment.read_table())  # step 4 read: the next step starts a new window
    step(0.1, 0.2, 0.3)
    r = row(segment)
    assert r["peak_step_s_step"] == 5 and r["peak_step_s"] == pytest.approx(0.6)
    step(0.1, 1.0, 0.1)
    assert row(segment)["peak_step_s_step"] == 6 and row(segment)["peak_backward_s"] == pytest.approx(1.0)


def test_trainer_api_health_values_are_published_and_kept(segment):
    tw = handle(segment)
    tw.step(loss=2.0, grad_norm=1.0, lr=3e-4, loss_scale=torch.tensor(65536.0), zero_grad_frac=0.25)
    r = rankrow.decode(segment.read_table(), 0.0)[0]
    assert (r.lr, r.loss_scale, r.zero_grad_frac) == (3e-4, 65536.0, 0.25)
    tw.step(loss=2.0, lr=1e-4)  # the others were not measured this step: kept
    r = rankrow.decode(segment.read_table(), 0.0)[0]
    assert (r.lr, r.loss_scale, r.zero_grad_frac) == (1e-4, 65536.0, 0.25)
    with pytest.raises(TypeError):
        tw.step(2.0, 1.0, 5)  # step and the health values are keyword-only


# ---- deferred GPU scalars --------------------------------------------------------


class FakeEvent:
    """Stands in for torch.cuda.Event: the test says when the copy has finished."""

    def __init__(self):
        self.done = False
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("a deferred read never waits for the device")


def fake_reader() -> tuple[DeferredScalar, FakeEvent]:
    event = FakeEvent()
    reader = DeferredScalar(buffer=lambda: torch.zeros((), dtype=torch.float32), event=lambda: event,
                            deferred=("cpu",), capturing=lambda: False)
    return reader, event


def test_cpu_scalars_are_read_at_once_other_devices_never():
    reader = DeferredScalar(capturing=lambda: False)
    assert reader.take(torch.tensor(2.5)) == 2.5 and not reader.pending
    assert reader.take(torch.tensor(1.5, device="meta")) is None and not reader.pending


def test_deferred_value_is_read_a_step_later_only_once_its_copy_is_done():
    reader, event = fake_reader()
    assert reader.take(torch.tensor(4.0)) is None  # step 1: copy queued, nothing to read yet
    assert reader.pending and event.recorded == 1
    assert reader.ready() is None  # not finished: never waited for
    event.done = True
    assert reader.take(torch.tensor(5.0)) == 4.0  # step 2 publishes step 1's value, queues its own
    assert event.recorded == 2 and reader.ready() is None
    assert reader.take(torch.tensor(6.0)) is None  # step 2's copy still running: step 3's is dropped
    assert event.recorded == 2
    event.done = True
    assert reader.ready() == 5.0 and reader.ready() is None  # each value once
    assert reader.take(torch.tensor(7.0, dtype=torch.float16)) is None
    event.done = True
    assert reader.ready() == 7.0


def test_nothing_is_queued_while_a_cuda_graph_is_captured():
    event = FakeEvent()
    reader = DeferredScalar(buffer=lambda: torch.zeros(()), event=lambda: event, deferred=("cpu",),
                            capturing=lambda: True)
    assert reader.take(torch.tensor(1.0)) is None and not reader.pending and event.recorded == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deferred_read_on_a_real_gpu():
    reader = DeferredScalar()
    value = torch.tensor(3.0, device="cuda") * 2
    assert reader.take(value) is None and reader.pending
    torch.cuda.synchronize()  # the test, not the reader, waits
    assert reader.take(torch.tensor(1.0, device="cuda", dtype=torch.bfloat16)) == 6.0
    torch.cuda.synchronize()
    assert reader.ready() == 1.0
    assert reader._buf.is_pinned()


# ---- zero-code: an unmodified script through the bootstrap -------------------------


def run_zero_code(tmp_path, *args: str, inject: list | None = None) -> list[dict]:
    from trainwatch.inject import spec

    seg = str(tmp_path / "zc.slots")
    slots.create_segment(seg, 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(TRAINWATCH_SLOTS=seg, OMP_NUM_THREADS="1", TRAINWATCH_HOME=str(tmp_path / "home"),
               TRAINWATCH_JOB="zc")
    (tmp_path / "home" / "jobs" / "zc" / "control").mkdir(parents=True)
    if inject:
        env["TRAINWATCH_INJECT"] = spec.encode([spec.parse(s) for s in inject])
    r = subprocess.run([sys.executable, "-m", "trainwatch.rank.bootstrap", str(SCRIPTS / "health_zero_code.py"),
                        *args], env=env, capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def fired(tmp_path) -> list[dict]:
    path = tmp_path / "home" / "jobs" / "zc" / "control" / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_zero_code_publishes_loss_norm_lr_scale_and_phase_times(tmp_path):
    recs = run_zero_code(tmp_path, "--steps", "5", "--scaler", "--clip", "--scheduler")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    for i, r in enumerate(recs):
        assert r["loss"] == pytest.approx(r["own_loss"], rel=1e-6)  # the loss, not the scaled loss
        assert r["grad_norm"] == pytest.approx(r["own_norm"], rel=1e-6)  # clip_grad_norm_'s total norm
        assert r["lr"] == r["own_lr"] == 0.1 * 0.5 ** i  # the LR the optimizer step used
        # the scale after update() reaches the slot with the next step
        assert (math.isnan(r["loss_scale"]) if i == 0 else r["loss_scale"] == recs[i - 1]["own_scale"])
        assert r["data_s"] >= 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        assert math.isnan(r["zero_grad_frac"])  # zero-code has no cheap exact source
    assert recs[-1]["own_scale"] == 65536.0
    assert recs[-1]["peak_step_s_step"] >= 2  # the first step (start-up) is never the peak


def test_zero_code_torch_save_is_the_checkpoint_phase(tmp_path):
    """A checkpoint written with torch.save (rank 0's alone while its peers
    wait) gets the checkpoint phase's allowance; the phase before it comes back."""
    recs = run_zero_code(tmp_path, "--steps", "2", "--save")
    for r in recs:
        assert r["save_phases"] == [slots.PHASE_CODES["checkpoint"]]
        assert r["phase_after_save"] == slots.PHASE_CODES["compute"]


def test_zero_code_sees_a_real_grad_scaler_halve_its_scale(tmp_path):
    """scale_collapse in an unmodified fp16-style script: from step 3 the scaler
    finds inf gradients, skips optimizer.step() and halves its scale every step;
    each skipped iteration is still a step."""
    recs = run_zero_code(tmp_path, "--steps", "7", "--scaler", "--clip",
                         inject=["scale_collapse:rank=0,step=3"])
    assert [r["step"] for r in recs] == list(range(1, 8))
    scales = [r["own_scale"] for r in recs]
    assert scales == [65536.0, 65536.0, 32768.0, 16384.0, 8192.0, 4096.0, 2048.0]
    assert [r["loss_scale"] for r in recs[1:]] == scales[:-1]
    assert all(math.isinf(r["grad_norm"]) for r in recs[2:]) and all(math.isfinite(r["loss"]) for r in recs)
    assert len({r["weights"] for r in recs[2:]}) == 1  # every step from 3 on was skipped
    assert [(f["kind"], f["step"]) for f in fired(tmp_path)] == [("scale_collapse", 3)]


def test_zero_code_faults_lr_loss_rise_dead_grad(tmp_path):
    recs = run_zero_code(tmp_path, "--steps", "7", "--clip", "--scheduler",
                         inject=["lr:value=0,rank=0,step=3", "loss_rise:rank=0,step=4,rate=0.5",
                                 "dead_grad:rank=0,step=6"])
    # lr: 0.0 from step 3 on, though the scheduler writes its own value back every step
    assert [r["lr"] for r in recs] == [0.1, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert all(r["own_lr_after"] > 0 for r in recs)
    assert len({r["weights"] for r in recs[2:]}) == 1  # lr 0: the weights stop moving
    # loss_rise: frozen weights, one fixed batch: the true loss is constant, the rank's rises linearly
    base = recs[2]["own_loss"]
    for n, r in enumerate(recs, 1):
        if n >= 3:
            assert r["loss"] == pytest.approx(base * (1 + 0.5 * max(0, n - 4)), rel=1e-6)
            assert r["own_loss"] == pytest.approx(base, rel=1e-6)
    # dead_grad: zeroed after backward, before clipping reads them
    assert [r["grad_norm"] == 0.0 for r in recs] == [False] * 5 + [True] * 2
    assert [(f["kind"], f["step"]) for f in fired(tmp_path)] == [("lr", 3), ("loss_rise", 4), ("dead_grad", 6)]


def test_zero_code_slow_step_lands_in_its_phase(tmp_path):
    recs = run_zero_code(tmp_path, "--steps", "5",
                         inject=["slow_step:where=backward,delay=0.6,rank=0,step=3"])
    last = recs[-1]
    assert last["peak_step_s_step"] == 3 and last["peak_backward_s"] >= 0.6 and last["peak_step_s"] >= 0.6
    assert recs[2]["backward_s"] >= 0.6 and all(r["backward_s"] < 0.6 for r in recs[3:])


def test_a_long_no_grad_block_is_published_as_eval_and_left_when_it_ends(segment):
    """An RL rollout under one `torch.no_grad()`: no progress until it ends. Once
    open FORWARD_ONLY_S the sampler publishes it as `eval` from its start; the
    block's end returns the rank to `compute`. A short block changes nothing."""
    tw = handle(segment)
    tw.set_phase("compute")
    start = 1000.0
    tw._nograd_since = start
    tw._publish_forward_only(start + 0.5)  # short so far: nothing
    assert slots.phase_name(row(segment)["phase"]) == "compute"
    tw._publish_forward_only(start + tw.FORWARD_ONLY_S + 0.1)
    r = row(segment)
    assert slots.phase_name(r["phase"]) == "eval" and r["phase_mono"] == start
    tw.end_forward_only()
    assert slots.phase_name(row(segment)["phase"]) == "compute" and tw._nograd_since == 0.0
    # a block that ends before the sampler looks never leaves a trace
    tw._nograd_since = start + 10
    tw.end_forward_only()
    assert slots.phase_name(row(segment)["phase"]) == "compute"


def test_the_step_after_the_process_group_is_formed_again_is_timed_from_there(segment, monkeypatch):
    """In-process recovery: the stall and the recovery before the first step
    in the new group are the incident's time. That step is timed from the
    re-formed group and, like a new process's first, is never a peak (a
    step_time_spike beside the mismatch it recovered from)."""
    clock = Clock(monkeypatch)
    tw = handle(segment)
    for _ in range(3):
        clock.tick(0.1)
        tw.step()
    segment.acknowledge_read(segment.read_table())
    with tw.phase("collective"):
        clock.tick(5.0)  # the stall, then the recovery
    tw.process_group_reformed()
    clock.tick(0.1)
    tw.step()
    r = row(segment)
    assert r["step_s"] == pytest.approx(0.1) and r["peak_step_s_step"] != 4, (r["step_s"], r["peak_step_s"])
