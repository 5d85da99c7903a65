"""Configuration of the integrated trainer: one dataclass for the run, one per model size.

The command line is generated from `TrainConfig` (flag names, defaults and help
come from its fields), so a field added here is a flag with no second place to
update. Validation lives here too, so `python -m trainwatch.trainer` and code that
builds a config by hand get the same one-line errors.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from trainwatch import env
from trainwatch.flags import flag

CKPT_DIR_ENV = env.CKPT_DIR
"""Environment variable naming the checkpoint directory when --ckpt-dir is not given
(the launcher sets it so a restarted job finds its checkpoints)."""

DEVICES = ("auto", "cpu", "cuda")
NAN_POLICIES = ("fail", "alert")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


class UsageError(ValueError):
    """A bad flag or setting; the message says which and how to fix it."""


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm became NaN/inf under --nan-policy fail; the message says what next."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelPreset:
    """Shape of one model size, plus the batch settings it trains well with."""

    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block (d_model must divide evenly)."""
    d_model: int
    """Width of the residual stream."""
    block_size: int
    """Longest sequence the position embedding covers, in tokens."""
    batch_size: int
    """Default sequences per rank per step."""
    seq_len: int
    """Default tokens per sequence."""
    lr: float
    """Default peak learning rate."""


# Vocabulary is 256 (bytes), so the gpt2-* presets have GPT-2's layer shapes but
# fewer parameters than the originals (no 50k-token embedding): 86M and 304M.
# gpt3-1.3b has GPT-3 XL's shape (1.21B here): the size whose matmuls keep an
# H100 compute-bound (width 2048, 128-wide heads); its default batch, 8 x 2048
# tokens, is the one meant to reach 45% bf16 MFU there (about 60 GB with AdamW and activations).
MODEL_PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(n_layer=4, n_head=4, d_model=64, block_size=128, batch_size=8, seq_len=64, lr=3e-3),
    "small": ModelPreset(n_layer=4, n_head=4, d_model=128, block_size=256, batch_size=8, seq_len=64, lr=3e-3),
    "medium": ModelPreset(n_layer=6, n_head=6, d_model=384, block_size=512, batch_size=16, seq_len=256, lr=1e-3),
    "gpt2-125m": ModelPreset(n_layer=12, n_head=12, d_model=768, block_size=1024, batch_size=8, seq_len=1024, lr=6e-4),
    "gpt2-350m": ModelPreset(n_layer=24, n_head=16, d_model=1024, block_size=1024, batch_size=8, seq_len=1024, lr=3e-4),
    "gpt3-1.3b": ModelPreset(n_layer=24, n_head=16, d_model=2048, block_size=2048, batch_size=8, seq_len=2048, lr=2e-4),
}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run of the integrated trainer."""

    max_steps: int = 200
    """Last step to train (steps count from 1; a resumed run stops here too)."""
    ckpt_dir: str | None = None
    """Directory for checkpoints; default $TRAINWATCH_CKPT_DIR, else no checkpoints."""
    ckpt_interval: int = 50
    """Save a checkpoint every this many steps (and after the last step)."""
    keep: int = 3
    """Checkpoints to keep; older complete ones are deleted after each save."""
    resume: str = "auto"
    """'auto' (newest valid checkpoint in --ckpt-dir, if any), 'never', or a checkpoint path."""
    seed: int = 1234
    """Seed for weights and data order; the same seed gives the same run."""
    device: str = "auto"
    """'cuda' when a GPU is present for 'auto', else 'cpu'."""
    precision: str = "fp32"
    """'fp32', 'bf16' (autocast), 'fp16' (autocast and a dynamic loss scale, torch.amp.GradScaler;
    on CPU the autocast is bf16, the GradScaler real) or 'fp8' (transformer-engine, CUDA only)."""
    model_size: str = "small"
    """Model preset: tiny, small, medium, gpt2-125m, gpt2-350m, gpt3-1.3b."""
    batch_size: int | None = None
    """Sequences per rank per step; default depends on --model-size."""
    seq_len: int | None = None
    """Tokens per sequence; default depends on --model-size."""
    lr: float | None = None
    """Peak learning rate; default depends on --model-size."""
    warmup_steps: int | None = None
    """Linear warm-up steps; default 10% of --schedule-steps."""
    schedule_steps: int | None = None
    """Length of the warm-up + cosine LR schedule in steps; default --max-steps.
    Set it when one run is trained in parts (e.g. 10 steps, then resume to 20)."""
    min_lr_ratio: float = 0.1
    """LR at the end of the cosine, as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay (applied to matrices, not to norms or biases)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    log_interval: int = 20
    """Print a progress line every this many steps (rank 0 only)."""
    deterministic: bool = False
    """Deterministic kernels only (torch.use_deterministic_algorithms, torch's own attention kernels), so on
    CUDA a resumed run equals an uninterrupted one bit for bit; slower. CPU runs are deterministic anyway."""
    nan_policy: str | None = None
    """On a NaN/inf loss or grad norm: 'fail' stops the run (the restart rolls back to the newest
    checkpoint before that step) or 'alert' trains on; default $TRAINWATCH_NAN_POLICY, else fail."""
    nan_skip_batches: int = 0
    """After rolling back from a NaN/inf loss, skip this many batches (the data window that produced it)."""
    nan_lr_factor: float = 1.0
    """After rolling back from a NaN/inf loss, multiply the learning rate by this (0 < f <= 1)."""


def resolve(cfg: TrainConfig, *, environ: dict[str, str] | None = None) -> TrainConfig:
    """Validate cfg and fill the size-dependent defaults; raises UsageError."""
    environ = os.environ if environ is None else environ
    if cfg.model_size not in MODEL_PRESETS:
        raise UsageError(f"--model-size must be one of {', '.join(MODEL_PRESETS)}; got {cfg.model_size!r}")
    if cfg.device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}; got {cfg.device!r}")
    if cfg.precision not in PRECISIONS:
        raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}; got {cfg.precision!r}")
    preset = MODEL_PRESETS[cfg.model_size]
    out = dataclasses.replace(
        cfg,
        ckpt_dir=cfg.ckpt_dir if cfg.ckpt_dir is not None else (environ.get(CKPT_DIR_ENV) or None),
        nan_policy=cfg.nan_policy if cfg.nan_policy is not None else (environ.get(env.NAN_POLICY) or "fail"),
        batch_size=preset.batch_size if cfg.batch_size is None else cfg.batch_size,
        seq_len=preset.seq_len if cfg.seq_len is None else cfg.seq_len,
        lr=preset.lr if cfg.lr is None else cfg.lr,
        schedule_steps=cfg.max_steps if cfg.schedule_steps is None else cfg.schedule_steps,
    )
    if out.warmup_steps is None:
        out.warmup_steps = max(1, out.schedule_steps // 10)
    for name in ("max_steps", "ckpt_interval", "keep", "batch_size", "seq_len", "schedule_steps", "log_interval"):
        value = getattr(out, name)
        if value < 1:
            raise UsageError(f"--{flag(name)} must be a positive integer; got {value}")
    if out.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be 0 or more; got {out.warmup_steps}")
    if out.seq_len > preset.block_size:
        raise UsageError(
            f"--seq-len must be at most {preset.block_size} for --model-size {cfg.model_size}; got {out.seq_len}"
        )
    for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip"):
        value = getattr(out, name)
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"--{flag(name)} must be a finite number >= 0; got {value}")
    if out.lr == 0:
        raise UsageError("--lr must be greater than 0; got 0")
    if out.min_lr_ratio > 1:
        raise UsageError(f"--min-lr-ratio must be between 0 and 1; got {out.min_lr_ratio}")
    if out.nan_policy not in NAN_POLICIES:
        raise UsageError(f"--nan-policy must be one of {', '.join(NAN_POLICIES)}; got {out.nan_policy!r}")
    if out.nan_skip_batches < 0:
        raise UsageError(f"--nan-skip-batches must be 0 or more; got {out.nan_skip_batches}")
    if not (0 < out.nan_lr_factor <= 1):
        raise UsageError(f"--nan-lr-factor must be in (0, 1]; got {out.nan_lr_factor}")
    if out.resume == "":
        raise UsageError("--resume must be 'auto', 'never' or a checkpoint path; got ''")
    if out.ckpt_dir == "":
        raise UsageError("--ckpt-dir must name a directory; got ''")
    return out


def summary(cfg: TrainConfig) -> dict[str, object]:
    """The config as plain values (what a checkpoint records and weights_only loads)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
