"""Model FLOPs utilisation of the integrated trainer: FLOPs per token from a
model preset, the GPUs' peak tensor-core throughput, and their ratio.

Pure arithmetic (no torch), so the trainer's log line, `benchmarks/gpu_check.py`
and the tests compute MFU the same way from the same table.

MFU = tokens/s x training FLOPs per token / peak FLOP/s of the devices. Training
FLOPs per token follow the PaLM estimate: 6 per parameter (a multiply-add in the
forward matmul, two in the backward) plus the attention scores and the
weighted sum of values, 12 x layers x width x sequence length. Recomputation,
padding and the optimizer are not model FLOPs: they lower MFU, as they should.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

VOCAB_SIZE = 256
"""Byte-level tokens (the model's vocabulary; trainer.model uses this value)."""


class Shape(Protocol):
    """The fields of a model preset the arithmetic needs (trainer.config.ModelPreset)."""

    n_layer: int
    d_model: int
    block_size: int


def param_count(preset: Shape) -> int:
    """Distinct parameters of trainer.model.GPT for this preset (the output head is
    tied to the token embedding and counted once)."""
    d = preset.d_model
    # Per block: two LayerNorms (2d each), qkv (3d^2 + 3d), attention out (d^2 + d),
    # MLP up (4d^2 + 4d) and down (4d^2 + d).
    block = 12 * d * d + 13 * d
    return VOCAB_SIZE * d + preset.block_size * d + preset.n_layer * block + 2 * d


def flops_per_token(preset: Shape, seq_len: int) -> float:
    """Training FLOPs per token of one forward and backward pass at this sequence length."""
    return 6.0 * param_count(preset) + 12.0 * preset.n_layer * preset.d_model * seq_len


@dataclass(frozen=True, slots=True)
class Peak:
    """Dense (no sparsity) tensor-core peak of one GPU model, FLOP/s."""

    name: str
    """Device-name fragment that identifies the GPU (as torch and NVML spell the name)."""
    bf16: float
    """bf16 / fp16 dense peak, FLOP/s."""
    fp8: float | None
    """fp8 dense peak, FLOP/s (None: the GPU has no fp8 tensor cores)."""


# Vendor datasheet figures, dense. The first fragment found in the device name
# wins, so variants come before the plain name ("H100 PCIe" before "H100") and
# "GH200" before "H200" (a GH200's name contains "H200"; its GPU is an H100's).
PEAKS: tuple[Peak, ...] = (
    Peak("H100 PCIe", 756e12, 1513e12),
    Peak("H100 NVL", 835e12, 1671e12),
    Peak("GH200", 989e12, 1979e12),
    Peak("H200 NVL", 835e12, 1671e12),
    Peak("H100", 989e12, 1979e12),
    Peak("H200", 989e12, 1979e12),
    Peak("B200", 2250e12, 4500e12),
    Peak("A100", 312e12, None),
    Peak("L40S", 362e12, 733e12),
)


def peak_for(device_name: str) -> Peak | None:
    """The table's row for a device name ('NVIDIA H100 80GB HBM3'), None when unknown."""
    for peak in PEAKS:
        if peak.name in device_name:
            return peak
    return None


def peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """Peak FLOP/s of one device for 'bf16' (also fp16) or 'fp8'; None when the
    device is not in the table or lacks that precision."""
    peak = peak_for(device_name)
    if peak is None:
        return None
    if precision == "fp8":
        return peak.fp8
    if precision in ("bf16", "fp16"):
        return peak.bf16
    raise ValueError(f"precision must be 'bf16', 'fp16' or 'fp8'; got {precision!r}")


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation (0-1) of `devices` GPUs of peak FLOP/s each
    processing tokens_per_s tokens in all; None when the peak is unknown."""
    if peak is None or peak <= 0 or devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak * devices)
