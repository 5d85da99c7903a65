"""MFU arithmetic (trainwatch.trainer.mfu) against hand-computed values, and the
trainer's largest preset (the one MFU is measured on) training on CPU."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from trainwatch.trainer import config as cfgmod
from trainwatch.trainer import mfu
from trainwatch.trainer.config import MODEL_PRESETS, TrainConfig, resolve
from trainwatch.trainer.model import GPT


def test_param_count_by_hand_for_tiny() -> None:
    # d=64, 4 layers, block 128, vocabulary 256:
    # embeddings 256*64 + 128*64 = 24576; a block 12*64^2 + 13*64 = 49984; final LayerNorm 128.
    assert mfu.param_count(MODEL_PRESETS["tiny"]) == 24576 + 4 * 49984 + 128 == 224640


def test_flops_per_token_by_hand() -> None:
    # 6 x params + 12 x layers x width x sequence: 6*224640 + 12*4*64*64.
    assert mfu.flops_per_token(MODEL_PRESETS["tiny"], 64) == 1347840 + 196608 == 1544448
    # gpt3-1.3b: 24 blocks of 12*2048^2 + 13*2048, embeddings (256 + 2048) * 2048, final LayerNorm 4096;
    # at its default 2048 tokens, plus 12*24*2048*2048 for attention.
    big = MODEL_PRESETS["gpt3-1.3b"]
    assert mfu.param_count(big) == 24 * 50_358_272 + 4_718_592 + 4096 == 1_213_321_216
    assert mfu.flops_per_token(big, 2048) == 6 * 1_213_321_216 + 1_207_959_552


@pytest.mark.parametrize("size", sorted(MODEL_PRESETS))
def test_param_count_matches_the_model(size: str) -> None:
    with torch.device("meta"):  # shapes only: the largest preset's 1.2B weights are never allocated
        model = GPT(MODEL_PRESETS[size])
    assert model.num_params() == mfu.param_count(MODEL_PRESETS[size])


def test_mfu_by_hand() -> None:
    # 40,000 tokens/s x 8.49e9 FLOPs per token on one H100 (989 TFLOP/s bf16): 34.3%.
    assert mfu.mfu(40_000, 8.49e9, 989e12) == pytest.approx(40_000 * 8.49e9 / 989e12)
    assert mfu.mfu(40_000, 8.49e9, 989e12) == pytest.approx(0.34338, abs=1e-5)
    # Eight GPUs processing 8x the tokens: the same utilisation.
    assert mfu.mfu(320_000, 8.49e9, 989e12, devices=8) == pytest.approx(0.34338, abs=1e-5)
    assert mfu.mfu(1.0, 1.0, None) is None and mfu.mfu(1.0, 1.0, 0.0) is None


@pytest.mark.parametrize(("name", "bf16", "fp8"), [
    ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),
    ("NVIDIA H100 PCIe", 756e12, 1513e12),
    ("NVIDIA H100 NVL", 835e12, 1671e12),
    ("NVIDIA H200", 989e12, 1979e12),
    ("NVIDIA GH200 480GB", 989e12, 1979e12),
    ("NVIDIA B200", 2250e12, 4500e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, None),
    ("NVIDIA A100 80GB PCIe", 312e12, None),
    ("NVIDIA L40S", 362e12, 733e12),
])
def test_peak_table(name: str, bf16: float, fp8: float | None) -> None:
    assert mfu.peak_flops(name) == bf16
    assert mfu.peak_flops(name, "fp16") == bf16
    assert mfu.peak_flops(name, "fp8") == fp8


def test_unknown_device_and_precision() -> None:
    assert mfu.peak_flops("Tesla T4") is None and mfu.peak_for("Tesla T4") is None
    with pytest.raises(ValueError, match="precision must be"):
        mfu.peak_flops("NVIDIA H100", "fp4")


def test_the_largest_preset_trains_on_cpu(monkeypatch, tmp_path) -> None:
    """gpt3-1.3b's layer shape (width 2048, 16 heads, 2048 positions) trains two steps
    on CPU; one block instead of 24 keeps it to ~1 GB of memory."""
    from trainwatch.trainer.train import train

    for key in [k for k in __import__("os").environ if k.startswith("TRAINWATCH_")]:
        monkeypatch.delenv(key)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    one_block = dataclasses.replace(MODEL_PRESETS["gpt3-1.3b"], n_layer=1)
    monkeypatch.setitem(cfgmod.MODEL_PRESETS, "gpt3-1.3b", one_block)
    cfg = resolve(TrainConfig(model_size="gpt3-1.3b", device="cpu", batch_size=1, seq_len=32, max_steps=2,
                              resume="never", log_interval=1, ckpt_dir=str(tmp_path)), environ={})
    result = train(cfg, environ={})
    assert (result.first_step, result.last_step) == (1, 2)
    assert math.isfinite(result.first_loss) and math.isfinite(result.final_loss)


def test_deterministic_flag_trains_on_cpu() -> None:
    p = subprocess.run([sys.executable, "-m", "trainwatch.trainer", "--model-size", "tiny", "--device", "cpu",
                        "--max-steps", "2", "--log-interval", "1", "--resume", "never", "--deterministic"],
                       capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in __import__("os").environ.items() if not k.startswith("TRAINWATCH_")})
    assert p.returncode == 0, p.stderr
    assert "done: steps 1-2" in p.stdout
