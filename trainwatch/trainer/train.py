"""The integrated training loop: a byte-level GPT on the built-in corpus, data
parallel over torch.distributed, reporting every step to trainwatch.

Runs under `torchrun` / `trainwatch launch` (RANK, WORLD_SIZE, MASTER_ADDR set;
gloo on CPU, nccl on CUDA) or as one plain process (no process group).
Everything a step depends on (weights, optimizer moments, loss scale, LR, batch)
is either in the checkpoint or a pure function of the step number, so a resumed
run continues exactly where an uninterrupted one would be.

Each step reports its loss, grad norm, LR and (fp16) loss scale, and every
ZERO_GRAD_EVERY steps the fraction of zero gradient elements, read from the
device together in one copy.

A NaN/inf loss (or grad norm, without a loss scaler) stops the run under
--nan-policy fail, before the broken state is checkpointed: the restart rolls
back to the newest checkpoint before that step, optionally skipping the data
window that produced it (--nan-skip-batches) and lowering the LR
(--nan-lr-factor); both are kept in the checkpoint, so a later resume
continues on the same data and LR.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from dataclasses import dataclass


import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import trainwatch
from trainwatch import checkpoint as ckpt
from trainwatch.trainer.config import MODEL_PRESETS, NonFiniteLoss, TrainConfig, UsageError, summary
from trainwatch.trainer.data import get_batch, load_corpus
from trainwatch.rank import inprocess
from trainwatch.trainer import mfu
from trainwatch.lines import print_line
from trainwatch.trainer.runtime import FP8_ERROR, Runtime, check_fp8, precision_context, runtime_of, use_deterministic  # noqa: F401
from trainwatch.trainer.model import GPT
from trainwatch.trainer.resume import agree, checkpoint_writer, find_resume, finish_rollback, write_nonfinite_marker

STATE_FORMAT = 1
ZERO_GRAD_EVERY = 10
"""Steps between measurements of the fraction of zero gradient elements (one
count_nonzero per parameter: about as much as clipping costs, so not every step;
also measured at a run's first and last step)."""


@dataclass(slots=True)
class TrainResult:
    """What a finished run reports (rank 0's view; losses are averaged over ranks)."""

    first_step: int
    last_step: int
    first_loss: float
    final_loss: float
    wall_s: float
    resumed_from: str | None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Peak LR times a linear warm-up, then a cosine down to min_lr_ratio; a pure
    function of the step, so it needs no scheduler state in the checkpoint."""
    assert cfg.lr is not None and cfg.schedule_steps is not None and cfg.warmup_steps is not None
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    span = max(1, cfg.schedule_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _scaler(cfg: TrainConfig, rt: Runtime, tw) -> torch.amp.GradScaler | None:
    """fp16's dynamic loss scale. An injected `scale_collapse` fault turns it on
    whatever the precision, so the fault has a real GradScaler to collapse."""
    if cfg.precision == "fp16" or tw.faults.wants("scale_collapse"):
        return torch.amp.GradScaler(rt.device.type)
    return None


def _zero_fraction(model: GPT) -> torch.Tensor | None:
    """The fraction of gradient elements exactly 0, as a tensor on the device (not read here)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = sum(g.numel() for g in grads)
    if not total:
        return None
    nonzero = torch.stack([torch.count_nonzero(g) for g in grads]).sum()
    return 1.0 - nonzero.double() / total


def _restore(state: dict, where: str, model: GPT, opt: torch.optim.Optimizer, rt: Runtime, cfg: TrainConfig,
             scaler: torch.amp.GradScaler | None = None) -> int:
    """Load weights, optimizer, loss scale and RNG from a checkpoint state; return its step."""
    try:
        step = int(state["step"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        config = state.get("config")
        saved = config.get("model_size") if isinstance(config, dict) else None
        if saved and saved != cfg.model_size:
            raise ckpt.CheckpointError(
                f"checkpoint {where} was saved with --model-size {saved}, not {cfg.model_size}; "
                f"pass --model-size {saved}, or --resume never to start over"
            ) from None
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        raise ckpt.CheckpointError(
            f"checkpoint {where} does not fit this model or optimizer ({detail}); "
            "pass the flags it was saved with, or --resume never to start over"
        ) from None
    if scaler is not None and isinstance(state.get("scaler"), dict) and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    rng = state.get("rng", {})
    if isinstance(rng.get("torch_cpu"), torch.Tensor):
        torch.set_rng_state(rng["torch_cpu"])
    if rt.device.type == "cuda" and isinstance(rng.get("cuda"), torch.Tensor):
        torch.cuda.set_rng_state(rng["cuda"], rt.device)
    return step


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _float(value: object, default: float) -> float:
    return float(value) if isinstance(value, float) and 0 < value <= 1 else default


def _state_dict(model: GPT, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig, rt: Runtime,
                scaler: torch.amp.GradScaler | None = None, data_offset: int = 0, lr_scale: float = 1.0) -> dict:
    """The full checkpoint state: plain tensors, dicts, lists, numbers and strings."""
    rng: dict[str, torch.Tensor] = {"torch_cpu": torch.get_rng_state()}
    if rt.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(rt.device)
    extra = {"scaler": scaler.state_dict()} if scaler is not None else {}
    return extra | {
        "format": STATE_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": rng,
        "seed": cfg.seed,
        "world_size": rt.world_size,
        "config": summary(cfg),
        "data_offset": data_offset,
        "lr_scale": lr_scale,
    }


def train(cfg: TrainConfig, *, environ: dict[str, str] | None = None) -> TrainResult:
    """Run (or resume) one training job; cfg must come from config.resolve().

    Raises UsageError / CheckpointError for problems the user can fix; both are
    raised before the process group exists whenever they can be detected early.
    """
    environ = dict(os.environ if environ is None else environ)
    start_wall = time.monotonic()
    rt = runtime_of(cfg.device, environ)
    if cfg.precision == "fp8":
        check_fp8(rt)
    if cfg.ckpt_dir:
        ckpt.ensure_writable(cfg.ckpt_dir)
    tw = trainwatch.init()
    with tw.phase("checkpoint"):
        resume = find_resume(cfg, rt.rank)
    say = (lambda msg: print(msg, flush=True)) if rt.rank == 0 else (lambda msg: None)
    if not rt.distributed and resume.state is not None and resume.step >= cfg.max_steps:
        say(f"nothing to do: checkpoint {resume.where} is at step {resume.step} >= --max-steps {cfg.max_steps}")
        return TrainResult(resume.step + 1, resume.step, math.nan, math.nan, 0.0, resume.where)

    if rt.device.type == "cuda":
        torch.cuda.set_device(rt.device)
        torch.set_float32_matmul_precision("high")
    if cfg.deterministic:
        use_deterministic(rt)
    writer = rt.rank == 0
    if rt.distributed:
        tw.set_phase("init")
        dist.init_process_group("nccl" if rt.device.type == "cuda" else "gloo")
    try:
        if rt.distributed:
            with tw.phase("checkpoint"):
                # Every node resumes from the same step, and each node whose
                # --ckpt-dir rank 0 does not write to keeps its own copy.
                resume = agree(resume, cfg, say)
                writer = checkpoint_writer(cfg, rt.rank, rt.local_rank)
        if resume.rollback is not None:
            if resume.state is not None:
                say(f"rolled back to {resume.where} (step {resume.step}): the loss was non-finite at step "
                    f"{resume.rollback}")
            else:
                say(f"starting over: no finite checkpoint before step {resume.rollback}, where the loss was non-finite")
            if writer and cfg.ckpt_dir:  # every rank has loaded its state (checkpoint_writer's barriers)
                finish_rollback(cfg.ckpt_dir, resume.rollback, say)
        rollback = resume.rollback
        state, resumed_from = resume.state, resume.where
        first_step = 1 if state is None else resume.step + 1
        if first_step > cfg.max_steps:
            say(f"nothing to do: checkpoint {resumed_from} is at step {first_step - 1} >= --max-steps {cfg.max_steps}")
            return TrainResult(first_step, first_step - 1, math.nan, math.nan, 0.0, resumed_from)
        del resume
        try:
            result = _run(cfg, rt, tw, state, resumed_from, first_step, say, writer, rollback)
        finally:
            gc.unfreeze()
    except Exception as e:
        # A peer died or a collective failed: save the last completed step this
        # rank staged before exiting, so the restart loses nothing. Not when a
        # checkpoint could not be written: the same disk says the same thing.
        if not isinstance(e, ckpt.CheckpointError):
            tw.emergency_save(f"training stopped: {type(e).__name__}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    tw.close()
    result.wall_s = time.monotonic() - start_wall
    say(
        f"done: steps {result.first_step}-{result.last_step} | first loss {result.first_loss:.4f} | "
        f"final loss {result.final_loss:.4f} | ratio {result.final_loss / result.first_loss:.3f} | "
        f"{result.wall_s:.1f}s"
    )
    return result


def _run(cfg: TrainConfig, rt: Runtime, tw, state: dict | None, resumed_from: str | None, first_step: int, say,
         writer: bool = True, rollback: int | None = None) -> TrainResult:
    preset = MODEL_PRESETS[cfg.model_size]
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and every run
    # Built on the GPU when there is one: initialising the largest size's 1.2B
    # weights with the CPU's generator takes longer than a hundred training steps.
    with torch.device(rt.device) if rt.device.type == "cuda" else contextlib.nullcontext():
        model = GPT(preset, fp8=cfg.precision == "fp8").to(rt.device)
    opt = _optimizer(model, cfg, rt.device)
    scaler = _scaler(cfg, rt, tw)
    faults = tw.faults  # injected faults (--inject); no-ops unless armed in this rank
    data_offset, lr_scale = 0, 1.0
    if state is not None:
        _restore(state, resumed_from or "?", model, opt, rt, cfg, scaler)
        data_offset, lr_scale = _int(state.get("data_offset"), 0), _float(state.get("lr_scale"), 1.0)
        say(f"resumed from {resumed_from} (step {first_step - 1})")
        del state  # the checkpoint's tensors are copied in; free the CPU copy
    if rollback is not None and (cfg.nan_skip_batches or cfg.nan_lr_factor != 1.0):
        data_offset += cfg.nan_skip_batches
        lr_scale *= cfg.nan_lr_factor
        say(f"after the non-finite loss at step {rollback}: skipping {cfg.nan_skip_batches} batches "
            f"(step {first_step} trains on batch {first_step + data_offset}), LR x{lr_scale:g}")
    tw.data_offset = data_offset
    tw.resume_at(first_step - 1)
    corpus = load_corpus()
    autocast = precision_context(cfg.precision, rt.device)

    def wrap() -> torch.nn.Module:
        if not rt.distributed:
            return model
        ddp = DistributedDataParallel(model, device_ids=[rt.device] if rt.device.type == "cuda" else None)
        # DDP lays its gradient buckets out again after the first backward, and
        # the layout decides the order in which floats are summed across ranks
        # (with more than two ranks, a different order is a different result).
        # One warm-up pass (loss x 0, no optimizer step) makes every run, fresh
        # or resumed, train each step on the same layout: resume is bit-exact.
        x0, y0 = get_batch(corpus, seed=cfg.seed, step=0, rank=rt.rank, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
        with autocast():
            _, warm = ddp(x0.to(rt.device), y0.to(rt.device))
        (warm * 0.0).backward()
        opt.zero_grad(set_to_none=True)
        return ddp

    # The heap built so far (imports, model, optimizer) lives as long as the run,
    # so full garbage collections need not walk it again: the collection that
    # frees the old DDP in an in-process recovery takes milliseconds instead of
    # a third of a second (and so does destroying the old group). train() thaws it.
    gc.collect()
    gc.freeze()
    ddp = wrap()
    tokens_per_rank = cfg.batch_size * cfg.seq_len
    # MFU against the bf16 peak whatever the precision (fp8 runs only the matmuls in fp8).
    peak = mfu.peak_flops(torch.cuda.get_device_name(rt.device)) if rt.device.type == "cuda" else None
    per_token = mfu.flops_per_token(preset, cfg.seq_len)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf

    done_step = first_step - 1
    # Staged to CPU after every step, so the watchdog can save it while this rank hangs.
    tw.register_state(state_fn=lambda: _state_dict(model, opt, done_step, cfg, rt, scaler, data_offset, lr_scale),
                      checkpoint_dir=cfg.ckpt_dir, keep=cfg.keep)
    # Logging collectives get their own group, as in most real trainers: a rank
    # that desynchronises there leaves DDP's gradient all-reduces intact.
    log_group = dist.new_group() if rt.distributed else None
    # In-process recovery: the sidecar breaks the collectives (gloo connections cut, NCCL
    # communicators aborted); the group is formed again here on the same backend and the
    # state of the newest step every rank staged restored.
    recovery = tw.in_process_recovery() if rt.distributed else None
    reform = inprocess.reform_group(dist.get_backend(), rt.rank, rt.world_size,
                                    dist.distributed_c10d._get_default_store()) if recovery is not None else None

    def restore(step: int) -> None:
        nonlocal data_offset, lr_scale, done_step
        staged = tw.staged().staged_state(step)
        # The optimizer would keep the staged tensors as its own state: a copy.
        state = staged | {"optimizer": torch.utils._pytree.tree_map(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, staged["optimizer"])}
        _restore(state, "memory", model, opt, rt, cfg, scaler)
        data_offset, lr_scale = _int(staged.get("data_offset"), 0), _float(staged.get("lr_scale"), 1.0)
        tw.data_offset, done_step = data_offset, step
    say(
        f"trainer: model {cfg.model_size} ({model.num_params() / 1e6:.2f}M params) | world {rt.world_size} | "
        f"device {rt.device.type} | {cfg.precision}{' + GradScaler' if scaler and cfg.precision != 'fp16' else ''}"
        f" | steps {first_step}-{cfg.max_steps} | batch {cfg.batch_size}x{cfg.seq_len} per rank | seed {cfg.seed}"
    )

    first_loss = final_loss = math.nan
    window_s, window_n = 0.0, 0
    wait_here = rt.distributed and rt.device.type == "cuda"
    start_step = first_step
    while True:
        try:
            for step in range(first_step, cfg.max_steps + 1):
                t0 = time.monotonic()
                lr = lr_at(step, cfg) * lr_scale
                for group in opt.param_groups:
                    group["lr"] = lr
                tw.fault_point("data")
                with tw.phase("data"):
                    x, y = get_batch(corpus, seed=cfg.seed, step=step + data_offset, rank=rt.rank, batch_size=cfg.batch_size,
                                     seq_len=cfg.seq_len)
                    x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
                tw.fault_point("forward")
                with tw.phase("forward"):
                    with autocast():
                        _, loss = ddp(x, y)
                    loss = tw.perturb_loss(loss)
                with tw.phase("backward"):
                    tw.fault_point("backward")
                    (loss if scaler is None else scaler.scale(loss)).backward()  # DDP all-reduces gradients in here
                    faults.after_backward(tw, model.parameters)
                with tw.phase("optimizer"):
                    tw.fault_point("optimizer")
                    faults.before_optimizer(tw, opt)
                    if scaler is not None:
                        faults.before_unscale(tw, model.parameters)
                        scaler.unscale_(opt)  # clip the true gradients
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                    measure = step == first_step or step % ZERO_GRAD_EVERY == 0 or step == cfg.max_steps
                    zeros = _zero_fraction(model) if measure else None
                    lr_used = opt.param_groups[0]["lr"]
                    if scaler is None:
                        opt.step()
                    else:
                        scaler.step(opt)  # skipped when the gradients hold inf/NaN
                        scaler.update()
                    opt.zero_grad(set_to_none=True)
                local = loss.detach().float()
                mean = local.clone()
                # An explicit logging collective, like real trainers' loss averaging; a
                # rank told to skip it is the desynchronised rank the watchdog must catch.
                if rt.distributed and not tw.skip_collective():
                    with tw.phase("collective"):
                        dist.all_reduce(mean, group=log_group)
                    mean /= rt.world_size
                # One device-to-host copy per step for all the numbers.
                values = [local, mean, grad_norm.detach().float()]
                if scaler is not None:
                    values.append(scaler._get_scale_async().float())
                if zeros is not None:
                    values.append(zeros.float())
                # On a GPU the collectives above only queue work; this read is where the
                # host waits for the device to finish the step, all-reduces included: a
                # rank whose peer hangs blocks here, and must read as waiting on peers.
                with tw.phase("collective") if wait_here else contextlib.nullcontext():
                    local_v, mean_v, norm_v, *more = torch.stack(values).tolist()
                if recovery is not None and recovery.breaking():
                    # Its collectives may have been cut short (an aborted NCCL kernel returns
                    # early): this step is neither staged nor counted.
                    raise inprocess.RecoveryUnderWay(f"step {step} ended while its collectives were broken")
                done_step = step
                tw.step(loss=local_v, grad_norm=norm_v, step=step, lr=float(lr_used),
                        loss_scale=more[0] if scaler is not None else None,
                        zero_grad_frac=more[-1] if zeros is not None else None)
                tw.fault_point("step_end")
                # With a loss scaler an inf grad norm is an overflow the scaler skipped,
                # not a broken step. Every rank sees the same mean loss and grad norm.
                if cfg.nan_policy == "fail" and not (math.isfinite(mean_v) and (scaler is not None or math.isfinite(norm_v))):
                    what = f"loss {mean_v}" if not math.isfinite(mean_v) else f"grad norm {norm_v}"
                    if writer and cfg.ckpt_dir:
                        write_nonfinite_marker(cfg.ckpt_dir, step, what)
                    raise NonFiniteLoss(
                        f"non-finite {what} at step {step}; stopped before saving it (--nan-policy fail): a restart rolls "
                        "back to the newest checkpoint before this step; pass --nan-skip-batches N to skip the data that "
                        "produced it (and --nan-lr-factor F to lower the LR), or --nan-policy alert to train on")
                step_s = time.monotonic() - t0
                window_s, window_n = window_s + step_s, window_n + 1
                if step == start_step:
                    first_loss = mean_v
                final_loss = mean_v

                if cfg.ckpt_dir and writer and (step % cfg.ckpt_interval == 0 or step == cfg.max_steps):
                    with tw.phase("checkpoint"):
                        try:
                            ckpt.save_checkpoint(
                                cfg.ckpt_dir,
                                step,
                                _state_dict(model, opt, step, cfg, rt, scaler, data_offset, lr_scale),
                                keep=cfg.keep,
                                rank=rt.rank,
                                world_size=rt.world_size,
                                fault_point=lambda: tw.fault_point("checkpoint"),
                            )
                        except ckpt.NonFiniteState as e:  # --nan-policy alert trains on; its NaN is never saved
                            print_line(f"warning: {e}")
                if step % cfg.log_interval == 0 or step == cfg.max_steps:
                    avg_s = window_s / window_n
                    line = (
                        f"step {step}/{cfg.max_steps} | loss {mean_v:.4f} | lr {lr:.1e} | step {avg_s:.3f}s | "
                        f"{tokens_per_rank * rt.world_size / avg_s:.0f} tok/s"
                    )
                    if peak is not None:
                        line += f" | mfu {100.0 * mfu.mfu(tokens_per_rank / avg_s, per_token, peak):.1f}%"
                    say(line)
                    window_s, window_n = 0.0, 0
            break
        except Exception as e:
            if recovery is None or not recovery.wanted(e):
                raise
        # Outside the handler: its traceback would keep the old DDP (and its
        # reducer's hooks on the parameters) alive beside the new one.
        t_fault = time.monotonic()
        ddp = log_group = None
        gc.collect()
        try:
            with tw.phase("init"):
                done = recovery.recover(reform, tw.staged().staged_steps, restore)
                tw.process_group_reformed()
                ddp, log_group = wrap(), dist.new_group()
        except inprocess.RecoveryFailed as why:
            recovery.wait_for_restart(str(why))
        first_step = done + 1
        print_line(f"[trainwatch] rank {rt.rank}: recovered in process in {time.monotonic() - t_fault:.2f} s: "
                   f"process group formed again, state of step {done} restored from memory")
    return TrainResult(start_step, cfg.max_steps, first_loss, final_loss, 0.0, resumed_from)
